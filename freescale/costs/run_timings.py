"""A run's per-step, per-rank timing table as a Parquet file (part of the run summary's contract,
freescale/costs/run_summary.py): rank 0 of `freescale train` appends each gathered window of steps
as it goes, so no process holds the whole table while the run trains.

One row per (step, rank), steps in the order trained and ranks in order within a step: columns
``step`` (int64), ``rank`` (int32), then one float64 column per timing field
(``freescale.training.timing.bubbles.TIMING_FIELDS``), a row group per ``GROUP_STEPS`` steps. A reader asks for
one field at a time as a ``[steps, ranks]`` array (``TimingColumns.column``), so the run summary's
numbers read a few columns, never the whole ``[steps, ranks, fields]`` table.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

FILE_NAME = "timings.parquet"
"""The file's name as an MLflow artifact (under ``timings/``) of a run trained from step 0."""


def artifact_name(first_step: int) -> str:
    """The timing file's artifact name for a process that trained from ``first_step``: a resumed
    process's rows sit beside the earlier attempt's, not over them."""
    return FILE_NAME if first_step == 0 else f"timings-from-step-{first_step}.parquet"


GROUP_STEPS = 4096
"""Steps per row group: windows are held until this many (a row group per gathered window of one
step would make a footer as large as the data)."""


class TimingFile:
    """Appends ``[n, ranks, fields]`` windows of steps to ``path``, a row group each time ``group_steps``
    steps are held (opened at the first; a file is valid once ``close`` wrote the rest and its footer:
    at the run's end, or at a stop)."""

    def __init__(self, path: str | Path, fields: Sequence[str], world_size: int, group_steps: int = GROUP_STEPS):
        self.path, self.fields, self.world_size = Path(path), list(fields), world_size
        self.group_steps = max(1, group_steps)
        self.steps = 0
        self.first_step: int | None = None
        self._held: list[tuple[Sequence[int], np.ndarray]] = []
        self._held_steps = 0
        self._writer = None
        self._closed = False

    def append(self, steps: Sequence[int], window: np.ndarray) -> None:
        if self._closed:
            raise ValueError(f"{self.path} is closed")
        n, ranks = len(steps), self.world_size
        if window.shape != (n, ranks, len(self.fields)):
            raise ValueError(f"a window of {window.shape} for {n} steps x {ranks} ranks x {len(self.fields)} fields")
        if n == 0:
            return
        if self.first_step is None:
            self.first_step = int(steps[0])
        self._held.append((steps, window))
        self._held_steps += n
        self.steps += n
        if self._held_steps >= self.group_steps:
            self._write_held()

    def _write_held(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._held:
            return
        steps = np.concatenate([np.asarray(s, dtype=np.int64) for s, _ in self._held])
        window = np.concatenate([w for _, w in self._held]).astype(np.float64, copy=False)
        self._held, self._held_steps = [], 0
        n, ranks = len(steps), self.world_size
        columns = {"step": pa.array(np.repeat(steps, ranks)), "rank": pa.array(np.tile(np.arange(ranks, dtype=np.int32), n))}
        flat = window.reshape(n * ranks, len(self.fields))
        columns.update({name: pa.array(flat[:, i]) for i, name in enumerate(self.fields)})
        group = pa.table(columns).replace_schema_metadata({"ranks": str(ranks)})
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.path, group.schema)
        self._writer.write_table(group, row_group_size=n * ranks)

    def close(self) -> Path | None:
        """Write what is held and the footer; the file, or None when no step was appended (safe to
        call twice)."""
        if not self._closed:
            self._write_held()
        self._closed = True
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return self.path if self.steps else None


class TimingColumns:
    """A timing file read field by field: ``column(name)`` is ``[steps, ranks]`` float64."""

    def __init__(self, path: str | Path):
        import pyarrow.parquet as pq

        self.path = Path(path)
        self._file = pq.ParquetFile(self.path)
        names = self._file.schema_arrow.names
        if names[:2] != ["step", "rank"]:
            raise ValueError(f"{self.path}: not a timing file (columns {names[:2]}, want step, rank)")
        self.fields = names[2:]
        self.ranks = int((self._file.schema_arrow.metadata or {}).get(b"ranks", b"0"))
        rows = self._file.metadata.num_rows
        if not self.ranks or rows % self.ranks:
            raise ValueError(f"{self.path}: not a timing file ({rows} rows of {self.ranks} ranks)")
        self.num_steps = rows // self.ranks

    def __len__(self) -> int:
        return self.num_steps

    def _read(self, name: str) -> np.ndarray:
        return self._file.read(columns=[name]).column(0).to_numpy()

    def column(self, name: str) -> np.ndarray:
        if name not in self.fields:
            raise KeyError(f"{self.path}: no timing field {name!r}")
        return self._read(name).reshape(self.num_steps, self.ranks)

    def steps(self) -> np.ndarray:
        """The step of each row of the columns."""
        return self._read("step").reshape(self.num_steps, self.ranks)[:, 0]

    def table(self) -> np.ndarray:
        """The whole ``[steps, ranks, fields]`` table (for small runs and the readers that need all of it)."""
        return np.stack([self.column(name) for name in self.fields], axis=-1)


class TableColumns:
    """A ``[steps, ranks, fields]`` table held in memory, read as ``TimingColumns`` reads a file."""

    def __init__(self, fields: Sequence[str], table: np.ndarray):
        table = np.asarray(table, dtype=np.float64)
        if table.ndim != 3 or table.shape[2] != len(fields):
            raise ValueError(f"a table of shape {table.shape} is not [steps, ranks, {len(fields)} fields]")
        self.fields, self._table = list(fields), table
        self.num_steps, self.ranks = table.shape[:2]

    def __len__(self) -> int:
        return self.num_steps

    def column(self, name: str) -> np.ndarray:
        if name not in self.fields:
            raise KeyError(f"no timing field {name!r}")
        return self._table[..., self.fields.index(name)]

    def table(self) -> np.ndarray:
        return self._table
