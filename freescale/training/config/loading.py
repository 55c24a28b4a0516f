"""Loading the trainer config: defaults, then a TOML file, then ``--section.key VALUE`` overrides, every
key and value checked by the one typed-config engine (``freescale.runtime.typed_config``); keys that
moved; the keys a checkpoint's tensors depend on."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from freescale.runtime.typed_config import (ConfigError, apply_table, keys_of, nested, parse_overrides,
                                            read_toml)
from freescale.training.config.choices import SHAPE
from freescale.training.config.sections import TrainConfig

# Keys that moved, old spelling -> new: config files, overrides and checkpoints' recorded configs
# may still use the old one (both in one config is refused).
MOVED_KEYS = {"model.hstu.embedding_dim": "model.embedding_dim",
              "model.hstu.use_rating_feature": "model.use_rating_feature"}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then `--section.key value` / `--section.key=value` overrides."""
    config = TrainConfig()
    if path:
        apply_table(config, _moved_table(read_toml(path), str(path)), str(path))
    for key, value in parse_overrides(overrides or []):
        apply_table(config, nested(MOVED_KEYS.get(key, key), value), "command line")
    return config


def _moved_table(table: dict[str, Any], source: str) -> dict[str, Any]:
    """A config file's table with every key of ``MOVED_KEYS`` at its new place."""
    for old, new in MOVED_KEYS.items():
        *old_path, old_key = old.split(".")
        parent = table
        for part in old_path:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or old_key not in parent:
            continue
        value = parent.pop(old_key)
        *new_path, new_key = new.split(".")
        target = table
        for part in new_path:
            target = target.setdefault(part, {})
        if new_key in target and target[new_key] != value:
            raise ConfigError(f"{source}: {old} (the old spelling of {new}) is {value!r} and {new} is "
                              f"{target[new_key]!r}: keep {new} only")
        target[new_key] = value
    return table


def moved_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat config (``to_flat_dict``'s, e.g. a checkpoint's record) with ``MOVED_KEYS`` renamed."""
    return {MOVED_KEYS.get(key, key): value for key, value in flat.items()}


def shape_keys(config: TrainConfig | None = None) -> tuple[str, ...]:
    """``section.key`` of every field marked ``shape`` (the registered encoders' sections included):
    the keys a checkpoint's tensors depend on."""
    return tuple(_shape_keys(config if config is not None else TrainConfig(), ""))


def _shape_keys(obj: Any, prefix: str) -> list[str]:
    keys = []
    marked = {f.name for f in dataclasses.fields(obj) if f.metadata.get(SHAPE)}
    for name in keys_of(obj):
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            keys += _shape_keys(value, f"{prefix}{name}.")
        elif name in marked:
            keys.append(f"{prefix}{name}")
    return keys

