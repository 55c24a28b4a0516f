"""The typed config of `freescale pipeline` (freescale/jobs/workflow/run.py): one dataclass per TOML section, every
choice a ``Literal``, loaded by the typed-config engine the training config and every job's command line
use (``freescale.runtime.typed_config``: a bad key or value is one line naming it). No torch, no Spark.
[prepare], [balance] and [train] are derived from their jobs' specs (``freescale.runtime.options.section``:
PrepareSpec, BalanceSpec, LaunchSpec), whose options say what each key means; the others are declared here, a docstring per field.

    [pipeline]  workdir, tracking_uri, world_size, local_batch_size
    [prepare]   the input (or the synthetic generator)       [calibrate]  the cost model (optional)
    [balance]   strategy, window_steps, ...                  [train]      a training config + overrides
    [compare]   contiguous vs balanced (optional)        [export]     the trained model (optional)
    [recommend] every user's top k from the exported model (optional)
    [promote]   incremental mode: the alias that moves to a new day's model when it is not worse
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from freescale.jobs.launch import LaunchSpec  # no torch
from freescale.runtime import options
from freescale.runtime.errors import InputError
from freescale.runtime.typed_config import ConfigError, apply_table, flatten, nested, parse_overrides, read_toml
from freescale.prepare.prepare_spec import PrepareSpec  # standard library only
from freescale.shards.balance_spec import BalanceSpec, StrategyName  # the balancing registry's names only: numpy
from freescale.training.parallel.rank_checks import check_ranks_can_run
from freescale.tracking.store import DEFAULT_EXPERIMENT
from freescale.training.config import load_config  # no torch
from freescale.training.export.spec import ExportSpec  # standard library only
from freescale.training.export.recommend_spec import RecommendSpec  # standard library only

# ------------------------------------------------------------------------------ config


@dataclass
class PipelineSection:
    workdir: str = "out/pipeline"
    """Where every stage writes (prepared/, cost_model.json, freescale/shards/, checkpoints/, train_summary.json,
    compare/) and where the stage records and the lock live. Relative paths in this file are
    relative to the directory the command runs in, as for every `freescale` command."""
    tracking_uri: str = ""
    """MLflow URI of every stage; empty = $MLFLOW_TRACKING_URI or sqlite:///mlflow.db; 'none' disables.
    Not part of any fingerprint: changing it reruns nothing."""
    experiment: str = DEFAULT_EXPERIMENT
    """MLflow experiment of every stage."""
    world_size: int = 2
    """Training ranks K: balance plans for K, train starts K local ranks, compare uses K."""
    local_batch_size: int = 32
    """Samples per rank per step B (balance and compare)."""
    master: str = ""
    """Spark master of the Spark stages (prepare, balance, recommend), e.g. spark://HOST:7077; empty =
    spark-submit's when run under it, else local[*]. Not part of any fingerprint."""
    incremental: bool = False
    """Daily training: [prepare] input is a folder of day partitions (a subfolder or file per day, in
    name order; ``day=`` prefixes are dropped from the day's name). Each day runs in <workdir>/days/<day>:
    prepared on top of the day before (prepare --previous), its new samples balanced, trained from the
    day before's checkpoint (--init-from), exported, registered ([export] register) and promoted
    ([promote]); a day already done is skipped, as any current stage is."""

    def __post_init__(self) -> None:
        if not self.workdir:
            raise ValueError("workdir must not be empty")
        for name in ("world_size", "local_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


PrepareSection = options.section(PrepareSpec, "pipeline", "PrepareSection")
"""``[prepare]``: the options of ``freescale.prepare.prepare_spec.PrepareSpec`` offered to the pipeline (input,
format, user_features, user_feature_cols, max_seq_len, keep_duplicates, synthetic_users,
synthetic_items, seed, synthetic_groups, synthetic_group_share; "" for none: the synthetic
generator, the format from the file name)."""


@dataclass
class CalibrateSection:
    enabled: bool = False
    """Fit the cost model to this machine and the [train] model (`freescale calibrate`) and balance with it."""
    cost_model: str = ""
    """A cost-model JSON to balance with instead (its file identity is part of balance's fingerprint);
    empty with enabled = false: balance's built-in analytic model."""
    repeats: int = 7
    """Timed rounds over all calibration batches (medians are used)."""
    held_out_batches: int = 24
    """Mixed batches the written model is checked on; 0 skips the check."""
    rank_speeds: bool = False
    """Also measure relative rank speeds (world_size ranks) and balance with them as capacities."""

    def __post_init__(self) -> None:
        if self.enabled and self.cost_model:
            raise ValueError("enabled = true and cost_model are exclusive (calibrate, or use the given model)")
        if self.rank_speeds and not self.enabled:
            raise ValueError("rank_speeds needs enabled = true")


BalanceSection = options.section(BalanceSpec, "pipeline", "BalanceSection")
"""``[balance]``: the options of ``freescale.shards.balance_spec.BalanceSpec`` offered to the pipeline (strategy,
window_steps, seed, equal_counts, token_cap, leftover, time_limit; an optional number is 0 for none)."""


TrainSection = options.section(LaunchSpec, "pipeline", "TrainSection", extra=(
    ("overrides", dict[str, Any], field(default_factory=dict)),))
"""``[train]``: the options of ``freescale.jobs.launch.LaunchSpec`` offered to the pipeline (config: a training
config TOML, "" = the built-in defaults; max_steps, 0 = the training config's training.max_steps;
run_name, "" = derived from the shards and strategy), and ``[train.overrides]``: training config
values on top of the file, e.g. ``training.max_steps = 40`` or ``checkpoint.every_steps = 10``
(checkpoint.folder is always <workdir>/checkpoints). The ``model.*`` and ``loss.*`` ones also reach
calibrate."""


@dataclass
class CompareSection:
    enabled: bool = False
    """Also run `freescale compare`: contiguous vs balanced training on the prepared data."""
    strategy: StrategyName = options.default_of(BalanceSpec, "strategy")
    """The balanced side's strategy."""
    repeats: int = 1
    """Training runs per side."""
    control: bool = False
    """Also train the mirror control (the machine's noise floor)."""
    max_steps: int = 0
    """Steps per training; 0 = [train] max_steps (when set), else the training config's."""


ExportSection = options.section(ExportSpec, "pipeline", "ExportSection", extra=(
    ("enabled", bool, field(default=False)),))
"""``[export]``: ``enabled`` (export the trained model at the end: `freescale export` of <workdir>/checkpoints
into <workdir>/model, logged on the training's MLflow run; the training config must keep checkpoints)
and the options of ``freescale.training.export.spec.ExportSpec`` offered to the pipeline (register: a model
registry name, "" = none)."""


RecommendSection = options.section(RecommendSpec, "pipeline", "RecommendSection", extra=(
    ("enabled", bool, field(default=False)),))
"""``[recommend]``: ``enabled`` (after export, every prepared user's top k: `freescale recommend` of
<workdir>/model on <workdir>/prepared into <workdir>/recommendations; needs [export] enabled) and the
options of ``freescale.training.export.recommend_spec.RecommendSpec`` offered to the pipeline (k; exclude_history: "true",
"false", "" = the model's default)."""


@dataclass
class PromoteSection:
    alias: str = "champion"
    """The registered model's alias that points at the version to serve (incremental mode, with [export]
    register): it moves to a new day's version only when that version is not worse than the one it
    points at, on the new day's held-out targets."""
    metric: Literal["ndcg_at_10", "hr_at_10"] = "ndcg_at_10"
    """Full-catalog metric of the comparison (each user's newest event, held out, ranked among every item)."""
    max_users: int = 10_000
    """Held-out users scored per model (the first by user id); 0 = all."""

    def __post_init__(self) -> None:
        if not self.alias.strip():
            raise ValueError("alias must not be empty")
        if self.max_users < 0:
            raise ValueError(f"max_users must be >= 0, got {self.max_users}")


@dataclass
class WorkflowConfig:
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    """``[pipeline]``: the working directory, tracking and the shared sizes."""
    prepare: PrepareSection = field(default_factory=PrepareSection)
    """``[prepare]``: raw logs (or synthetic data) -> sequences."""
    calibrate: CalibrateSection = field(default_factory=CalibrateSection)
    """``[calibrate]``: the cost model (optional stage)."""
    balance: BalanceSection = field(default_factory=BalanceSection)
    """``[balance]``: sequences -> balanced shards."""
    train: TrainSection = field(default_factory=TrainSection)
    """``[train]``: the training run on the shards."""
    compare: CompareSection = field(default_factory=CompareSection)
    """``[compare]``: contiguous vs balanced (optional stage)."""
    export: ExportSection = field(default_factory=ExportSection)
    """``[export]``: the trained model as one folder and an MLflow model (optional stage)."""
    recommend: RecommendSection = field(default_factory=RecommendSection)
    """``[recommend]``: every user's top k from the exported model (optional stage)."""
    promote: PromoteSection = field(default_factory=PromoteSection)
    """``[promote]``: in incremental mode, which registered version the alias points at."""


def load_workflow_config(path: str, overrides: list[str]) -> WorkflowConfig:
    """Defaults, the TOML file, then `--section.key VALUE` overrides; a bad key or value is one
    ConfigError line naming it. The training config and its overrides are checked too."""
    tables = [(path, read_toml(path))]
    tables += [("command line", nested(key, value)) for key, value in parse_overrides(overrides)]
    config = WorkflowConfig()
    for source, table in tables:
        train = table.get("train")
        if isinstance(train, dict) and "overrides" in train:  # free-form training keys, checked below
            train = dict(train)
            extra = train.pop("overrides")
            if not isinstance(extra, dict):
                raise ConfigError(f"{source}: train.overrides must be a table")
            config.train.overrides.update(flatten(extra))
            table = {**table, "train": train}
        apply_table(config, table, source)
    fixed = [key for key in ("checkpoint.folder", "data.shards") if key in config.train.overrides]
    if fixed:
        raise ConfigError(f"{path}: train.overrides.{fixed[0]}: set by the pipeline (<workdir>/checkpoints, "
                          "<workdir>/shards), not settable")
    try:
        # What the training config alone decides, before the pipeline's first stage runs.
        check_ranks_can_run(load_config(config.train.config or None, override_argv(config.train.overrides)))
    except (ConfigError, InputError) as exc:
        raise ConfigError(f"{path}: [train]: {exc}") from None
    return config


def override_argv(overrides: dict[str, Any]) -> list[str]:
    return [arg for key, value in overrides.items() for arg in (f"--{key}", toml_text(value))]


def toml_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
