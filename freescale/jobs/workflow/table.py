"""The stages of `freescale pipeline`, one record each, in run order (``STAGES``, at the end);
freescale/jobs/workflow/run.py runs them, the engine in freescale/jobs/workflow/stages.py skips the current ones.

A stage is its record, a ``StageDef``, and its section in freescale/jobs/workflow/config.py: the
stages it reads, how its job's arguments are built (its section, the shared sizes, the upstream
outputs in the working directory), the job they are handed to, its output and how a rerun tells
that output is intact. Its fingerprint is derived from those arguments (``stages.stage_params``),
the identity of the input files it names and its upstream stages' fingerprints: never listed here.
"""
from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from freescale.jobs.workflow.config import WorkflowConfig, override_argv, toml_text
from freescale.jobs.workflow.stages import Stage, json_damage, stage_params
from freescale.runtime import options
from freescale.runtime.errors import InputError
from freescale.shards.balance_spec import BalanceSpec  # the balancing registry's names only: numpy

Values = dict[str, Any]


class Workdir:
    """Where each stage writes, under [pipeline] workdir."""

    def __init__(self, root: Path, previous: Workdir | None = None):
        self.root = root
        self.previous = previous
        """Incremental mode: the day before's working directory, whose outputs this day starts from."""
        self.prepared, self.shards, self.checkpoints, self.compare = (
            root / name for name in ("prepared", "shards", "checkpoints", "compare"))
        self.cost_model, self.rank_speeds = root / "cost_model.json", root / "rank_speeds.json"
        self.model, self.recommendations = root / "model", root / "recommendations"
        self.summary, self.compare_summary = root / "train_summary.json", root / "compare_summary.json"
        self.promotion = root / "promotion.json"


@dataclass(frozen=True)
class StageDef:
    """One stage of the pipeline: everything a new stage declares, with its config section."""

    name: str
    upstream: tuple[str, ...]
    """The stages whose output it reads: when one of them runs, it runs too."""
    section: str
    """Its config section (``[name]``): ``enabled = false`` there leaves it out, unless ``off`` says otherwise."""
    values: Callable[[WorkflowConfig, Workdir], Values]
    """Its job's spec values: from its section, the shared sizes and the upstream outputs."""
    job: Callable[[Values, Values, WorkflowConfig], int]
    """Calls the job with its values, its training-config overrides and the config's tracking; its exit status."""
    output: str
    """The ``Workdir`` attribute of its output."""
    intact: Callable[[WorkflowConfig, Workdir], str | None]
    """What is wrong with its output (None: intact, a rerun may skip the stage)."""
    overrides: Callable[[WorkflowConfig, Workdir], Values] = lambda config, work: {}
    """The training config values its job sets on top of [train] config."""
    inputs: tuple[str, ...] = ()
    """Its values that name input files: their identity (size, modification time) is fingerprinted too."""
    off: Callable[[WorkflowConfig], str | None] | None = None
    """Why it is left out (None: it is not); unset: its section's ``enabled``."""
    before_run: Callable[[Workdir, bool], str] | None = None
    """Called before it runs with whether it may continue its last run (Stage.before_run)."""
    chained: bool = False
    """Incremental mode: it starts from the day before's output of the same stage, whose fingerprint is
    then part of its own (a day redone makes the days after it run again)."""


def build_stages(config: WorkflowConfig, previous: Workdir | None = None) -> list[Stage]:
    """The stages of ``config`` in order (STAGES), bound to its values and its working directory (and,
    in incremental mode, to the day before's)."""
    work = Workdir(Path(config.pipeline.workdir), previous)
    return [bind(stage, config, work) for stage in STAGES]


def bind(stage: StageDef, config: WorkflowConfig, work: Workdir) -> Stage:
    from freescale.jobs.workflow.stages import read_record

    values, overrides = stage.values(config, work), stage.overrides(config, work)
    shown = {key: toml_text(value) for key, value in overrides.items()}  # as the job's command line has them
    params = stage_params(values, shown, work.root, stage.inputs)
    if stage.chained and work.previous is not None:
        params["day before"] = (read_record(work.previous.root, stage.name) or {}).get("fingerprint")
    if stage.off is not None:
        off = stage.off(config)
    else:
        enabled = getattr(getattr(config, stage.section), "enabled", True)
        off = None if enabled else f"[{stage.section}] enabled = false"
    before = stage.before_run
    return Stage(stage.name, lambda: stage.job(values, overrides, config), params, getattr(work, stage.output),
                 lambda: stage.intact(config, work), off=off, upstream=stage.upstream,
                 before_run=None if before is None else lambda continuable: before(work, continuable))


def tracking_of(config: WorkflowConfig):
    """The tracking of a stage whose job takes a typed spec."""
    from freescale.tracking.store import Tracking

    return Tracking(config.pipeline.tracking_uri, config.pipeline.experiment)


def used_cost_model(config: WorkflowConfig, work: Workdir) -> str | None:
    """The cost model balance and compare plan with: calibrate's, the given one, or none (the built-in)."""
    return str(work.cost_model) if config.calibrate.enabled else (config.calibrate.cost_model or None)


# ------------------------------------------------------------------------------ each stage's arguments


def prepare_values(config: WorkflowConfig, work: Workdir) -> Values:
    """The prepare stage's spec values: the [prepare] section, into the workdir."""
    values = {**options.section_values(config.prepare), "output": str(work.prepared), "overwrite": True,
              "master": config.pipeline.master or None}
    if work.previous is not None:
        values["previous"] = str(work.previous.prepared)
    return values


def calibrate_values(config: WorkflowConfig, work: Workdir) -> Values:
    """The calibrate stage's spec values: [calibrate], the training config, into the workdir."""
    cal = config.calibrate
    values: Values = {"output": str(work.cost_model), "config": config.train.config or None,
                      "repeats": cal.repeats, "held_out_batches": cal.held_out_batches, "overwrite": True}
    if cal.rank_speeds:
        values.update(rank_speeds_output=str(work.rank_speeds), nproc_per_node=config.pipeline.world_size)
    return values


def timed_overrides(config: WorkflowConfig, work: Workdir | None = None) -> Values:
    """The overrides on calibrate's timed config: it times the trained model, so [train.overrides]' keys
    of its shape, its loss and the encoder's arithmetic (``TIMED_KEYS``)."""
    from freescale.training.calibration.calibrate_spec import TIMED_KEYS  # standard library only

    return {k: v for k, v in config.train.overrides.items() if k.startswith(TIMED_KEYS)}


def balance_values(config: WorkflowConfig, work: Workdir) -> Values:
    """The balance stage's spec values: the [balance] section, the shared sizes, [calibrate]'s cost
    model and rank speeds (as ``@FILE``, read when the stage runs: calibrate writes it first)."""
    p = config.pipeline
    values = {**options.section_values(config.balance), "input": str(work.prepared), "output": str(work.shards),
              "world_size": p.world_size, "local_batch_size": p.local_batch_size,
              "cost_model": used_cost_model(config, work), "overwrite": True, "master": p.master or None}
    if config.calibrate.rank_speeds:
        values["capacities"] = f"@{work.rank_speeds}"
    return values


def train_values(config: WorkflowConfig, work: Workdir) -> Values:
    """The train stage's spec values: [train], the shards, one rank per world_size."""
    p = config.pipeline
    return {**options.section_values(config.train), "shards": str(work.shards), "nproc_per_node": p.world_size,
            "summary_json": str(work.summary), "tracking_uri": tracking_of(config).uri}


def train_overrides(config: WorkflowConfig, work: Workdir) -> Values:
    """The overrides on the train stage's ranks' config: the checkpoint folder, [train.overrides], the experiment."""
    warm = {} if work.previous is None else {"training.init_from": str(work.previous.checkpoints)}
    return {"checkpoint.folder": str(work.checkpoints), **warm, **config.train.overrides,
            "tracking.experiment": config.pipeline.experiment}


def compare_values(config: WorkflowConfig, work: Workdir) -> Values:
    """The compare stage's spec values: [compare], the shared sizes, the cost model, and the balanced
    variant's plan options: [balance]'s, with [compare]'s strategy."""
    p, tr, cmp_cfg = config.pipeline, config.train, config.compare
    from_balance = options.section_values(config.balance)
    balanced = {f.name: from_balance.get(f.name, f.default) for f in options.on_surface(BalanceSpec, "compare")}
    return {"input": str(work.prepared), "world_size": p.world_size, "local_batch_size": p.local_batch_size,
            "repeats": cmp_cfg.repeats, "control": cmp_cfg.control, "config": tr.config or None,
            "cost_model": used_cost_model(config, work), "max_steps": cmp_cfg.max_steps or tr.max_steps or None,
            "workdir": str(work.compare), "summary_json": str(work.compare_summary),
            "balanced": {**balanced, "strategy": cmp_cfg.strategy}}


def export_values(config: WorkflowConfig, work: Workdir) -> Values:
    """The export stage's spec values: [export]'s, from the train stage's checkpoints into <workdir>/model."""
    return {**options.section_values(config.export), "checkpoint": str(work.checkpoints),
            "output": str(work.model), "prepared": str(work.prepared), "overwrite": True}


def recommend_values(config: WorkflowConfig, work: Workdir) -> Values:
    """The recommend stage's spec values: [recommend]'s, the exported model on the prepared users."""
    return {**options.section_values(config.recommend), "model": str(work.model), "input": str(work.prepared),
            "output": str(work.recommendations), "overwrite": True, "master": config.pipeline.master or None}


def promote_values(config: WorkflowConfig, work: Workdir) -> Values:
    """The promote stage's values: [promote]'s, the day's exported model and held-out data."""
    return {**dataclasses.asdict(config.promote), "model": str(work.model), "prepared": str(work.prepared),
            "output": str(work.promotion)}


# ------------------------------------------------------------------------------ each stage's job


def prepare_job(values: Values, overrides: Values, config: WorkflowConfig) -> int:
    from freescale.jobs import prepare

    return prepare.run(lambda: options.from_values(type(config.prepare).spec, values), tracking_of(config))


def calibrate_job(values: Values, overrides: Values, config: WorkflowConfig) -> int:
    from freescale.jobs import calibrate
    from freescale.training.calibration.calibrate_spec import CalibrateSpec

    return calibrate.run(lambda: options.from_values(CalibrateSpec, values), override_argv(overrides),
                         tracking_of(config))


def balance_job(values: Values, overrides: Values, config: WorkflowConfig) -> int:
    from freescale.jobs import balance

    return balance.run(lambda: options.from_values(type(config.balance).spec, values), tracking_of(config))


def train_job(values: Values, overrides: Values, config: WorkflowConfig) -> int:
    from freescale.jobs import launch  # its tracking: the values' tracking_uri, the experiment override

    return launch.run(lambda: options.from_values(type(config.train).spec, values), override_argv(overrides))


def compare_job(values: Values, overrides: Values, config: WorkflowConfig) -> int:
    from freescale.jobs import compare

    return compare.run(lambda: options.from_values(compare.CompareSpec, values), override_argv(overrides),
                       tracking_of(config))


def export_job(values: Values, overrides: Values, config: WorkflowConfig) -> int:
    from freescale.jobs import export

    return export.run(lambda: options.from_values(export.ExportSpec, values), tracking_of(config))


def promote_job(values: Values, overrides: Values, config: WorkflowConfig) -> int:
    from freescale.jobs.workflow import promote

    return promote.run(values, tracking_of(config))


def recommend_job(values: Values, overrides: Values, config: WorkflowConfig) -> int:
    from freescale.jobs import recommend
    from freescale.training.export.recommend_spec import RecommendSpec  # standard library only

    return recommend.run(lambda: options.from_values(RecommendSpec, values), tracking_of(config))


# ------------------------------------------------------------------------------ intact checks and switches


def prepare_intact(config: WorkflowConfig, work: Workdir) -> str | None:
    if not (work.prepared / "sequences").is_dir():
        return f"{work.prepared / 'sequences'} is missing"
    return json_damage(work.prepared / "prepare.json", "prepare summary")()


def calibrate_intact(config: WorkflowConfig, work: Workdir) -> str | None:
    from freescale.costs.cost_model import CostModel

    try:
        CostModel.load(work.cost_model)
    except InputError as exc:
        return str(exc)
    return json_damage(work.rank_speeds, "rank speeds file")() if config.calibrate.rank_speeds else None


def balance_intact(config: WorkflowConfig, work: Workdir) -> str | None:
    from freescale.shards.manifest import ShardError, load_manifest

    try:
        load_manifest(work.shards, config.pipeline.world_size)
    except ShardError as exc:
        return str(exc)
    return None


def recommend_intact(config: WorkflowConfig, work: Workdir) -> str | None:
    done = work.recommendations / "_SUCCESS"
    return None if done.is_file() else f"{done} is missing"


def calibrate_off(config: WorkflowConfig) -> str | None:
    cal = config.calibrate
    if cal.enabled:
        return None
    return f"[calibrate] enabled = false; balance uses {cal.cost_model or 'the built-in cost model'}"


def promote_off(config: WorkflowConfig) -> str | None:
    return None if config.pipeline.incremental else "[pipeline] incremental = false"


def recommend_off(config: WorkflowConfig) -> str | None:
    if not config.recommend.enabled:
        return "[recommend] enabled = false"
    return None if config.export.enabled else "[recommend] needs [export] enabled = true (it scores the exported model)"


def prepare_checkpoints(work: Workdir, resumable: bool) -> str:
    """Keep the train stage's checkpoints only to continue the same training; otherwise remove them: a
    checkpoint of other shards or settings must not be resumed."""
    folder = work.checkpoints
    if not folder.exists():
        return ""
    if resumable:
        return "; resuming from its checkpoints"
    shutil.rmtree(folder)
    return "; old checkpoints removed"


STAGES = (  # name, upstream, section, values, job, output, intact[, overrides, inputs, off, before_run]
    StageDef("prepare", (), "prepare", prepare_values, prepare_job, "prepared", prepare_intact,
             inputs=("input", "user_features"), chained=True),
    StageDef("calibrate", (), "calibrate", calibrate_values, calibrate_job, "cost_model", calibrate_intact,
             overrides=timed_overrides, inputs=("config",), off=calibrate_off),
    StageDef("balance", ("prepare", "calibrate"), "balance", balance_values, balance_job, "shards", balance_intact,
             inputs=("cost_model",)),
    StageDef("train", ("balance",), "train", train_values, train_job, "summary",
             lambda config, work: json_damage(work.summary, "training summary")(),
             overrides=train_overrides, inputs=("config",), before_run=prepare_checkpoints, chained=True),
    StageDef("compare", ("prepare", "calibrate"), "compare", compare_values, compare_job, "compare_summary",
             lambda config, work: json_damage(work.compare_summary, "comparison summary")(),
             overrides=lambda config, work: config.train.overrides, inputs=("config", "cost_model")),
    StageDef("export", ("train",), "export", export_values, export_job, "model",
             lambda config, work: json_damage(work.model / "model.json", "exported model")()),
    StageDef("promote", ("export",), "promote", promote_values, promote_job, "promotion",
             lambda config, work: json_damage(work.promotion, "promotion record")(), off=promote_off),
    StageDef("recommend", ("prepare", "export"), "recommend", recommend_values, recommend_job, "recommendations",
             recommend_intact, off=recommend_off),
)
"""Every stage, in run order: adding a stage is one record here and its section in config.py."""
