"""ShardReader / collate / build_loader / manifest checks against hand-written shards.

The shards are written with pyarrow by ``tests.helpers.write_shards`` in the layout of the
balance job (manifest.json + rank=<k>/part-*.parquet, rows in (step, slot) order), with
small row groups and several files per rank so steps straddle row-group and
file boundaries.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from freescale.shards.manifest import ShardError, load_manifest, parse_manifest, seal, verify_checksums
from freescale.shards.schema import COLUMNS, MANIFEST_FORMAT, READ_COLUMNS, arrow_schema
from tests.helpers import Row, write_shards
from freescale.training.data.batch import SequenceBatch
from freescale.shards.step_order import epoch_order
from freescale.training.data.shard_reader import (
    EPOCH_KEY,
    NEXT_STEP_KEY,
    POSITION_KEY,
    ShardReader,
    StepRows,
    build_loader,
    collate_step,
    with_epoch,
)

SCHEMA = arrow_schema()
REPO = Path(__file__).resolve().parents[2]


def open_loader(root: Path, rank: int, world_size: int, **kwargs: Any):
    """What a trainer rank does: load the manifest once, then build the loader from it."""
    return build_loader(load_manifest(root, world_size, rank=rank), rank, **kwargs)


# Captured before any test patches it, for the tests' own look at the files.
_READ_ROW_GROUP = pq.ParquetFile.read_row_group


def whole_rank(root: Path, rank: int, columns: tuple[str, ...] = READ_COLUMNS) -> pa.Table:
    """The rank's rows read whole, the way tests/helpers.py (read_rank) does."""
    manifest = json.loads((root / "manifest.json").read_text())
    tables = [pq.read_table(root / f["path"]) for f in manifest["ranks"][rank]["files"]]
    return pa.concat_tables(tables).select(list(columns))


def reference_batches(root: Path, rank: int) -> list[SequenceBatch]:
    """Expected batches built with plain Python loops, independent of collate_step's vectorisation."""
    manifest = json.loads((root / "manifest.json").read_text())
    rows = whole_rank(root, rank).to_pylist()
    out = []
    for step in range(manifest["num_steps"]):
        rs = [r for r in rows if r["step"] == step]

        def ints(values: list[Any]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        ratings = [0 if x is None else min(5, max(1, int(np.floor(x + 0.5)))) for r in rs for x in r["ratings"]]
        out.append(SequenceBatch(
            lengths=ints([r["length"] for r in rs]),
            item_ids=ints([x for r in rs for x in r["items"]]),
            timestamps=ints([x for r in rs for x in r["timestamps"]]),
            ratings=ints(ratings),
            valid_item=ints([r["valid_item"] for r in rs]), test_item=ints([r["test_item"] for r in rs]),
            valid_timestamp=ints([r["valid_timestamp"] for r in rs]),
            valid_rating=ints([0 if r["valid_rating"] is None else 5 for r in rs]),
            test_timestamp=ints([r["test_timestamp"] for r in rs]),
            user_ids=[r["user_id"] for r in rs], step=step))
    return out


def assert_batches_equal(actual: list[SequenceBatch], expected: list[SequenceBatch]) -> None:
    assert [b.step for b in actual] == [b.step for b in expected]
    for a, e in zip(actual, expected):
        assert a.user_ids == e.user_ids, a.step
        for name in ("lengths", "item_ids", "timestamps", "ratings", "valid_item", "test_item",
                     "valid_timestamp", "valid_rating", "test_timestamp"):
            got, want = getattr(a, name), getattr(e, name)
            assert got.dtype == torch.int64, name
            assert torch.equal(got, want), (a.step, name)


def reader_for(root: Path, rank: int, world_size: int = 2) -> ShardReader:
    return ShardReader(load_manifest(root, world_size, rank=rank), rank)


class ReadLog:
    """Records every ParquetFile.read_row_group call by the row group's first (step, slot)."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []
        self.live_bytes: list[int] = []
        self.step_column_reads = 0
        """Reads of the ``step`` column alone (the reader's step index, built once)."""

    def clear(self) -> None:
        self.keys.clear()
        self.live_bytes.clear()
        self.step_column_reads = 0


def record_reads(log: ReadLog, patch: Callable[[Any, str, Any], None]) -> None:
    """Log every ParquetFile.read_row_group in ``log`` (with the live Arrow bytes right after it)
    and fail any whole-file read; ``patch`` is ``monkeypatch.setattr``, or ``setattr`` in a process
    of its own."""
    original = pq.ParquetFile.read_row_group

    def counting(self: pq.ParquetFile, i: int, *args: Any, **kwargs: Any) -> pa.Table:
        table = original(self, i, *args, **kwargs)
        if table.column_names == ["step"]:
            log.step_column_reads += 1
            return table
        log.keys.append((table["step"][0].as_py(), table["slot"][0].as_py()))
        log.live_bytes.append(pa.total_allocated_bytes())
        return table

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the reader must stream row groups, not read whole files")

    patch(pq.ParquetFile, "read_row_group", counting)
    for name in ("read", "read_row_groups", "iter_batches"):
        patch(pq.ParquetFile, name, forbidden)
    patch(pq, "read_table", forbidden)


@pytest.fixture
def read_log(monkeypatch: pytest.MonkeyPatch) -> ReadLog:
    log = ReadLog()
    record_reads(log, monkeypatch.setattr)
    return log


def row_groups(root: Path, rank: int) -> list[tuple[tuple[int, int], int]]:
    """(first (step, slot), last step) of every row group of the rank, in order."""
    manifest = json.loads((root / "manifest.json").read_text())
    out = []
    for f in manifest["ranks"][rank]["files"]:
        handle = pq.ParquetFile(root / f["path"])
        for i in range(handle.num_row_groups):
            t = _READ_ROW_GROUP(handle, i, columns=["step", "slot"])
            out.append(((t["step"][0].as_py(), t["slot"][0].as_py()), t["step"][-1].as_py()))
    return out


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    # Rank 1 has nothing at steps 0, 3 and 6 (first, middle and last step).
    return write_shards(tmp_path / "shards", empty_steps={1: {0, 3, 6}})


# -- streaming ---------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_stream_equals_whole_files(shards: Path, rank: int) -> None:
    items = list(reader_for(shards, rank))
    assert [it.step for it in items] == list(range(7))  # every step exactly once, empty ones included
    streamed = pa.concat_tables([it.rows for it in items])
    assert streamed.to_pylist() == whole_rank(shards, rank).to_pylist()
    for it in items:
        assert set(it.rows["step"].to_pylist()) <= {it.step}
    assert_batches_equal([collate_step(it) for it in items], reference_batches(shards, rank))


def test_steps_cross_row_groups_and_files(shards: Path) -> None:
    # Guard on the fixture: the interesting boundaries must actually occur.
    groups = row_groups(shards, 0)
    assert len(groups) >= 6
    assert any(key[0] == prev_last for (key, _), (_, prev_last) in zip(groups[1:], groups[:-1]))
    assert len(json.loads((shards / "manifest.json").read_text())["ranks"][0]["files"]) >= 3


def test_empty_step_yields_empty_batch(shards: Path) -> None:
    batches = [collate_step(it) for it in reader_for(shards, 1)]
    for step in (0, 3, 6):
        batch = batches[step]
        assert batch.step == step and batch.batch_size == 0 and batch.user_ids == []
        for name in ("lengths", "item_ids", "timestamps", "ratings", "valid_item", "test_item"):
            tensor = getattr(batch, name)
            assert tensor.shape == (0,) and tensor.dtype == torch.int64
    assert all(b.batch_size > 0 for b in batches if b.step not in (0, 3, 6))


def test_collate_is_flat_and_rounds_ratings() -> None:
    rows = pa.Table.from_pylist([
        {"step": 4, "slot": 0, "user_id": "a", "items": [3, 1], "timestamps": [10, 11], "ratings": [4.5, None],
         "length": 2, "cost": 4.0, "valid_item": 7, "valid_timestamp": 12, "valid_rating": 2.5, "test_item": 8, "test_timestamp": 13,
         "origin_step": 4, "step_targets": 3},
        {"step": 4, "slot": 1, "user_id": "b", "items": [9, 9, 2], "timestamps": [1, 2, 3],
         "ratings": [None, None, None], "length": 3, "cost": 9.0, "valid_item": 1, "valid_timestamp": 4, "valid_rating": None,
         "test_item": 2, "test_timestamp": 5, "origin_step": 4, "step_targets": 3},
        {"step": 4, "slot": 2, "user_id": "c", "items": [5], "timestamps": [7], "ratings": [0.5],
         "length": 1, "cost": 1.0, "valid_item": 6, "valid_timestamp": 8, "valid_rating": 5.0, "test_item": 6, "test_timestamp": 9,
         "origin_step": 4, "step_targets": 3},
    ], schema=SCHEMA)
    batch = collate_step(StepRows(4, rows.slice(0)))
    assert batch.step_targets == 3
    assert batch.valid_rating.tolist() == [3, 0, 5]  # half-up rounding, unknown -> 0
    assert batch.step == 4 and batch.user_ids == ["a", "b", "c"]
    assert batch.lengths.tolist() == [2, 3, 1]
    assert batch.item_ids.tolist() == [3, 1, 9, 9, 2, 5]
    assert batch.timestamps.tolist() == [10, 11, 1, 2, 3, 7]
    assert batch.ratings.tolist() == [5, 0, 0, 0, 0, 1]  # half rounds up, null -> 0, 0.5 -> 1
    assert batch.valid_item.tolist() == [7, 1, 6] and batch.test_timestamp.tolist() == [13, 5, 9]
    # A slice that starts mid-table (as the reader yields) must flatten only its own rows.
    tail = collate_step(StepRows(4, rows.slice(1, 2)))
    assert tail.item_ids.tolist() == [9, 9, 2, 5] and tail.lengths.tolist() == [3, 1]
    moved = batch.to("cpu")
    assert torch.equal(moved.item_ids, batch.item_ids) and moved.user_ids == batch.user_ids


# -- row-group streaming and memory ------------------------------------------


def test_reads_each_row_group_once_in_order(shards: Path, read_log: ReadLog) -> None:
    items = list(reader_for(shards, 0))
    assert len(items) == 7
    # read_table/read/iter_batches are forbidden by the fixture; each row group is read once, in order.
    assert read_log.keys == [key for key, _ in row_groups(shards, 0)]


def arrow_peak_of_a_pass(root: str) -> str:
    """Rank 0's reader over the shards at ``root``, in this process: JSON of the steps read, the row
    groups read and the peak live Arrow bytes over those before the pass."""
    log = ReadLog()
    record_reads(log, setattr)
    baseline = pa.total_allocated_bytes()
    steps = 0
    for item in reader_for(Path(root), 0, world_size=1):
        collate_step(item)  # what the loader does; the Arrow rows are dropped after
        steps += 1
        del item
    return json.dumps({"steps": steps, "groups": len(log.keys), "peak": max(log.live_bytes) - baseline})


@pytest.mark.spawns
def test_memory_is_bounded_by_a_row_group(tmp_path: Path) -> None:
    """Measured in a fresh process: ``pa.total_allocated_bytes`` counts every thread's Arrow memory,
    and in a test session other threads (a loader's prefetch, a background scenario) may hold some."""
    root = write_shards(tmp_path / "big", world_size=1, num_steps=60, local_batch=6, rows_per_file=100,
                        row_group_size=8, max_len=200, num_items=1000)
    code = f"from tests.training.test_shard_reader import arrow_peak_of_a_pass; print(arrow_peak_of_a_pass({str(root)!r}))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["steps"] == 60
    peak, groups = measured["peak"], measured["groups"]
    # Measured outside the patched reader: the whole rank decoded, and its largest row group.
    files = json.loads((root / "manifest.json").read_text())["ranks"][0]["files"]
    handles = [pq.ParquetFile(root / f["path"]) for f in files]
    sizes = [_READ_ROW_GROUP(h, i, columns=list(READ_COLUMNS)).nbytes
             for h in handles for i in range(h.num_row_groups)]
    whole_bytes, largest = sum(sizes), max(sizes)
    assert groups >= 30 and whole_bytes > 20 * largest  # the check below is meaningful
    # Live Arrow memory right after each read: the new row group, the previous one
    # (a step straddling both) and slack for allocator rounding, never the file.
    assert peak <= 4 * largest, (peak, largest, whole_bytes)


# -- resume ------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_after_every_step(shards: Path, read_log: ReadLog, rank: int) -> None:
    groups = row_groups(shards, rank)
    read_log.clear()
    expected = [collate_step(it) for it in reader_for(shards, rank)]
    assert read_log.keys == [key for key, _ in groups]
    for k in range(len(expected) + 1):
        reader = reader_for(shards, rank)
        for _ in range(k):
            next(reader)
        state = json.loads(json.dumps(reader.state_dict()))  # checkpoints are JSON
        assert state[POSITION_KEY] == k and state[EPOCH_KEY] == 0 and len(state) <= 5
        read_log.clear()
        resumed = reader_for(shards, rank)
        resumed.reset(state)
        rest = [collate_step(it) for it in resumed]
        assert_batches_equal(rest, expected[k:])
        # Only row groups still holding rows of steps >= k are read, each once:
        # no replay of the consumed part of the shard.
        needed = [key for key, last_step in groups if last_step >= k]
        assert read_log.keys == needed, (k, read_log.keys, needed)


def test_resume_rejects_foreign_state(shards: Path) -> None:
    reader = reader_for(shards, 0)
    next(reader)
    state = reader.state_dict()
    with pytest.raises(ShardError, match="rank 0"):
        reader_for(shards, 1).reset(state)
    with pytest.raises(ShardError, match="is outside the shard of rank 0"):
        reader_for(shards, 0).reset({**state, POSITION_KEY: 99})
    # A state of the earlier form (a file position) is checked against the files.
    plan_order_state = {"rank": 0, "file_index": 0, "row_group_index": 99, "row_offset": 0, NEXT_STEP_KEY: 1}
    with pytest.raises(ShardError, match="does not exist"):
        reader_for(shards, 0).reset(plan_order_state)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_state_dict_round_trip(shards: Path, prefetch: int) -> None:
    expected = reference_batches(shards, 0)
    loader = open_loader(shards, 0, 2, prefetch=prefetch)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(loader.state_dict()))
    fourth = next(it)  # the loader keeps going after a checkpoint
    assert_batches_equal(first + [fourth], expected[:4])

    restored = open_loader(shards, 0, 2, prefetch=prefetch)
    restored.load_state_dict(state)
    assert_batches_equal(list(restored), expected[3:])
    # The next epoch replays the plan from step 0.
    assert_batches_equal(list(restored), expected)


# -- epochs: a new order every epoch ------------------------------------------


def repeating_reader(root: Path, rank: int, seed: int = 5, world_size: int = 2) -> ShardReader:
    return ShardReader(load_manifest(root, world_size, rank=rank), rank, seed=seed, repeat=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_later_epochs_seek_each_step_in_their_order(shards: Path, monkeypatch: pytest.MonkeyPatch,
                                                    rank: int) -> None:
    num_steps = 7
    expected = {b.step: b for b in reference_batches(shards, rank)}
    groups = row_groups(shards, rank)
    groups_of_step = {step: {key for key, last in groups if key[0] <= step <= last} for step in range(num_steps)}
    read_log = ReadLog()
    record_reads(read_log, monkeypatch.setattr)  # from here on, whole-file reads fail
    reader = repeating_reader(shards, rank)
    items = [next(reader) for _ in range(3 * num_steps)]
    assert read_log.step_column_reads == len(groups)  # the index: once, at the first reset
    for epoch in range(3):
        order = epoch_order(num_steps, 1, 5, epoch)
        assert sorted(order.tolist()) == list(range(num_steps))
        got = items[epoch * num_steps:(epoch + 1) * num_steps]
        assert [it.step for it in got] == order.tolist()
        # a permuted step's rows are exactly the plan's rows of that step (empty ones included)
        assert_batches_equal([collate_step(it) for it in got], [expected[int(s)] for s in order])
    assert epoch_order(num_steps, 1, 5, 1).tolist() != list(range(num_steps))  # the check above is meaningful
    # One seek per step: at most the row groups holding the step's rows are read for it.
    read_log.clear()
    reader.reset({**reader.state_dict(), EPOCH_KEY: 1, POSITION_KEY: 0})
    for step in epoch_order(num_steps, 1, 5, 1):
        before = len(read_log.keys)
        assert next(reader).step == step
        assert len(read_log.keys) - before <= len(groups_of_step[int(step)])


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_continues_the_same_order(shards: Path, prefetch: int) -> None:
    manifest = load_manifest(shards, 2, rank=0)
    uninterrupted = build_loader(manifest, 0, prefetch=0, seed=11, repeat=True)
    it = iter(uninterrupted)
    reference = [next(it).step for _ in range(4 * 7)]
    loader = build_loader(manifest, 0, prefetch=prefetch, seed=11, repeat=True)
    it = iter(loader)
    assert [next(it).step for _ in range(7 + 3)] == reference[:10]  # epoch 1, position 3
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = build_loader(manifest, 0, prefetch=prefetch, seed=99, repeat=True)  # the state's seed rules
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert [next(it).step for _ in range(18)] == reference[10:]
    assert reference[7:14] != reference[:7] and reference[14:21] != reference[7:14]


def test_a_plan_order_state_finishes_its_epoch_in_plan_order(shards: Path) -> None:
    """A state saved when every epoch replayed the plan: epoch from the run's step (with_epoch)."""
    legacy_reader = reader_for(shards, 0)
    for _ in range(3):
        next(legacy_reader)
    position = legacy_reader._index.segments(3)[0]  # where the earlier reader stood before step 3
    legacy = {"rank": 0, "file_index": position[0], "row_group_index": position[1], "row_offset": position[2],
              NEXT_STEP_KEY: 3}
    loader_state = {"root": {"source": legacy}, "num_yielded": 3}
    upgraded = with_epoch(loader_state, trained_steps=7 + 3, num_steps=7)
    assert upgraded["root"]["source"][EPOCH_KEY] == 1 and with_epoch(upgraded, 10, 7) == upgraded
    reader = repeating_reader(shards, 0, seed=2)
    reader.reset(upgraded["root"]["source"])
    steps = [next(reader).step for _ in range(4 + 7)]
    assert steps[:4] == [3, 4, 5, 6]  # epoch 1 began in plan order and ends in it
    assert steps[4:] == epoch_order(7, 1, 2, 2).tolist()
    assert reader.state_dict()[EPOCH_KEY] == 2
    # without an epoch (a one-pass reader): epoch 0, the rest of the plan
    plain = reader_for(shards, 0)
    plain.reset(legacy)
    assert [it.step for it in plain] == [3, 4, 5, 6]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_checkpoints_plan_order_loader_state_resumes_through_the_trainers_loader(shards: Path,
                                                                                    prefetch: int) -> None:
    """What a checkpoint saved when every epoch replayed the plan holds: the loader's nested state with
    the reader's file position; the run had trained 7 + 3 steps (epoch 1, position 3)."""
    from types import SimpleNamespace

    from freescale.training.checkpoint.resume import LoaderPosition

    manifest = load_manifest(shards, 2, rank=0)
    old = build_loader(manifest, 0, prefetch=prefetch)
    it = iter(old)
    for _ in range(3):
        next(it)
    reader_state = json.loads(json.dumps(old.state_dict()))
    source = reader_state["root"]
    while "rank" not in source:  # the reader's state, under the prefetcher's and mapper's
        source = next(v for v in source.values() if isinstance(v, dict))
    position = ShardReader(manifest, 0)
    position.reset(None)
    file_index, row_group, row_offset, _ = position._index.segments(3)[0]
    source.clear()
    source.update({"rank": 0, "file_index": file_index, "row_group_index": row_group, "row_offset": row_offset,
                   NEXT_STEP_KEY: 3})
    loader = build_loader(manifest, 0, prefetch=prefetch, seed=4, repeat=True)
    LoaderPosition(loader, SimpleNamespace(step=7 + 3), 7).load_state_dict(reader_state)
    it = iter(loader)
    assert [next(it).step for _ in range(4 + 7)] == [3, 4, 5, 6, *epoch_order(7, 1, 4, 2).tolist()]


def test_a_windowed_plan_is_permuted_window_by_window(shards: Path) -> None:
    rewrite_manifest(shards, lambda m: m.update(window_steps=3))
    reader = repeating_reader(shards, 0, seed=4)
    steps = [next(reader).step for _ in range(3 * 7)]
    for epoch in (1, 2):
        order = steps[epoch * 7:(epoch + 1) * 7]
        assert order == epoch_order(7, 3, 4, epoch).tolist()
        # windows {0,1,2}, {3,4,5}, {6}: each contiguous and in its own order
        runs = [order[i:i + len(w)] for w in ([0, 1, 2], [3, 4, 5], [6]) for i in [order.index(w[0])]]
        assert runs == [[0, 1, 2], [3, 4, 5], [6]]


# -- manifest and file errors ------------------------------------------------


def test_missing_manifest(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match=f"shard directory {tmp_path / 'empty'}"):
        load_manifest(tmp_path / "empty", 2)
    with pytest.raises(ShardError, match="no manifest.json"):
        open_loader(tmp_path / "empty", 0, 2)


def test_world_size_mismatch_names_both(shards: Path) -> None:
    with pytest.raises(ShardError) as err:
        open_loader(shards, 0, 3)
    message = str(err.value)
    assert "world size 2" in message and "world size 3" in message and "\n" not in message


def test_rank_outside_world(shards: Path) -> None:
    with pytest.raises(ShardError, match="rank 2 is outside world size 2"):
        open_loader(shards, 2, 2)


def test_file_size_mismatch(shards: Path) -> None:
    manifest = load_manifest(shards, 2)
    path = shards / manifest.ranks[1].files[1].path
    with open(path, "ab") as handle:
        handle.write(b"xx")
    load_manifest(shards, 2, rank=0)  # only this rank's files are stat'ed
    with pytest.raises(ShardError, match=f"{path}.*bytes"):
        open_loader(shards, 1, 2)


def test_missing_file(shards: Path) -> None:
    path = shards / load_manifest(shards, 2).ranks[0].files[0].path
    path.unlink()
    with pytest.raises(ShardError, match=f"{path} of rank 0 is missing"):
        load_manifest(shards, 2)


def test_empty_rank_shard(tmp_path: Path) -> None:
    root = write_shards(tmp_path / "s", empty_steps={1: set(range(7))})
    with pytest.raises(ShardError, match=f"rank 1 has an empty shard.*{root}"):
        open_loader(root, 0, 2)


def _corrupt_whole_file(root: Path, rank: int, index: int) -> Path:
    path = root / load_manifest(root, 2).ranks[rank].files[index].path
    size = path.stat().st_size
    path.write_bytes(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path  # same size, so only reading the file can tell


def test_corrupt_parquet_file(shards: Path) -> None:
    path = _corrupt_whole_file(shards, 0, 1)
    load_manifest(shards, 2)  # sizes still match
    with pytest.raises(ShardError, match=f"corrupt Parquet file {path}"):
        list(reader_for(shards, 0))
    with pytest.raises(ShardError, match=f"corrupt Parquet file {path}"):
        list(open_loader(shards, 0, 2))
    with pytest.raises(ShardError, match=f"{path} has sha256"):
        open_loader(shards, 0, 2, verify=True)


def test_corrupt_data_page(shards: Path) -> None:
    manifest = load_manifest(shards, 2)
    verify_checksums(manifest, 0)
    path = shards / manifest.ranks[0].files[0].path
    column = pq.read_metadata(path).row_group(1).column(3)  # items of the second row group
    end = column.data_page_offset + column.total_compressed_size
    data = bytearray(path.read_bytes())
    for i in range(end - 6, end - 2):  # inside the page payload, header intact
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=f"corrupt Parquet file {path}: row group 1"):
        list(reader_for(shards, 0))


@pytest.mark.parametrize("bad_id", [41, 0, -3])
def test_item_id_outside_catalog(tmp_path: Path, bad_id: int) -> None:
    def alter(rank: int, rows: list[Row]) -> None:
        if rank == 1:
            row = next(r for r in rows if r["step"] == 4)
            row["items"][-1] = bad_id

    root = write_shards(tmp_path / "s", alter=alter)  # num_items = 40
    reader = reader_for(root, 1)
    path_pattern = r"rank=1/part-\d+-c000\.snappy\.parquet"
    with pytest.raises(ShardError, match=f"{path_pattern}: step 4: item id {bad_id} .*outside 1..40"):
        list(reader)
    list(reader_for(root, 0))  # the other rank is fine


def test_target_id_outside_catalog(tmp_path: Path) -> None:
    def alter(rank: int, rows: list[Row]) -> None:
        if rank == 0:
            rows[-1]["test_item"] = 99

    root = write_shards(tmp_path / "s", alter=alter)
    with pytest.raises(ShardError, match="step 6: test_item id 99"):
        list(reader_for(root, 0))


def test_rows_out_of_step_order(tmp_path: Path) -> None:
    def alter(rank: int, rows: list[Row]) -> None:
        if rank == 0:
            rows[2], rows[-2] = rows[-2], rows[2]

    root = write_shards(tmp_path / "s", alter=alter)
    with pytest.raises(ShardError, match="step order"):
        list(reader_for(root, 0))


def test_length_disagrees_with_items(tmp_path: Path) -> None:
    def alter(rank: int, rows: list[Row]) -> None:
        if rank == 0:
            rows[5]["length"] += 1

    root = write_shards(tmp_path / "s", alter=alter)
    with pytest.raises(ShardError, match="elements but length is"):
        list(reader_for(root, 0))


def test_step_beyond_manifest(tmp_path: Path) -> None:
    def alter(rank: int, rows: list[Row]) -> None:
        if rank == 0:
            rows[-1]["step"] = 7  # still in step order, but past the manifest's 7 steps
    root = write_shards(tmp_path / "s", alter=alter)
    with pytest.raises(ShardError, match=r"step 7 is outside 0\.\.6"):
        list(reader_for(root, 0))


def rewrite_manifest(root: Path, edit: Callable[[dict], None], *, reseal: bool = True) -> None:
    raw = json.loads((root / "manifest.json").read_text())
    edit(raw)
    (root / "manifest.json").write_text(json.dumps(seal(raw) if reseal else raw))


@pytest.mark.parametrize("edit", [
    lambda m: m.update(local_batch_size=m["local_batch_size"] + 1),
    lambda m: m["ranks"][0]["files"][0].update(sha256="0" * 64),
    lambda m: m.update(num_steps=5),
], ids=["local_batch_size", "file_sha256", "num_steps"])
def test_a_hand_edited_manifest_is_refused(shards: Path, edit: Callable[[dict], None]) -> None:
    """The manifest is sealed by the job (content_sha256 over its fields): an edit that does not
    reseal it is refused in one line, whatever field it touched."""
    rewrite_manifest(shards, edit, reseal=False)
    with pytest.raises(ShardError, match=r"manifest.json was changed after the balance job wrote it"):
        load_manifest(shards, 2)


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(local_batch_size=m["local_batch_size"] + 1, global_batch_size=0),
     "56 rows do not fit 7 steps of world_size 2 x local_batch_size 5 = 10"),
    (lambda m: m.update(num_steps=5), "56 rows do not fit 5 steps"),
    (lambda m: m.update(global_batch_size=9), "global_batch_size 9 is not world_size 2 x local_batch_size 4"),
    (lambda m: m.update(num_rows=55), "num_rows 55 but the ranks' files hold 56 rows"),
], ids=["local_batch_size", "num_steps", "global_batch_size", "num_rows"])
def test_manifest_totals_are_checked_against_its_files(shards: Path, edit: Callable[[dict], None],
                                                        words: str) -> None:
    """Even a resealed edit must agree with the files' row counts: every step but the last
    holds world_size x local_batch_size rows."""
    rewrite_manifest(shards, edit)
    with pytest.raises(ShardError, match=re.escape(words)):
        load_manifest(shards, 2)


def test_format_and_checksum_helpers(shards: Path) -> None:
    manifest = load_manifest(shards, 2)
    for rank in range(2):
        verify_checksums(manifest, rank)
    raw = json.loads((shards / "manifest.json").read_text())
    raw["format"] = "something/2"
    (shards / "manifest.json").write_text(json.dumps(seal(raw)))
    with pytest.raises(ShardError, match="format 'something/2'"):
        load_manifest(shards, 2)
    (shards / "manifest.json").write_text("{not json")
    with pytest.raises(ShardError, match=f"cannot parse {shards / 'manifest.json'}"):
        load_manifest(shards, 2)


# ------------------------------------------------------------- user features

USER_FEATURES = [("age", 7), ("gender", 3)]


def test_user_features_are_collated_per_sample(tmp_path: Path) -> None:
    root = write_shards(tmp_path / "s", user_features=USER_FEATURES, empty_steps={0: {2}})
    expected = whole_rank(root, 0, ("user_features",))
    batches = list(open_loader(root, 0, 2, prefetch=0))
    assert batches[2].batch_size == 0 and tuple(batches[2].user_features.shape) == (0, 2)
    collated = torch.cat([b.user_features for b in batches])
    assert collated.dtype == torch.int64
    assert collated.tolist() == expected["user_features"].to_pylist()


def test_shards_without_user_features_give_none(shards: Path) -> None:
    assert all(b.user_features is None for b in open_loader(shards, 1, 2, prefetch=0))


def test_user_feature_id_outside_table(tmp_path: Path) -> None:
    def alter(rank: int, rows: list[Row]) -> None:
        if rank == 1:
            next(r for r in rows if r["step"] == 3)["user_features"][1] = 3

    root = write_shards(tmp_path / "s", user_features=USER_FEATURES, alter=alter)
    with pytest.raises(ShardError, match=r"step 3: user feature gender id 3 of user u1-3-\d+ is outside 0..2"):
        list(reader_for(root, 1))


def test_user_features_of_wrong_width(tmp_path: Path) -> None:
    def alter(rank: int, rows: list[Row]) -> None:
        if rank == 0:
            rows[0]["user_features"] = [1]

    root = write_shards(tmp_path / "s", user_features=USER_FEATURES, alter=alter)
    with pytest.raises(ShardError, match="user_features of user u0-0-0 has 1 ids but the manifest lists 2"):
        list(reader_for(root, 0))


def test_manifest_lists_user_features_the_files_lack(shards: Path) -> None:
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["user_features"] = [{"name": "age", "num_ids": 7}]
    (shards / "manifest.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(ShardError, match=r"lacks columns \['user_features'\]"):
        reader_for(shards, 0).reset()


def test_manifest_user_feature_entry_is_checked(shards: Path) -> None:
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["user_features"] = [{"name": "age"}]
    (shards / "manifest.json").write_text(json.dumps(seal(manifest)))
    with pytest.raises(ShardError, match="user_features entry .* needs a name and num_ids"):
        load_manifest(shards, 2)


# ------------------------------------------------------------- shard format


def test_manifest_round_trips_through_its_dataclass(shards: Path) -> None:
    manifest = load_manifest(shards, 2)
    (shards / "copy").mkdir()
    (shards / "copy" / "manifest.json").write_text(manifest.dumps())
    again = parse_manifest(json.loads(manifest.dumps()), shards / "copy" / "manifest.json")
    assert again == manifest and again.ranks[1].files == manifest.ranks[1].files
    assert json.loads(manifest.dumps())["format"] == MANIFEST_FORMAT


def test_manifest_field_of_wrong_type_is_named(shards: Path) -> None:
    raw = json.loads((shards / "manifest.json").read_text())
    (shards / "manifest.json").write_text(json.dumps(seal({**raw, "control": 3})))
    with pytest.raises(ShardError, match=r"manifest.json: control should be str \| None, found 3$"):
        load_manifest(shards, 2)
    (shards / "manifest.json").write_text(json.dumps(seal({**raw, "num_step": 3})))
    with pytest.raises(ShardError, match="unknown field 'num_step'"):
        load_manifest(shards, 2)


def test_column_of_another_type_is_refused(tmp_path: Path) -> None:
    """A writer that drifts from the format (here: 64-bit item ids) is stopped at the footer."""
    root = write_shards(tmp_path / "s")
    path = root / load_manifest(root, 2).ranks[0].files[0].path
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index("items"), "items",
                             table["items"].cast(pa.list_(pa.int64())))
    pq.write_table(table, path)
    raw = json.loads((root / "manifest.json").read_text())
    raw["ranks"][0]["files"][0]["bytes"] = path.stat().st_size
    (root / "manifest.json").write_text(json.dumps(seal(raw)))
    with pytest.raises(ShardError, match=f"{path} has column items: found list<int64>, expected "
                                         r"list<int32> \(not the shard format\)"):
        iter(open_loader(root, 0, 2, prefetch=0))  # footers are read and checked when iteration starts


def test_every_format_column_is_described_and_read_columns_exist() -> None:
    assert all(c.meaning for c in COLUMNS)
    assert set(READ_COLUMNS) <= {c.name for c in COLUMNS} and "origin_step" not in READ_COLUMNS
    assert arrow_schema().names == [c.name for c in COLUMNS if not c.optional]
