"""Trainer configuration: TOML, overrides, and errors that name the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from training.config import ConfigError, load_config, to_flat_dict

REPO = Path(__file__).resolve().parents[1]


def test_shipped_configs_load():
    for path in sorted((REPO / "configs").glob("*.toml")):
        config = load_config(path)
        assert config.model.hstu.embedding_dim > 0


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nmax_steps = 7\n[model.hstu]\nnum_layers = 3\n")
    config = load_config(path, ["--training.max_steps", "9", "--loss.full_softmax=true",
                                "--model.hstu.dropout", "0.25", "--data.shards", "x"])
    assert config.training.max_steps == 9 and config.model.hstu.num_layers == 3
    assert config.loss.full_softmax is True and config.model.hstu.dropout == 0.25
    flat = to_flat_dict(config)
    assert flat["training.max_steps"] == 9 and flat["model.hstu.num_layers"] == 3 and flat["data.shards"] == "x"


@pytest.mark.parametrize("text,fragment", [
    ("[training]\nmax_stepz = 1\n", "max_stepz"),
    ("[training]\nmax_steps = 'many'\n", "max_steps"),
    ("[training\n", "not valid TOML"),
])
def test_bad_config_names_the_key(tmp_path, text, fragment):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_config(path)


def test_bad_override():
    with pytest.raises(ConfigError, match="training.seed"):
        load_config(None, ["--training.seed", "x1"])
    with pytest.raises(ConfigError, match="no value"):
        load_config(None, ["--training.seed"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.toml")
