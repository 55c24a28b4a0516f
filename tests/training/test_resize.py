"""A resume on another world size: the re-plan's reader (freescale/training/data/replanned_reader.py), the
launcher's choice of a re-plan (freescale/launch/resize.py), where a re-planned run ends, and one
real resize (2 ranks, then 3, on one checkpoint folder)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from freescale.runtime.errors import InputError
from freescale.shards.manifest import ShardError, load_manifest
from freescale.shards.replan import ReplanFiles, replan
from freescale.shards.step_order import epoch_order
from tests.helpers import write_shards

STEPS = 7


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    return write_shards(tmp_path / "shards", world_size=2, local_batch=4, num_steps=STEPS, empty_steps={1: {3}})


def test_replanned_reader_yields_the_source_rows(shards: Path, tmp_path: Path) -> None:
    from freescale.training.data.replanned_reader import ReplannedReader
    from freescale.training.data.shard_reader import ShardReader

    manifest = load_manifest(shards)
    meta, rows = replan(manifest, 3, 3, order_seed=0)
    files = ReplanFiles(tmp_path / ReplanFiles.name(3, 3))
    files.write(meta, rows)
    source = {}
    for rank in range(2):
        reader = ShardReader(manifest, rank)
        reader.reset()
        for item in _all(reader):
            for user, items in zip(item.rows["user_id"].to_pylist(), item.rows["items"].to_pylist()):
                source[user] = (item.step, items)
    trained = Counter()
    for rank in range(3):
        reader = ReplannedReader(manifest, files, rank)
        reader.reset()
        got = _all(reader)
        assert [item.step for item in got] == list(range(meta.num_steps))  # every step, empty ones too
        for item in got:
            for user, items in zip(item.rows["user_id"].to_pylist(), item.rows["items"].to_pylist()):
                assert source[user][1] == items
                trained[user] += 1
        # The state is the next step: a reader reset to it yields the rest.
        again = ReplannedReader(manifest, files, rank)
        again.reset({"replan_next_step": 2})
        assert [item.step for item in _all(again)] == list(range(2, meta.num_steps))
    done = set(epoch_order(STEPS, 1, 0, 0)[:3].tolist())
    assert trained == Counter({user: 1 for user, (step, _) in source.items() if step not in done})


def _all(reader) -> list:
    out = []
    while True:
        try:
            out.append(reader.next())
        except StopIteration:
            return out


# ------------------------------------------------------------ the launcher's choice

def fake_checkpoint(folder: Path, step: int, world_size: int, sha: str, config: dict | None = None) -> Path:
    step_dir = folder / f"step_{step}"
    step_dir.mkdir(parents=True)
    for rank in range(world_size):
        (step_dir / f"rank_{rank}.pt").write_bytes(b"")
    (step_dir / "SHARDS").write_text(sha + "\n")
    (step_dir / "CONFIG").write_text(json.dumps(config or {"training.seed": 0}))
    (step_dir / "COMPLETE").write_text(f"{step}\n")
    return step_dir


def test_launch_on_the_plans_world_size_adds_nothing(shards: Path, tmp_path: Path) -> None:
    from freescale.launch.resize import replan_settings

    assert replan_settings(str(shards), 2, "", True) == []
    fake_checkpoint(tmp_path / "ckpt", 3, 2, load_manifest(shards).sha256)
    assert replan_settings(str(shards), 2, str(tmp_path / "ckpt"), True) == []


def test_launch_on_another_world_size_replans_once(shards: Path, tmp_path: Path, capsys) -> None:
    from freescale.launch.resize import replan_settings

    fake_checkpoint(tmp_path / "ckpt", 3, 2, load_manifest(shards).sha256)
    settings = replan_settings(str(shards), 3, str(tmp_path / "ckpt"), True)
    assert settings[0] == "--data.replan" and ReplanFiles(settings[1]).read().from_step == 3
    assert "re-planned the rest of epoch 0" in capsys.readouterr().err
    assert replan_settings(str(shards), 3, str(tmp_path / "ckpt"), True) == settings
    assert "re-planned" not in capsys.readouterr().err  # made once


def test_launch_refusals(shards: Path, tmp_path: Path) -> None:
    from freescale.launch.resize import replan_settings

    with pytest.raises(InputError, match="balanced for 2 ranks, this launch has 3"):
        replan_settings(str(shards), 3, "", True)
    fake_checkpoint(tmp_path / "other", 3, 2, "0" * 64)
    with pytest.raises(ShardError, match="written for other shards"):
        replan_settings(str(shards), 3, str(tmp_path / "other"), True)
    sha = load_manifest(shards).sha256
    replanned = ReplanFiles(tmp_path / "r")
    replanned.write(*replan(load_manifest(shards), 3, 3, order_seed=0))
    fake_checkpoint(tmp_path / "resized", 4, 3, sha, {"training.seed": 0, "data.replan": str(replanned.folder)})
    fake_checkpoint(tmp_path / "old", 9, 2, sha)  # epoch 1, position 2, written before epochs were ordered
    with pytest.raises(InputError, match="before epochs were ordered"):
        replan_settings(str(shards), 3, str(tmp_path / "old"), True)
    with pytest.raises(InputError, match="resume it on 3 ranks"):
        replan_settings(str(shards), 4, str(tmp_path / "resized"), True)
    assert replan_settings(str(shards), 3, str(tmp_path / "resized"), True) == ["--data.replan",
                                                                                  str(replanned.folder)]


def test_replanned_end() -> None:
    from freescale.shards.replan import Replan
    from freescale.training.loop.trainer import replanned_end

    meta = Replan(world_size=3, local_batch_size=3, num_steps=3, num_samples=30, from_world_size=2, from_step=10,
                  epoch=1, position=3, strategy="kk", shards_sha256="", read_seconds=0.0, plan_seconds=0.0, bubble=0.0)
    assert replanned_end(1000, meta, 7) == 13  # the re-planned epoch's end (the plan's would be 14)
    assert replanned_end(14, meta, 7) == 13
    assert replanned_end(12, meta, 7) == 12  # a run that ends mid-epoch still does


# ------------------------------------------------------------ one real resize

def test_resize_trains_every_sample_of_the_epoch_once(resized_run, movielens_shards) -> None:
    manifest = load_manifest(movielens_shards)
    first, second = resized_run.first_log, resized_run.second_log
    assert first["summary"]["samples_trained"] + second["summary"]["samples_trained"] == manifest.num_samples
    assert first["steps"] == list(range(10))
    steps = second["steps"]
    assert steps[0] == 10 and steps == list(range(10, 10 + len(steps))) and steps[-1] < manifest.num_steps
    assert "re-planned the rest of epoch 0" in resized_run.second.stderr
    assert "resharded" in resized_run.second.stderr and "from 2 to 3 ranks" in resized_run.second.stderr
    # The 3 ranks went on from the checkpoint's weights: their first loss is the 2 ranks' last, not a new model's.
    assert second["losses"][0] < first["losses"][0] - 1.0
    assert abs(second["losses"][0] - first["losses"][-1]) < 0.5
    assert len(second["timings"]["steps_ranks_fields"][0]) == 3  # 3 ranks timed


def test_resized_run_resumes_on_its_own_size_only(resized_run, movielens_shards) -> None:
    """Its checkpoint ends the re-planned epoch: on 3 ranks nothing is left; on 5 a new re-plan would be of the next
    epoch, which `freescale train` makes before any rank starts."""
    from freescale.launch.resize import replan_settings

    settings = replan_settings(str(movielens_shards), 5, str(resized_run.folder), True)
    assert settings[0] == "--data.replan" and ReplanFiles(settings[1]).read().epoch == 1
