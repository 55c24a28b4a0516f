"""A third encoder from this file alone: nothing under freescale/training/ names it (checked below). It is
registered (``freescale.training.model.registry.register_encoder``), loads from a config and its overrides like HSTU's
and SASRec's sections, and trains on 2 ranks, checkpoints and resumes to the uninterrupted run's
losses, its shape key refusing a resume into another shape. What docs/extending.md promises."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freescale.training.config import ConfigError, ModelConfig, load_config, shape, shape_keys, to_flat_dict
from freescale.training.model.registry import ENCODERS, EncoderSpec, register_encoder, unregister_encoder
from freescale.training.model.encoders import Encoder
from freescale.training.ops.jagged import GroupedPlan, offsets_from_lengths
from tests.helpers import free_port, write_shards

REPO = Path(__file__).resolve().parents[2]
NAME = "tiny_gru"


@dataclass
class TinyGRUConfig:
    """Shape of the test's encoder, ``[model.tiny_gru]``."""

    num_layers: int = shape(1)
    """Stacked GRU layers: how many weight sets there are, so a shape key."""
    max_seq_len: int = 64
    """The longest history it is meant for (a GRU has no position table: not a shape key)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")


class TinyGRUEncoder(Encoder):
    """A GRU over each sample's own positions (GRU4Rec's encoder, in miniature): causal by
    construction, and run per group of equal-length samples, so nothing is padded."""

    def __init__(self, config: TinyGRUConfig, width: int) -> None:
        super().__init__()
        self.config = config
        self.gru = nn.GRU(width, width, num_layers=config.num_layers, batch_first=True)

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        plan = GroupedPlan.build(offsets)
        out = [self.gru(rows.view(*group.rows.shape, -1))[0].reshape(rows.shape)
               for group, rows in zip(plan.groups, plan.split(plan.enter(values)))]
        hidden = plan.leave(torch.cat(out)) if out else values.new_zeros(0, values.shape[1])
        return F.normalize(hidden, dim=-1)


def register() -> None:
    """This file's one registration (the ranks below run it in their own processes)."""
    if NAME not in ENCODERS:
        register_encoder(NAME, EncoderSpec(TinyGRUConfig, lambda model: TinyGRUEncoder(model.tiny_gru,
                                                                                          model.embedding_dim)))


@pytest.fixture
def registered():
    register()
    yield
    unregister_encoder(NAME)  # other tests' configs list the built-in encoders only


def test_nothing_under_training_names_the_encoder():
    assert not [path for path in (REPO / "freescale" / "training").rglob("*.py") if NAME in path.read_text()]


def test_the_registered_encoder_is_a_choice_with_its_own_section(registered, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f'[model]\nencoder = "{NAME}"\nembedding_dim = 16\n[model.{NAME}]\nnum_layers = 2\n')
    config = load_config(path, [f"--model.{NAME}.max_seq_len", "30"])
    assert (config.model.encoder, config.model.tiny_gru.num_layers, config.model.max_seq_len) == (NAME, 2, 30)
    flat = to_flat_dict(config)
    assert flat[f"model.{NAME}.num_layers"] == 2 and flat["model.hstu.num_layers"] == 2  # hstu's default
    assert f"model.{NAME}.num_layers" in shape_keys() and f"model.{NAME}.max_seq_len" not in shape_keys()
    with pytest.raises(ConfigError, match=f"^command line: model.{NAME}: num_layers must be >= 1, got 0$"):
        load_config(None, [f"--model.{NAME}.num_layers", "0"])
    with pytest.raises(ConfigError, match=f"model.encoder must be one of 'hstu', 'sasrec', '{NAME}', got 'gru'"):
        load_config(None, ["--model.encoder", "gru"])
    with pytest.raises(ValueError, match="cannot register encoder 'temperature'"):  # a model key
        register_encoder("temperature", EncoderSpec(TinyGRUConfig, TinyGRUEncoder))


def test_an_unregistered_encoder_is_no_choice():
    assert NAME not in ENCODERS and not hasattr(ModelConfig(), NAME)
    with pytest.raises(ConfigError, match=f"model.encoder must be one of 'hstu', 'sasrec', got '{NAME}'"):
        load_config(None, ["--model.encoder", NAME])


def test_the_model_trains_it_and_its_outputs_are_causal(registered):
    from freescale.training.data.batch import SequenceBatch
    from freescale.training.model.recommender import build_local_model

    torch.manual_seed(0)
    model = build_local_model(40, load_config(None, ["--model.encoder", NAME, "--model.embedding_dim", "16"]).model)
    assert isinstance(model.encoder, TinyGRUEncoder) and model.attention_kernel == "grouped"
    lengths = torch.tensor([5, 3, 5, 1])
    total = int(lengths.sum())
    g = torch.Generator().manual_seed(0)
    held_out = torch.randint(1, 41, (4,), generator=g)
    batch = SequenceBatch(lengths=lengths, item_ids=torch.randint(1, 41, (total,), generator=g),
                          timestamps=torch.arange(total) * 60, ratings=torch.randint(0, 6, (total,), generator=g),
                          valid_item=held_out, test_item=held_out, valid_timestamp=torch.full((4,), 10**6),
                          test_timestamp=torch.full((4,), 10**6), user_ids=["a", "b", "c", "d"])
    loss, _ = model(batch, num_negatives=8)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.encoder.parameters())
    # The contract's causality: a sample's first 3 outputs are those of its 3-long prefix alone.
    model.eval()
    with torch.no_grad():
        values = torch.randn(total, 16, generator=g)
        offsets = offsets_from_lengths(lengths)
        whole = model.encoder(values, offsets, batch.timestamps)
        prefix = model.encoder(values[:3], offsets_from_lengths(torch.tensor([3])), batch.timestamps[:3])
    torch.testing.assert_close(whole[:3], prefix)


def _rank(rank: int, runs: list[tuple[int, list[str]]], logs: str, copy: tuple[str, str]) -> None:
    """One of 2 training ranks, as torchrun would start ``freescale.jobs.train``, in a process that imported
    this file: the encoder is registered here, not in any module the trainer knows. It trains each of
    ``runs`` (its own port, its arguments) in turn, one process group each; after the first, rank 0
    copies ``copy``'s checkpoint (source, destination) before it meets rank 1 again, so the second
    run finds it. One pair of processes for every run: each start imports torch and TorchRec."""
    from freescale.runtime.logs import LOG_DIR_ENV

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", LOG_DIR_ENV: logs})
    register()
    from freescale.jobs import train

    for index, (port, argv) in enumerate(runs):
        os.environ["MASTER_PORT"] = str(port)
        assert train.train(argv) == 0
        if index == 0 and rank == 0:
            shutil.copytree(*copy)


@pytest.mark.spawns
def test_it_trains_on_two_ranks_checkpoints_and_resumes_exactly(tmp_path):
    import torch.multiprocessing as mp

    shards = write_shards(tmp_path / "shards", world_size=2, num_steps=4, local_batch=3)

    def argv(name: str, *extra: str) -> list[str]:
        return ["--data.shards", str(shards), "--tracking.uri", "none", "--summary-json", str(tmp_path / name),
                "--model.encoder", NAME, "--model.embedding_dim", "16", f"--model.{NAME}.num_layers", "1",
                "--loss.num_negatives", "8", "--training.eval_max_samples", "4", *extra]

    # The uninterrupted run checkpoints at step 2; a folder holding that checkpoint alone resumes
    # there and must train the last 2 steps as it did.
    ran, folder = tmp_path / "ckpt", tmp_path / "resume"
    folder.mkdir()
    ports = {free_port()}
    while len(ports) < 2:  # a port of its own for each run's rendezvous
        ports.add(free_port())
    ports = sorted(ports)
    runs = [(ports[0], argv("reference.json", "--training.max_steps", "4", "--checkpoint.folder", str(ran),
                            "--checkpoint.every_steps", "2")),
            (ports[1], argv("resumed.json", "--training.max_steps", "4", "--checkpoint.folder", str(folder)))]
    mp.spawn(_rank, args=(runs, str(tmp_path / "logs"), (str(ran / "step_2"), str(folder / "step_2"))), nprocs=2,
             join=True)
    reference, resumed = (json.loads((tmp_path / name).read_text()) for name in ("reference.json", "resumed.json"))
    assert reference["steps"] == [0, 1, 2, 3] and (ran / "step_2" / "COMPLETE").exists()
    assert resumed["steps"] == [2, 3]
    assert resumed["losses"] == reference["losses"][2:]  # to the bit
    # Its marked field is a shape key: the checkpoint refuses a resume into two layers.
    from freescale.training.checkpoint.checkpointer import Checkpointer

    register()
    try:
        wider = load_config(None, ["--model.encoder", NAME, "--model.embedding_dim", "16",
                                   f"--model.{NAME}.num_layers", "2"])
        with pytest.raises(ConfigError, match=f"another model shape \\(model.{NAME}.num_layers 1 -> 2\\)"):
            Checkpointer(str(folder), rank=0).check_config(2, to_flat_dict(wider))
    finally:
        unregister_encoder(NAME)
