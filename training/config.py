"""Trainer configuration: typed dataclasses, loaded from TOML, overridden from the command line.

    [training]
    max_steps = 100
    [model.hstu]
    num_layers = 2

    torchrun ... -m jobs.train --config configs/ml100k.toml --training.max_steps 20 --data.shards out/s
"""
from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from training.model import ModelConfig


@dataclass
class DataConfig:
    shards: str = ""
    """Shard directory written by `freescale balance` (holds manifest.json)."""
    prefetch: int = 2
    """Collated step batches prepared ahead of the trainer on a background thread."""
    verify_checksums: bool = False
    """Hash every file of this rank against the manifest before training (slow on big shards)."""


@dataclass
class OptimizerConfig:
    dense_lr: float = 1e-3
    """Adam learning rate of the dense (replicated) parameters."""
    sparse_lr: float = 0.05
    """Learning rate of the embedding tables' optimizer (the item table and the user
    feature tables), fused into their backward."""
    sparse_optimizer: str = "adagrad"
    """Fused sparse optimizer: adagrad (row-wise), sgd or adam."""
    weight_decay: float = 0.0
    """Dense weight decay."""


@dataclass
class LossConfig:
    num_negatives: int = 128
    """Uniformly sampled negatives per step, shared by every position of the batch."""
    full_softmax: bool = False
    """Score every position against the whole catalog (small catalogs only)."""


@dataclass
class TrainingConfig:
    max_steps: int = 0
    """Stop after this many steps; 0 = one pass over the shards (the manifest's num_steps)."""
    seed: int = 0
    """Seeds parameters, negative sampling and dropout; ranks derive their own streams from it."""
    log_every: int = 10
    """Print and record metrics every N steps."""
    timing_sync_every: int = 1
    """All-gather per-rank step timings every N steps (bubble measurement)."""
    eval_max_samples: int = 0
    """Evaluate at most this many samples per rank; 0 = all of the rank's shard."""
    threads: int = 0
    """torch intra-op threads per rank; 0 = cores / local ranks."""


@dataclass
class ParallelConfig:
    backend: str = "auto"
    """auto (nccl on CUDA, else gloo), gloo or nccl."""
    sharding: str = "row_wise"
    """Item table sharding: row_wise or table_wise."""
    collective_timeout_s: float = 300.0
    """A rank blocked this long in a collective (a peer died or hangs) fails instead of waiting forever."""


CommMode = Literal["plain", "overlap", "prioritized"]
CommBackendName = Literal["auto", "gloo", "nccl", "copy_engine"]


@dataclass
class CommConfig:
    mode: CommMode = "prioritized"
    """How the step's collectives run. ``plain``: TorchRec's blocking lookups and one
    all-reduce after the backward (the baseline). ``overlap``: every collective is
    asynchronous and waited for where its result is first needed -- the next batch's
    ids move during this step, embedding gradients leave as soon as they are ready,
    dense gradients are all-reduced in buckets during the backward. ``prioritized``:
    ``overlap`` with the rows sent in ``priority_groups`` order, the encoder starting
    once the first group is in, and the embedding gradients issued ahead of the last
    dense bucket. All three compute the same numbers."""
    backend: CommBackendName = "auto"
    """Transport of the exchange and the dense sync: gloo (CPU), nccl (CUDA SM kernels),
    copy_engine (CUDA copy engines, SM-free); auto = nccl on CUDA, else gloo."""
    priority_groups: str = "item,user;negative"
    """Exchange groups in priority order, ``;`` between groups and ``,`` between features:
    ``item`` (history items), ``negative`` (sampled negatives), a user feature's name, or
    ``user`` for every user feature. Features not named join the last group."""
    bucket_kb: int = 256
    """Dense gradients per all-reduce bucket (KiB)."""


@dataclass
class CheckpointConfig:
    folder: str = ""
    """Where torch.distributed.checkpoint writes step_<n>/; empty disables checkpoints."""
    every_steps: int = 0
    """Save every N steps (0: only at the end when a folder is set)."""
    resume: bool = True
    """Continue from the newest complete checkpoint in the folder, if any."""


@dataclass
class TrackingConfig:
    uri: str = ""
    """MLflow tracking URI; empty = $MLFLOW_TRACKING_URI or sqlite:///mlflow.db; 'none' disables."""
    experiment: str = "freescale"
    """MLflow experiment name."""
    run_name: str = ""
    """MLflow run name; empty = derived from the shards and strategy."""


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


class ConfigError(ValueError):
    """A config file or override that does not fit the schema; the message names the key."""


def _apply(obj: Any, values: dict[str, Any], where: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(names))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}.{key} must be a table")
            _apply(current, value, f"{where}.{key}")
        else:
            setattr(obj, key, _coerce(value, hints[key], f"{where}.{key}"))


def _coerce(value: Any, hint: Any, where: str) -> Any:
    if typing.get_origin(hint) is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, allowed))}")
        return value
    target = hint if isinstance(hint, type) else None
    if target is None:  # e.g. `int | None`: take the first concrete type
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        target = args[0] if args else str
    try:
        if target is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if target is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return target(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not a valid {target.__name__}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then `--section.key value` / `--section.key=value` overrides."""
    config = TrainConfig()
    if path:
        try:
            with open(path, "rb") as handle:
                _apply(config, tomllib.load(handle), str(path))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for key, value in parse_overrides(overrides or []):
        section: dict[str, Any] = {}
        cursor = section
        parts = key.split(".")
        for part in parts[:-1]:
            cursor = cursor.setdefault(part, {})
        cursor[parts[-1]] = value
        _apply(config, section, "override")
    return config


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"override {arg!r}: expected --section.key VALUE")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"override {arg!r} has no value")
            key, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((key.replace("-", "_"), value))
    return pairs


def to_flat_dict(config: Any, prefix: str = "") -> dict[str, Any]:
    """`section.key -> value` for every leaf: what MLflow records as the run's params."""
    flat: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            flat.update(to_flat_dict(value, name + "."))
        else:
            flat[name] = value
    return flat
