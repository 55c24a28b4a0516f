"""The re-plan of an interrupted epoch for another world size (freescale/shards/replan.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from freescale.runtime.errors import InputError
from freescale.shards.manifest import load_manifest
from freescale.shards.replan import replan
from freescale.shards.step_order import epoch_order
from tests.helpers import write_shards

STEPS = 7


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    return write_shards(tmp_path / "shards", world_size=2, local_batch=4, num_steps=STEPS, empty_steps={1: {3}})


def plan_rows(shards: Path) -> list[tuple[int, int, int]]:
    """(rank, row, plan step) of every sample of the shard set."""
    manifest = load_manifest(shards)
    found = []
    for rank in range(manifest.world_size):
        steps = np.concatenate([pq.read_table(p, columns=["step"])["step"].to_numpy()
                                for p in manifest.rank_paths(rank)])
        found += [(rank, row, int(step)) for row, step in enumerate(steps)]
    return found


@pytest.mark.parametrize("from_step", [0, 3, 6, 9])
@pytest.mark.parametrize("world_size", [1, 3, 5])
def test_replan_covers_the_rest_of_the_epoch_once(shards: Path, from_step: int, world_size: int) -> None:
    manifest = load_manifest(shards)
    meta, rows = replan(manifest, from_step, world_size, order_seed=0)
    epoch, position = divmod(from_step, STEPS)
    done = set(epoch_order(STEPS, 1, 0, epoch)[:position].tolist())
    rest = [(rank, row) for rank, row, step in plan_rows(shards) if step not in done]
    got = list(zip(rows["source_rank"].to_pylist(), rows["source_row"].to_pylist()))
    assert sorted(got) == sorted(rest)  # every untrained sample, once
    assert meta.num_samples == len(rest) and (meta.epoch, meta.position) == (epoch, position)
    assert meta.num_steps <= STEPS - position  # the run's step count still ends the epoch in time
    steps, ranks = rows["step"].to_numpy(), rows["rank"].to_numpy()
    assert steps.min() >= 0 and steps.max() < meta.num_steps and set(ranks) <= set(range(world_size))
    lengths = {(r, i): length for r, i, length in _lengths(shards)}
    for step in range(meta.num_steps):
        at = np.flatnonzero(steps == step)
        targets = sum(lengths[got[i]] - 1 for i in at)
        assert set(rows["step_targets"].to_numpy()[at]) <= {targets}


def _lengths(shards: Path) -> list[tuple[int, int, int]]:
    manifest = load_manifest(shards)
    out = []
    for rank in range(manifest.world_size):
        lengths = np.concatenate([pq.read_table(p, columns=["length"])["length"].to_numpy()
                                  for p in manifest.rank_paths(rank)])
        out += [(rank, row, int(length)) for row, length in enumerate(lengths)]
    return out


def test_replan_balances_each_step(shards: Path) -> None:
    """kk over the re-planned steps: no worse than dealing the same steps out in turn."""
    manifest = load_manifest(shards)
    meta, rows = replan(manifest, 2, 3, order_seed=0)
    assert meta.strategy == "kk" and 0.0 <= meta.bubble < 1.0


def test_replan_refuses_a_control(shards: Path) -> None:
    raw = json.loads((shards / "manifest.json").read_text())
    raw["control"] = "mirror"
    from freescale.shards.manifest import seal

    (shards / "manifest.json").write_text(json.dumps(seal({k: v for k, v in raw.items() if k != "content_sha256"})))
    with pytest.raises(InputError, match="control"):
        replan(load_manifest(shards), 2, 3, order_seed=0)
