"""Stream one rank's part of a re-planned epoch (``freescale.shards.replan``): a resume on another world size.

The re-plan names, for each of this rank's samples, its new step and where it lives in the
shards (a rank of the old plan and its row there). :class:`ReplannedReader` yields the same
:class:`StepRows` as the plan's own reader, one per new step, empty steps included, so the
trainer cannot tell them apart. A step's rows come from one or two old steps of a few old ranks
(the re-plan keeps the epoch's order), so it reads a few row groups, each validated as the plan's
reader does, and keeps the last few in a small cache. Its state is the next step.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow as pa
from torchdata.nodes import BaseNode, Loader, Mapper, Prefetcher

from freescale.shards.manifest import Manifest, ShardError
from freescale.shards.replan import Replan, ReplanFiles
from freescale.training.data.shard_reader import ShardReader, StepRows, collate_step

NEXT_STEP_KEY = "replan_next_step"
CACHED_ROW_GROUPS = 8


class _SourceShard(ShardReader):
    """One old rank's files, read by row group on demand (the plan reader's checks on each)."""

    def __init__(self, manifest: Manifest, rank: int):
        super().__init__(manifest, rank)
        self._metadata = [self._read_footer(index) for index in range(len(self._files))]
        self.file_starts = np.cumsum([0] + [entry["rows"] for entry in self._files])
        self.group_starts = [np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
                             for meta in self._metadata]

    def locate(self, row: int) -> tuple[int, int, int]:
        """(file, row group, offset in it) of the rank's ``row``-th row."""
        file_index = int(np.searchsorted(self.file_starts, row, side="right")) - 1
        in_file = row - int(self.file_starts[file_index])
        group = int(np.searchsorted(self.group_starts[file_index], in_file, side="right")) - 1
        return file_index, group, in_file - int(self.group_starts[file_index][group])

    def row_group(self, file_index: int, group: int) -> pa.Table:
        self._seek(file_index, group)
        assert self._table is not None
        return self._table


class ReplannedReader(BaseNode[StepRows]):
    """Yields :class:`StepRows` for the re-plan's steps ``0 .. num_steps-1`` of ``rank``."""

    def __init__(self, manifest: Manifest, files: ReplanFiles, rank: int):
        super().__init__()
        self._replan: Replan = files.read()
        rows = files.rows_of(rank)
        self._steps = rows["step"].to_numpy()
        self._source_rank = rows["source_rank"].to_numpy()
        self._source_row = rows["source_row"].to_numpy()
        self._step_targets = rows["step_targets"].to_numpy()
        self._sources = {int(k): _SourceShard(manifest, int(k)) for k in np.unique(self._source_rank)}
        self._num_user_features = len(manifest.user_features)
        self._schema = _empty_schema(manifest)
        self._cache: OrderedDict[tuple[int, int, int], pa.Table] = OrderedDict()
        self._next_step = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._next_step = 0
        if initial_state is not None:
            step = initial_state.get(NEXT_STEP_KEY)
            if not isinstance(step, int) or not 0 <= step <= self._replan.num_steps:
                raise ShardError(f"re-planned reader state {initial_state!r} is not a step of the re-plan's "
                                 f"{self._replan.num_steps}")
            self._next_step = step

    def get_state(self) -> dict[str, Any]:
        return {NEXT_STEP_KEY: self._next_step}

    def next(self) -> StepRows:
        step = self._next_step
        if step >= self._replan.num_steps:
            raise StopIteration
        self._next_step += 1
        lo, hi = np.searchsorted(self._steps, [step, step + 1])
        if lo == hi:
            return StepRows(step, self._schema.empty_table(), self._num_user_features)
        pieces = [self._row(int(self._source_rank[i]), int(self._source_row[i])) for i in range(lo, hi)]
        table = pa.concat_tables(pieces)
        targets = pa.array(np.full(table.num_rows, self._step_targets[lo], dtype=np.int64))
        table = table.set_column(table.schema.get_field_index("step_targets"), "step_targets", targets)
        return StepRows(step, table, self._num_user_features)

    def _row(self, rank: int, row: int) -> pa.Table:
        source = self._sources[rank]
        file_index, group, offset = source.locate(row)
        key = (rank, file_index, group)
        table = self._cache.get(key)
        if table is None:
            table = source.row_group(file_index, group)
            self._cache[key] = table
            if len(self._cache) > CACHED_ROW_GROUPS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return table.slice(offset, 1)


def _empty_schema(manifest: Manifest) -> pa.Schema:
    reader = _SourceShard(manifest, 0)
    arrow = reader._metadata[0].schema.to_arrow_schema()
    return pa.schema([arrow.field(name) for name in reader._columns])


def build_replanned_loader(manifest: Manifest, files: ReplanFiles, rank: int, *, prefetch: int = 2
                           ) -> Loader:
    """The plan reader's ``build_loader``, over a re-plan: reader -> collate -> prefetch."""
    node: BaseNode[Any] = Mapper(ReplannedReader(manifest, files, rank), collate_step)
    if prefetch:
        node = Prefetcher(node, prefetch_factor=prefetch)
    return Loader(node)


def check_replan(files: ReplanFiles, manifest: Manifest, world_size: int) -> Replan:
    """The re-plan, refused unless it was made from these shards for this world size."""
    replan = files.read()
    if replan.shards_sha256 != manifest.sha256:
        raise ShardError(f"re-plan {files.folder} was made from other shards (manifest sha256 "
                         f"{replan.shards_sha256[:12]}..., these are {manifest.sha256[:12]}...)")
    if replan.world_size != world_size:
        raise ShardError(f"re-plan {files.folder} is for {replan.world_size} ranks, this launch has {world_size}")
    return replan
