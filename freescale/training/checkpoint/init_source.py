"""Where a warm start's weights come from (``training.init_from``, `freescale train --init-from`), read
without torch: `freescale train` finds and checks the source before torchrun starts, and each rank
checks it again before loading it (``freescale.training.checkpoint.init_from``).

A source is a complete checkpoint (a ``step_<n>`` folder with ``COMPLETE``, or a checkpoint folder:
its newest complete step) or an exported model folder (``model.json`` of ``FORMAT``). Its model must
be this run's: the same encoder and the same values of every ``model.*`` key marked ``shape``
(``freescale.training.config.shape_keys``), read from the checkpoint's ``CONFIG`` or the exported
model's ``model.json``; anything else is refused in one line naming both values. The item table may
grow (the new data's catalog holds the source's items under the same ids, and more), never shrink.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freescale.runtime.errors import InputError
from freescale.shards.schema import MANIFEST_NAME
from freescale.training.checkpoint.layout import COMPLETE, STEP_DIR, complete_steps, saved_config
from freescale.training.config import ENCODERS, ConfigError, TrainConfig, moved_flat, shape_keys, to_flat_dict
from freescale.training.export.layout import FORMAT, MODEL_FILE

CHECKPOINT, EXPORTED = "checkpoint", "exported model"


@dataclass(frozen=True)
class InitSource:
    path: Path
    """A complete ``step_<n>`` folder, or an exported model folder."""
    kind: str
    """``CHECKPOINT`` or ``EXPORTED`` (which holds no optimizer state)."""
    model: dict[str, Any]
    """The source's model config, flat (``model.embedding_dim``, ``model.hstu.num_layers``, ...); {} for a
    checkpoint from before ``CONFIG`` was recorded (its tensors' shapes are still checked)."""
    num_items: int | None
    """The exported model's catalog size; None for a checkpoint (its table's rows are read by the ranks)."""


def find_init_source(path: str) -> InitSource:
    """The source ``path`` names; one line (``InputError``) when it names none."""
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"init-from {path}: no such checkpoint or exported model (not a directory)")
    if (folder / MODEL_FILE).is_file():
        return _exported(folder)
    if STEP_DIR.match(folder.name):
        if not (folder / COMPLETE).exists():
            raise InputError(f"init-from {path}: checkpoint is half-written (no {COMPLETE}: its save was cut "
                             "short); name a complete step, or its checkpoint folder")
        step = folder
    else:
        steps = complete_steps(folder)
        if not steps:
            raise InputError(f"init-from {path}: holds no complete checkpoint (step_<n> with {COMPLETE}) and is "
                             f"no exported model (no {MODEL_FILE})")
        step = folder / f"step_{steps[-1]}"
    flat = moved_flat(saved_config(step))
    return InitSource(step.resolve(), CHECKPOINT, {k: v for k, v in flat.items() if k.startswith("model.")}, None)


def _exported(folder: Path) -> InitSource:
    try:
        meta = json.loads((folder / MODEL_FILE).read_text())
    except ValueError as exc:
        raise InputError(f"init-from {folder}: {MODEL_FILE} is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise InputError(f"init-from {folder}: {MODEL_FILE} has format {found!r}, not an exported model's {FORMAT!r}")
    model = moved_flat({f"model.{key}": value for key, value in (meta.get("model") or {}).items()})
    return InitSource(folder.resolve(), EXPORTED, model, int(meta["num_items"]))


def check_init_shape(source: InitSource, config: TrainConfig) -> None:
    """Refuse a source whose model is not this run's shape: one line naming each differing key's two values."""
    here = to_flat_dict(config)
    there = source.model
    encoder = here["model.encoder"]
    if there.get("model.encoder", encoder) != encoder:
        raise ConfigError(f"init-from {source.path} holds a {there['model.encoder']} model, this run's "
                          f"model.encoder is {encoder}: warm-start from a {encoder} model, or set model.encoder "
                          f"{there['model.encoder']}")
    other_encoders = tuple(f"model.{name}." for name in ENCODERS if name != encoder)
    keys = [key for key in shape_keys(config) if key.startswith("model.") and not key.startswith(other_encoders)]
    differ = [f"{key} {there[key]} there, {here[key]} here" for key in keys if key in there and there[key] != here[key]]
    if differ:
        raise ConfigError(f"init-from {source.path} holds another model shape ({'; '.join(differ)}): train with "
                          "its values, or without --init-from")


def check_init_items(source: InitSource | str, source_items: int, num_items: int) -> None:
    """Refuse a source whose catalog is larger than this run's: its items keep their rows and ids only
    when the new catalog holds them all (new items numbered after them)."""
    if source_items > num_items:
        path = source.path if isinstance(source, InitSource) else source
        raise InputError(f"init-from {path} holds {source_items} items, these shards {num_items}: a warm start "
                         "keeps each item's row under its id, so the new catalog must hold the source's items "
                         "(prepare the new data with --previous) and may only add items after them")


def resume_wins(config: TrainConfig) -> bool:
    """Whether the run resumes its own newest checkpoint, which it then continues instead of warm-starting."""
    folder = config.checkpoint.folder
    return bool(config.checkpoint.resume and folder and complete_steps(Path(folder)))


def init_settings(config: TrainConfig) -> list[str]:
    """`freescale train`'s check of ``training.init_from`` before torchrun starts, and the ranks' override
    naming the source it found (the step a checkpoint folder's newest is now, so every rank and every
    restart loads that one, and MLflow records it); [] without one, or when the run resumes instead."""
    if not config.training.init_from or resume_wins(config):
        return []
    source = find_init_source(config.training.init_from)
    check_init_shape(source, config)
    if source.num_items is not None:
        manifest = Path(config.data.shards) / MANIFEST_NAME
        try:
            num_items = int(json.loads(manifest.read_text())["num_items"])
        except (OSError, ValueError, KeyError, TypeError):
            num_items = None  # no readable manifest: the ranks name the problem
        if num_items is not None:
            check_init_items(source, source.num_items, num_items)
    return ["--training.init_from", str(source.path)]
