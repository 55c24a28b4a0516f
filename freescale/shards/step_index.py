"""Where each plan step's rows of one rank lie in its Parquet files, so that any step is one seek.

Built from the files' footers and their ``step`` column only (one int column, read a row group at
a time; no other column is decoded). A step's rows may span row groups and files: it maps to one
or more segments (file, row group, first row, row count), in file order. Building it checks that
the rank's rows are in step order across all its files and that every step is one of the plan's;
a problem raises :class:`ShardError` naming the file and row group.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from freescale.runtime.errors import one_line
from freescale.shards.manifest import ShardError

# Columns of StepIndex.table.
STEP, FILE, ROW_GROUP, OFFSET, COUNT = range(5)


class StepIndex:
    """Plan step -> its segments ``(file index, row group, first row, row count)`` in one rank's files."""

    def __init__(self, num_steps: int, table: np.ndarray):
        self.num_steps = num_steps
        self.table = table
        """[segments, 5] int64 (STEP, FILE, ROW_GROUP, OFFSET, COUNT), sorted by step then file order."""
        steps = table[:, STEP]
        self._first = np.searchsorted(steps, np.arange(num_steps), side="left")
        self._end = np.searchsorted(steps, np.arange(num_steps), side="right")

    def segments(self, step: int) -> list[tuple[int, int, int, int]]:
        """Where ``step``'s rows are, in order (empty: this rank has nothing at that step)."""
        rows = self.table[self._first[step]:self._end[step], FILE:]
        return [tuple(int(v) for v in row) for row in rows]  # type: ignore[misc]

    def rows(self, step: int) -> int:
        return int(self.table[self._first[step]:self._end[step], COUNT].sum())

    @classmethod
    def build(cls, paths: list[Path], footers: list[pq.FileMetaData], num_steps: int) -> StepIndex:
        """The index of the files at ``paths`` (in streaming order) with their already read ``footers``."""
        parts: list[np.ndarray] = []
        previous: tuple[int, Path] | None = None  # last step seen, and where
        for index, (path, footer) in enumerate(zip(paths, footers)):
            try:
                handle = pq.ParquetFile(path, metadata=footer, page_checksum_verification=True)
            except (pa.ArrowException, OSError) as exc:
                raise ShardError(f"corrupt Parquet file {path}: {one_line(exc)}") from exc
            with handle:
                for group in range(footer.num_row_groups):
                    steps = _step_column(handle, path, group, num_steps)
                    if steps.size == 0:
                        continue
                    if previous is not None and steps[0] < previous[0]:
                        raise ShardError(f"{path}: row group {group} has step {steps[0]} after step {previous[0]} "
                                         f"(in {previous[1]}) was complete (rows not in step order)")
                    previous = int(steps[-1]), path
                    parts.append(_segments(steps, index, group))
        return cls(num_steps, np.concatenate(parts) if parts else np.empty((0, 5), dtype=np.int64))


def _segments(steps: np.ndarray, file: int, group: int) -> np.ndarray:
    """One row group's non-decreasing step column -> its rows of each step, as index rows."""
    starts = np.concatenate(([0], np.flatnonzero(np.diff(steps)) + 1))
    part = np.empty((starts.size, 5), dtype=np.int64)
    part[:, STEP], part[:, FILE], part[:, ROW_GROUP] = steps[starts], file, group
    part[:, OFFSET], part[:, COUNT] = starts, np.diff(np.concatenate((starts, [steps.size])))
    return part


def _step_column(handle: pq.ParquetFile, path: Path, group: int, num_steps: int) -> np.ndarray:
    """One row group's ``step`` column, checked: no nulls, non-decreasing, within the plan."""
    where = f"{path} row group {group}"
    try:
        column = handle.read_row_group(group, columns=["step"])["step"]
    except (pa.ArrowException, OSError) as exc:
        raise ShardError(f"corrupt Parquet file {path}: row group {group}: {one_line(exc)}") from exc
    if column.null_count:
        raise ShardError(f"{where}: column step has {column.null_count} null values")
    steps = np.asarray(column.to_numpy(), dtype=np.int64)
    if steps.size == 0:
        return steps
    if np.any(steps[1:] < steps[:-1]):
        bad = int(np.argmax(steps[1:] < steps[:-1])) + 1
        raise ShardError(f"{where}: rows are not in step order (step {steps[bad]} after {steps[bad - 1]})")
    if steps[0] < 0 or steps[-1] >= num_steps:
        bad_step = steps[0] if steps[0] < 0 else steps[-1]
        raise ShardError(f"{where}: step {bad_step} is outside 0..{num_steps - 1} (manifest num_steps)")
    return steps
