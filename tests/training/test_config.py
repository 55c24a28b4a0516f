"""Trainer configuration: TOML, overrides, and errors that name the key."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path
from typing import Literal

import pytest

from freescale.training.config import ConfigError, OneOf, TrainConfig, load_config, to_flat_dict

REPO = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    """Every shipped TOML loads: a training config, or a `freescale pipeline` config (a
    ``[pipeline]`` table) whose training config and overrides load too."""
    import tomllib

    from freescale.jobs.workflow.config import load_workflow_config

    kinds = set()
    for path in sorted((REPO / "configs").glob("*.toml")):
        if "pipeline" in tomllib.loads(path.read_text()):
            workflow = load_workflow_config(str(path), [])
            assert workflow.train.config and (REPO / workflow.train.config).exists()
            kinds.add("pipeline")
        else:
            assert load_config(path).model.embedding_dim > 0
            kinds.add("training")
    assert kinds == {"pipeline", "training"}


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nmax_steps = 7\n[model.hstu]\nnum_layers = 3\n")
    config = load_config(path, ["--training.max_steps", "9", "--loss.full_softmax=true",
                                "--model.hstu.dropout", "0.25", "--data.shards", "x"])
    assert config.training.max_steps == 9 and config.model.hstu.num_layers == 3
    assert config.loss.full_softmax is True and config.model.hstu.dropout == 0.25
    flat = to_flat_dict(config)
    assert flat["training.max_steps"] == 9 and flat["model.hstu.num_layers"] == 3 and flat["data.shards"] == "x"


def test_the_width_and_rating_input_load_under_their_old_hstu_spelling(tmp_path):
    """model.embedding_dim and model.use_rating_feature were [model.hstu] keys: files, overrides
    (tests/e2e/fault_sweep.py's, users' scripts) and the pipeline's [train] overrides still say so."""
    path = tmp_path / "c.toml"
    path.write_text("[model.hstu]\nembedding_dim = 32\nuse_rating_feature = false\nnum_layers = 3\n")
    config = load_config(path)
    assert (config.model.embedding_dim, config.model.use_rating_feature, config.model.hstu.num_layers) == (32, False, 3)
    config = load_config(path, ["--model.hstu.embedding_dim", "16", "--model.use_rating_feature", "true"])
    assert (config.model.embedding_dim, config.model.use_rating_feature) == (16, True)
    flat = to_flat_dict(config)
    assert flat["model.embedding_dim"] == 16 and not any(key.startswith("model.hstu.embedding") for key in flat)
    path.write_text("[model]\nembedding_dim = 32\n[model.hstu]\nembedding_dim = 16\n")
    with pytest.raises(ConfigError, match=r"c\.toml: model\.hstu\.embedding_dim \(the old spelling of "
                                          r"model\.embedding_dim\) is 16 and model\.embedding_dim is 32"):
        load_config(path)
    path.write_text("[model]\nembedding_dim = 32\n[model.hstu]\nembedding_dim = 32\n")  # the same value twice
    assert load_config(path).model.embedding_dim == 32


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


@pytest.mark.spawns  # a fresh interpreter
def test_config_module_loads_no_torch():
    # Jobs read the config (and report its errors) before any rank starts: that must stay cheap.
    code = ("import sys, freescale.training.config; "
            "print(','.join(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torchrec', 'numpy'})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == ""


# Every choice in the config, its allowed values, and a value that is not one of them.
CHOICES = [
    ("parallel.sharding", ("row_wise", "table_wise"), "rowwise"),
    ("parallel.backend", ("auto", "gloo", "nccl"), "mpi"),
    ("optimizer.sparse_optimizer", ("adagrad", "sgd", "adam"), "rowwise_adagrad"),
    ("model.hstu.attention_normalization", ("sample_length", "max_seq_len"), "padded"),
    ("model.hstu.attention_activation", ("silu", "softmax"), "relu"),
    ("model.hstu.attention_kernel", ("auto", "triton", "grouped"), "cuda"),
    ("model.hstu.init", ("torch", "reference"), "xavier"),
    ("comm.mode", ("plain", "overlap", "prioritized"), "async"),
    ("comm.backend", ("auto", "gloo", "nccl", "copy_engine"), "mpi"),
    ("model.encoder", ("hstu", "sasrec"), "gru"), ("loss.kind", ("sampled_softmax", "bce"), "softmax"),
    ("optimizer.decay", ("constant", "linear", "cosine"), "step"),
    ("training.precision", ("fp32", "bf16"), "fp16"),
    ("training.cuda_graphs", ("off", "encoder"), "all"),
    ("evaluation.metric", ("valid_ndcg_at_10", "valid_hr_at_10", "valid_mrr", "valid_sampled_ndcg_at_10",
                           "valid_sampled_hr_at_10", "valid_sampled_mrr"), "ndcg"),
]


def _toml(key: str, value: object) -> str:
    *table, name = key.split(".")
    return f"[{'.'.join(table)}]\n{name} = {value!r}\n".replace("'", '"')


def _leaf_types(cls: type, prefix: str = "") -> dict[str, object]:
    """`section.key -> annotated type` for every leaf of the config schema; a choice among registered
    names (``Annotated[str, OneOf(...)]``, the encoder) as the Literal of the names registered now."""
    leaves: dict[str, object] = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        if typing.get_origin(hint) is typing.Annotated:
            base, *marks = typing.get_args(hint)
            choices = [mark for mark in marks if isinstance(mark, OneOf)]
            hint = Literal[choices[0].values()] if choices else base
        if dataclasses.is_dataclass(hint):
            leaves.update(_leaf_types(hint, f"{prefix}{name}."))
        else:
            leaves[f"{prefix}{name}"] = hint
    return leaves


def test_every_string_choice_is_typed():
    """Strings left free are paths, names and the priority-group spec; every other is a Literal."""
    leaves = _leaf_types(TrainConfig)
    assert {key for key, hint in leaves.items() if hint is str} == {
        "data.shards", "data.replan", "comm.priority_groups", "checkpoint.folder", "training.init_from", "tracking.uri",
        "tracking.experiment",
        "tracking.run_name", "tracking.parent_run_id", "tracking.comparison"}
    literals = {key: typing.get_args(hint) for key, hint in leaves.items() if typing.get_origin(hint) is Literal}
    assert literals == {key: allowed for key, allowed, _ in CHOICES}


@pytest.mark.parametrize("key,allowed,bad", CHOICES)
def test_each_choice_is_checked_at_load(tmp_path, key, allowed, bad):
    expected = f"{key} must be one of {', '.join(map(repr, allowed))}, got {bad!r}"
    path = tmp_path / "c.toml"
    path.write_text(_toml(key, bad))
    with pytest.raises(ConfigError) as from_file:
        load_config(path)
    assert str(from_file.value) == f"{path}: {expected}"
    with pytest.raises(ConfigError) as from_override:
        load_config(None, [f"--{key}", bad])
    assert str(from_override.value) == f"command line: {expected}"
    for good in allowed:  # every allowed value loads, from the file and overriding it
        path.write_text(_toml(key, good))
        config = load_config(path, [f"--{key}={allowed[0]}"])
        assert to_flat_dict(load_config(path))[key] == good and to_flat_dict(config)[key] == allowed[0]


def test_loaded_encoder_shape_is_checked_like_a_constructed_one(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model.hstu]\nnum_layers = 0\n")
    with pytest.raises(ConfigError, match=r"^.*c\.toml: model\.hstu: num_layers must be >= 1, got 0$"):
        load_config(path)
    with pytest.raises(ConfigError, match="command line: model.hstu: dropout must be in"):
        load_config(None, ["--model.hstu.dropout", "1.5"])


def test_precision_defaults_to_fp32_and_a_constructed_one_is_checked():
    from freescale.training.config import TrainingConfig

    assert TrainConfig().training.precision == "fp32"
    with pytest.raises(ValueError, match=r"precision must be one of \('fp32', 'bf16'\), got 'fp16'"):
        TrainingConfig(precision="fp16")


def test_implementations_are_keyed_by_the_choices():
    from freescale.training.config import ShardingName, keyed_by

    assert keyed_by(ShardingName, {"row_wise": 1, "table_wise": 2}) == {"row_wise": 1, "table_wise": 2}
    with pytest.raises(TypeError, match="do not match"):
        keyed_by(ShardingName, {"row_wise": 1})
    with pytest.raises(TypeError, match="do not match"):
        keyed_by(ShardingName, {"row_wise": 1, "table_wise": 2, "column_wise": 3})
