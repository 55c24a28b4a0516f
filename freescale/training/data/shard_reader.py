"""Stream one rank's balanced shard into per-step batches.

The balance job has already decided which samples every rank trains on at
every step (``rank=<k>/part-*.parquet``, rows in ``(step, slot)`` order), so the
input pipeline must not shuffle, drop or re-batch anything within a step: it
replays the plan's steps, each epoch in its own order of whole steps
(``freescale.shards.step_order.epoch_order``: the plan's order in epoch 0, a seeded
permutation, the same on every rank, after). Its job is to do that with bounded
memory and resumable state:

* :class:`ShardReader` indexes where every step's rows are (``freescale.shards.step_index``),
  reads the Parquet row groups holding the next step's rows and yields them. Steps
  where the plan gave this rank nothing still yield an (empty) item, because every
  rank must run exactly ``num_steps`` steps per epoch or the collectives of the
  ranks would go out of step.
* Its state is (epoch, position in the epoch's order, the order's seed), so a
  resume seeks straight to the next step's row group instead of replaying the
  stream, and continues the same order.
* :func:`collate_step` turns a step's Arrow rows into flat tensors
  (:class:`SequenceBatch`) with vectorised Arrow/NumPy operations.
* :func:`build_loader` wires reader -> collate -> prefetch into a
  ``torchdata.nodes.Loader``.

Checkpointing the loader (all ranks do the same, each with its own loader)::

    manifest = load_manifest(shards_dir, world_size, rank)  # freescale.shards.manifest; once per rank
    loader = build_loader(manifest, rank, seed=seed, repeat=True)
    if resume_state is not None:            # e.g. checkpoint["loader"][rank]
        loader.load_state_dict(resume_state)  # applied at the next iter(loader)
    for trained, batch in enumerate(loader, start=1):  # batch.step: the plan step
        train_step(batch.to(device))
        if trained % save_every == 0:
            save({"loader": loader.state_dict(), ...})  # state after `batch`

``loader.state_dict()`` describes the position after the last batch the loader
handed out (batches sitting in the prefetch queue are not counted), is a small
dict of ints and is JSON-serialisable. With ``repeat`` the loader goes on into
the next epoch after an epoch's last step; without, it stops after one pass in
plan order (and a later ``iter()`` starts that pass again).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchdata.nodes import BaseNode, Loader, Mapper, Prefetcher

from freescale.runtime.errors import one_line
from freescale.shards.manifest import Manifest, ShardError, verify_checksums
from freescale.shards.schema import NON_NULL_COLUMNS, PER_ITEM_COLUMNS, READ_COLUMNS, USER_FEATURES, type_mismatches
from freescale.shards.step_index import StepIndex
from freescale.shards.step_order import epoch_order
from freescale.training.data.batch import SequenceBatch

# ShardReader state keys.
RANK_KEY = "rank"
EPOCH_KEY = "epoch"
POSITION_KEY = "position"
"""Steps of the epoch's order already handed out."""
ORDER_SEED_KEY = "order_seed"
PERMUTED_FROM_KEY = "permuted_from"
"""The first epoch in a permuted order (1; later for a run resumed from a plan-order state)."""
_STATE_KEYS = (RANK_KEY, EPOCH_KEY, POSITION_KEY, ORDER_SEED_KEY, PERMUTED_FROM_KEY)
# The earlier state (every epoch replayed the plan's order): a file position and the next step.
FILE_INDEX_KEY = "file_index"
ROW_GROUP_KEY = "row_group_index"
ROW_OFFSET_KEY = "row_offset"
NEXT_STEP_KEY = "next_step"
_PLAN_ORDER_STATE_KEYS = (RANK_KEY, FILE_INDEX_KEY, ROW_GROUP_KEY, ROW_OFFSET_KEY, NEXT_STEP_KEY)

MIN_RATING, MAX_RATING = 1, 5


@dataclass(frozen=True)
class StepRows:
    """All rows one rank trains on at ``step`` (zero rows when the plan gave it none)."""

    step: int
    rows: pa.Table
    num_user_features: int = 0
    """Width of the ``user_features`` column (0: the shards carry none)."""


def _numpy(column: pa.ChunkedArray | pa.Array, dtype: type[np.generic] = np.int64) -> np.ndarray:
    """Column -> writable NumPy array of ``dtype`` (torch warns on read-only Arrow buffers)."""
    if isinstance(column, pa.ChunkedArray) and column.num_chunks == 0:
        return np.empty(0, dtype=dtype)
    return np.array(column.to_numpy(zero_copy_only=False), dtype=dtype, copy=True)


def _rating_ids(ratings: np.ndarray) -> np.ndarray:
    """Ratings (NaN = unknown) -> embedding ids: rounded half-up into 1..5, 0 when unknown."""
    rounded = np.clip(np.floor(ratings + 0.5), MIN_RATING, MAX_RATING)
    return np.where(np.isnan(ratings), 0, rounded).astype(np.int64)


def collate_step(step_rows: StepRows) -> SequenceBatch:
    """Arrow rows of one step -> :class:`SequenceBatch`, vectorised (no per-item Python loop).

    List columns are flattened (``pyarrow.compute.list_flatten``), which drops
    the per-row offsets; ``lengths`` (validated by the reader to equal every list
    length) carries them instead.
    """
    table = step_rows.rows
    ratings = _rating_ids(_numpy(pc.list_flatten(table["ratings"]), np.float64))
    return SequenceBatch(
        lengths=torch.from_numpy(_numpy(table["length"])),
        item_ids=torch.from_numpy(_numpy(pc.list_flatten(table["items"]))),
        timestamps=torch.from_numpy(_numpy(pc.list_flatten(table["timestamps"]))),
        ratings=torch.from_numpy(ratings),
        valid_rating=torch.from_numpy(_rating_ids(_numpy(table["valid_rating"], np.float64))),
        valid_item=torch.from_numpy(_numpy(table["valid_item"])),
        test_item=torch.from_numpy(_numpy(table["test_item"])),
        valid_timestamp=torch.from_numpy(_numpy(table["valid_timestamp"])),
        test_timestamp=torch.from_numpy(_numpy(table["test_timestamp"])),
        user_ids=[str(u) for u in table["user_id"].to_pylist()],
        step=int(step_rows.step),
        step_targets=int(table["step_targets"][0].as_py()) if table.num_rows else 0,
        cost=float(pc.sum(table["cost"]).as_py() or 0.0),
        user_features=(torch.from_numpy(_numpy(pc.list_flatten(table[USER_FEATURES])))
                       .reshape(table.num_rows, step_rows.num_user_features)
                       if step_rows.num_user_features else None),
    )


class ShardReader(BaseNode[StepRows]):
    """Yields :class:`StepRows` for every plan step of one rank, one epoch in its order
    (``freescale.shards.step_order.epoch_order``), then with ``repeat`` the next epoch, and so on.

    The first ``reset`` reads every file's footer and ``step`` column (and checks them) into a
    :class:`freescale.shards.step_index.StepIndex`, so a bad file fails the launch rather than hours into
    training and any step is read with one seek. A step reads only the row groups holding its rows
    (``ParquetFile.read_row_group``, the last one kept for the next step), so memory is bounded by
    a row group plus the rows of one step, never a whole file; in plan order (epoch 0) every row
    group is read once. Each row group is validated as it is read (step order and range, list
    lengths, nulls, item ids within ``1..num_items``); problems raise :class:`ShardError` naming
    the file.

    State (``get_state``) is the epoch, the position within it and the order's seed, so
    ``reset(state)`` continues the same order exactly. A state of the earlier form (a file
    position and ``next_step``, saved when every epoch replayed the plan's order) is accepted: its
    epoch is ``EPOCH_KEY`` where the caller added it (:func:`with_epoch`), else 0, and it finishes
    that epoch in plan order, as it began.

    Args:
        manifest: the validated manifest from :func:`freescale.shards.manifest.load_manifest`
            (which also checks the files exist with the recorded sizes).
        rank: which rank's shard to stream.
        seed: the order's seed (the training seed) when a state does not name one.
        repeat: after an epoch's last step go on with the next epoch (the trainer); else stop
            (one pass, e.g. evaluation).
    """

    def __init__(self, manifest: Manifest, rank: int, *, seed: int = 0, repeat: bool = False) -> None:
        super().__init__()
        assert manifest.root is not None, "the reader needs a manifest loaded from its directory"
        self._root = manifest.root
        self._rank = rank
        self._files = [{"abspath": path, "rows": entry.rows}
                       for entry, path in zip(manifest.ranks[rank].files, manifest.rank_paths(rank))]
        if not self._files:
            raise ShardError(f"rank {rank} has an empty shard (no files) in {self._root}")
        self._num_steps = manifest.num_steps
        self._window_steps = manifest.window_steps
        self._num_items = manifest.num_items
        self._user_features = [(f.name, f.num_ids) for f in manifest.user_features]
        self._columns = READ_COLUMNS + ((USER_FEATURES,) if self._user_features else ())
        self._seed, self._repeat = seed, repeat
        # Set up by the first reset(); kept after (the files do not change).
        self._metadata: list[pq.FileMetaData] = []
        self._index: StepIndex | None = None
        self._schema: pa.Schema | None = None
        # The row group read last (kept: the next step usually starts in it).
        self._parquet: pq.ParquetFile | None = None
        self._table: pa.Table | None = None
        self._steps: np.ndarray | None = None
        self._file_index = self._row_group = -1
        # The position: this epoch's order and how far into it.
        self._epoch, self._position, self._order_seed, self._permuted_from = 0, 0, seed, 1
        self._order = np.empty(0, dtype=np.int64)

    # -- BaseNode contract -------------------------------------------------

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._close()
        if self._index is None:
            self._metadata = [self._read_footer(index) for index in range(len(self._files))]
            arrow_schema = self._metadata[0].schema.to_arrow_schema()
            self._schema = pa.schema([arrow_schema.field(name) for name in self._columns])
            self._index = StepIndex.build([f["abspath"] for f in self._files], self._metadata, self._num_steps)
        if initial_state is None:
            self._epoch, self._position, self._order_seed, self._permuted_from = 0, 0, self._seed, 1
        else:
            self._epoch, self._position, self._order_seed, self._permuted_from = self._parse_state(initial_state)
        self._order = self._epoch_order()

    def next(self) -> StepRows:
        if self._position >= self._num_steps:
            if not self._repeat:
                raise StopIteration
            self._epoch, self._position = self._epoch + 1, 0
            self._order = self._epoch_order()
        step = int(self._order[self._position])
        rows = self._read_step(step)
        self._position += 1
        return StepRows(step, rows, len(self._user_features))

    def get_state(self) -> dict[str, Any]:
        return {RANK_KEY: self._rank, EPOCH_KEY: self._epoch, POSITION_KEY: self._position,
                ORDER_SEED_KEY: self._order_seed, PERMUTED_FROM_KEY: self._permuted_from}

    # -- position ----------------------------------------------------------

    def _epoch_order(self) -> np.ndarray:
        """This epoch's plan steps by position."""
        return epoch_order(self._num_steps, self._window_steps, self._order_seed, self._epoch,
                           permuted_from=self._permuted_from)

    def _read_step(self, step: int) -> pa.Table:
        """The rank's rows of plan ``step`` (an empty table when the plan gave it none)."""
        assert self._index is not None and self._schema is not None
        pieces: list[pa.Table] = []
        for file_index, row_group, offset, count in self._index.segments(step):
            self._seek(file_index, row_group)
            assert self._table is not None and self._steps is not None
            if not (self._steps[offset] == step == self._steps[offset + count - 1]):
                raise ShardError(f"{self._current_path()}: row group {row_group} no longer holds step {step} at row "
                                 f"{offset} (the file changed since the launch read it)")
            pieces.append(self._table.slice(offset, count))
        if not pieces:
            return self._schema.empty_table()
        return pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)

    def _seek(self, file_index: int, row_group: int) -> None:
        """Make ``row_group`` of file ``file_index`` the loaded one (read and validated once per visit)."""
        if (file_index, row_group) == (self._file_index, self._row_group) and self._table is not None:
            return
        if file_index != self._file_index or self._parquet is None:
            self._close()
            self._file_index = file_index
            self._open(file_index)
        self._table = self._steps = None  # no stale row group under the new key if the read fails
        self._row_group = row_group
        self._load_row_group()

    def _parse_state(self, state: dict[str, Any]) -> tuple[int, int, int, int]:
        """``(epoch, position, order seed, first permuted epoch)`` of a state, checked against this shard."""
        if RANK_KEY in state and state[RANK_KEY] != self._rank:
            raise ShardError(f"ShardReader state was saved by rank {state[RANK_KEY]}, "
                             f"cannot resume rank {self._rank} from it")
        if POSITION_KEY not in state and NEXT_STEP_KEY in state:
            return self._parse_plan_order_state(state)
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ShardError(f"ShardReader state lacks {missing} (state {state!r})")
        epoch, position, seed, permuted_from = (int(state[k]) for k in _STATE_KEYS[1:])
        if not (epoch >= 0 and 0 <= position <= self._num_steps and permuted_from >= 1):
            raise ShardError(f"ShardReader state {state!r} is outside the shard of rank {self._rank} "
                             f"in {self._root} ({len(self._files)} files, {self._num_steps} steps)")
        return epoch, position, seed, permuted_from

    def _parse_plan_order_state(self, state: dict[str, Any]) -> tuple[int, int, int, int]:
        """A state of the earlier form: its file position is checked, its epoch finishes in plan order."""
        missing = [k for k in _PLAN_ORDER_STATE_KEYS if k not in state]
        if missing:
            raise ShardError(f"ShardReader state lacks {missing} (state {state!r})")
        file_index, row_group, row_offset, next_step = (int(state[k]) for k in _PLAN_ORDER_STATE_KEYS[1:])
        epoch = int(state.get(EPOCH_KEY, 0))
        if not (0 <= file_index <= len(self._files) and row_group >= 0 and row_offset >= 0
                and 0 <= next_step <= self._num_steps and epoch >= 0):
            raise ShardError(f"ShardReader state {state!r} is outside the shard of rank {self._rank} "
                             f"in {self._root} ({len(self._files)} files, {self._num_steps} steps)")
        self._check_file_position(file_index, row_group, row_offset)
        return epoch, next_step, self._seed, epoch + 1

    def _check_file_position(self, file_index: int, row_group: int, row_offset: int) -> None:
        """A state from another shard directory would silently read the wrong rows: refuse it."""
        if file_index == len(self._files):
            if row_group or row_offset:
                raise ShardError(f"ShardReader state points past the last file of rank {self._rank} in {self._root}")
            return
        metadata = self._metadata[file_index]
        ok = row_group < metadata.num_row_groups and row_offset <= metadata.row_group(row_group).num_rows
        # Also accepted: exactly at the end of the file (nothing read yet from the next one).
        ok = ok or (row_group == metadata.num_row_groups and row_offset == 0)
        if not ok:
            raise ShardError(f"ShardReader state (row group {row_group}, row {row_offset}) "
                             f"does not exist in {self._files[file_index]['abspath']}")

    # -- files -------------------------------------------------------------

    def _current_path(self) -> Path:
        return self._files[min(self._file_index, len(self._files) - 1)]["abspath"]

    def _read_footer(self, index: int) -> pq.FileMetaData:
        entry = self._files[index]
        path: Path = entry["abspath"]
        try:
            metadata = pq.read_metadata(path)
        except FileNotFoundError:
            raise ShardError(f"shard file {path} of rank {self._rank} is missing") from None
        except (pa.ArrowException, OSError) as exc:
            raise ShardError(f"corrupt Parquet file {path}: {one_line(exc)}") from exc
        names = set(metadata.schema.to_arrow_schema().names)
        absent = [c for c in self._columns if c not in names]
        if absent:
            raise ShardError(f"shard file {path} lacks columns {absent}")
        wrong = type_mismatches(metadata.schema.to_arrow_schema(), self._columns)
        if wrong:
            raise ShardError(f"shard file {path} has column {wrong[0]} (not the shard format)")
        if metadata.num_rows != entry["rows"]:
            raise ShardError(f"shard file {path} holds {metadata.num_rows} rows, manifest says {entry['rows']}")
        return metadata

    def _open(self, index: int) -> None:
        path = self._files[index]["abspath"]
        try:
            # Reuse the footer read in reset(); verify page CRCs where the writer
            # stored them (parquet-mr does by default), a cheap guard against bit rot.
            self._parquet = pq.ParquetFile(path, metadata=self._metadata[index], page_checksum_verification=True)
        except (pa.ArrowException, OSError) as exc:
            raise ShardError(f"corrupt Parquet file {path}: {one_line(exc)}") from exc

    def _close(self) -> None:
        if self._parquet is not None:
            self._parquet.close()
        self._parquet = None
        self._table = self._steps = None
        self._file_index = self._row_group = -1

    def _load_row_group(self) -> None:
        assert self._parquet is not None
        path = self._current_path()
        try:
            table = self._parquet.read_row_group(self._row_group, columns=list(self._columns))
        except (pa.ArrowException, OSError) as exc:
            raise ShardError(f"corrupt Parquet file {path}: row group {self._row_group}: {one_line(exc)}") from exc
        self._steps = self._validate(table, path)
        self._table = table

    def _validate(self, table: pa.Table, path: Path) -> np.ndarray:
        """Check one row group; returns its step column. Vectorised: runs once per row group."""
        where = f"{path} row group {self._row_group}"
        for name in NON_NULL_COLUMNS:
            if table[name].null_count:
                raise ShardError(f"{where}: column {name} has {table[name].null_count} null values")
        steps = _numpy(table["step"])
        if steps.size == 0:
            return steps
        if np.any(steps[1:] < steps[:-1]):
            bad = int(np.argmax(steps[1:] < steps[:-1])) + 1
            raise ShardError(f"{where}: rows are not in step order (step {steps[bad]} after {steps[bad - 1]})")
        if steps[0] < 0 or steps[-1] >= self._num_steps:
            bad_step = steps[0] if steps[0] < 0 else steps[-1]
            raise ShardError(f"{where}: step {bad_step} is outside 0..{self._num_steps - 1} (manifest num_steps)")

        lengths = _numpy(table["length"])
        for name in PER_ITEM_COLUMNS:
            actual = _numpy(pc.list_value_length(table[name]))
            if not np.array_equal(actual, lengths):
                row = int(np.argmax(actual != lengths))
                raise ShardError(f"{path}: step {steps[row]}: {name} of user {table['user_id'][row]} has "
                                 f"{actual[row]} elements but length is {lengths[row]}")
        for name in ("items", "timestamps"):
            flat = pc.list_flatten(table[name])
            if flat.null_count:
                raise ShardError(f"{where}: {name} contains {flat.null_count} null elements")

        item_ids = _numpy(pc.list_flatten(table["items"]))
        bad = (item_ids < 1) | (item_ids > self._num_items)
        if bad.any():
            index = int(np.argmax(bad))
            # Lists were checked to match `length`, so cumulative lengths map an element to its row.
            row = int(np.searchsorted(np.cumsum(lengths), index, side="right"))
            raise ShardError(f"{path}: step {steps[row]}: item id {item_ids[index]} of user "
                             f"{table['user_id'][row]} is outside 1..{self._num_items} (manifest num_items)")
        for name in ("valid_item", "test_item"):
            targets = _numpy(table[name])
            bad = (targets < 1) | (targets > self._num_items)
            if bad.any():
                row = int(np.argmax(bad))
                raise ShardError(f"{path}: step {steps[row]}: {name} id {targets[row]} of user "
                                 f"{table['user_id'][row]} is outside 1..{self._num_items} (manifest num_items)")
        if self._user_features:
            self._validate_user_features(table, steps, path)
        return steps

    def _validate_user_features(self, table: pa.Table, steps: np.ndarray, path: Path) -> None:
        column = table[USER_FEATURES]
        if column.null_count or pc.list_flatten(column).null_count:
            raise ShardError(f"{path} row group {self._row_group}: column {USER_FEATURES} has null values")
        width = len(self._user_features)
        counts = _numpy(pc.list_value_length(column))
        if np.any(counts != width):
            row = int(np.argmax(counts != width))
            raise ShardError(f"{path}: step {steps[row]}: {USER_FEATURES} of user {table['user_id'][row]} "
                             f"has {counts[row]} ids but the manifest lists {width} user features")
        ids = _numpy(pc.list_flatten(column)).reshape(-1, width)
        for index, (name, num_ids) in enumerate(self._user_features):
            bad = (ids[:, index] < 0) | (ids[:, index] >= num_ids)
            if bad.any():
                row = int(np.argmax(bad))
                raise ShardError(f"{path}: step {steps[row]}: user feature {name} id {ids[row, index]} of user "
                                 f"{table['user_id'][row]} is outside 0..{num_ids - 1} (manifest user_features)")


def build_loader(manifest: Manifest, rank: int, *, prefetch: int = 2, verify: bool = False, seed: int = 0,
                 repeat: bool = False) -> Loader[SequenceBatch]:
    """Loader of this rank's :class:`SequenceBatch`: one pass over the plan's steps in plan order, or
    with ``repeat`` epoch after epoch, each in its order for ``seed`` (the training seed).

    Pipeline: :class:`ShardReader` -> ``Mapper(collate_step)`` -> ``Prefetcher``
    (a background thread reading and collating ``prefetch`` steps ahead; 0
    disables it). ``manifest`` comes from :func:`freescale.shards.manifest.load_manifest`,
    once per rank; ``verify=True`` also checks every file's SHA-256, reading the
    shard once. Checkpoint with ``loader.state_dict()`` /
    ``loader.load_state_dict(state)``, see the module docstring.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if verify:
        verify_checksums(manifest, rank)
    node: BaseNode[Any] = Mapper(ShardReader(manifest, rank, seed=seed, repeat=repeat), collate_step)
    if prefetch:
        node = Prefetcher(node, prefetch_factor=prefetch)
    return Loader(node)


def with_epoch(loader_state: dict[str, Any], trained_steps: int, num_steps: int) -> dict[str, Any]:
    """A loader state saved when every epoch replayed the plan's order (it records the next step, not the
    epoch) with its epoch added, from the steps the run had trained when it was saved; other states
    unchanged. The reader finishes that epoch in plan order, as it began, and permutes the later ones."""
    def upgraded(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if NEXT_STEP_KEY in node and POSITION_KEY not in node and EPOCH_KEY not in node:
            return {**node, EPOCH_KEY: max(0, (trained_steps - int(node[NEXT_STEP_KEY])) // num_steps)}
        return {key: upgraded(value) for key, value in node.items()}

    return upgraded(loader_state)


def at_step(loader_state: dict[str, Any], trained_steps: int, num_steps: int) -> dict[str, Any]:
    """A plan reader's state moved to where a run that has trained ``trained_steps`` steps is: epoch
    ``trained_steps // num_steps``, that far into it (the order's seed kept); other states unchanged."""
    def moved(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if POSITION_KEY in node and EPOCH_KEY in node:
            return {**node, EPOCH_KEY: trained_steps // num_steps, POSITION_KEY: trained_steps % num_steps}
        return {key: moved(value) for key, value in node.items()}

    return moved(loader_state)


def stop_prefetch(loader: Loader) -> None:
    """Stop the loader's prefetch thread now rather than at interpreter exit.

    A daemon thread still inside a Parquet read while the process tears down its
    native libraries can abort the process after a successful run (seen on 2-rank
    CPU runs). torchdata 0.11 has no public call for this, hence the private one.
    """
    root = getattr(loader, "root", None)
    running = getattr(root, "_it", None) if isinstance(root, Prefetcher) else None
    if running is not None:
        running._shutdown()
