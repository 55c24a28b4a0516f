"""The shard format: file layout, format version, and every column with its Arrow type.

A shard directory, written by the balance job (``freescale/jobs/balance.py``) and read by
the trainer (``freescale/training/data/shard_reader.py``)::

    manifest.json                 what a rank needs to trust the directory (freescale/shards/manifest.py)
    rank=<k>/part-*.parquet       rank k's rows, in (step, slot) order
    _steps/                       per-step predicted loads (a diagnostic, read by nobody)

Adding a column is one entry in ``COLUMNS`` plus its producer (the balance job
selects and casts every column listed here) and its consumer (the reader reads
the columns marked ``read``). Standard library and pyarrow only, so the Spark job
and the trainer can both import it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "freescale.shards/2"
"""Version 2 added ``content_sha256``, the manifest's seal over its own fields."""
RANK_DIR = "rank={rank}"
STEP_STATS_DIR = "_steps"


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    """The Arrow type the balance job writes (Spark's Parquet types: int -> int32, long -> int64)."""
    meaning: str
    read: bool = True
    """Whether the trainer reads it; the others are planning diagnostics and cost no memory there."""
    nullable: bool = False
    """Whether a null is legal data. Elsewhere a null is a job bug, refused by the reader: it would
    become NaN or a garbage id after collation."""
    per_item: bool = False
    """A list aligned with ``items`` (one element per history item, ``length`` elements)."""
    optional: bool = False
    """Present only when the data has it (the reader requires it when the manifest says so)."""


COLUMNS: tuple[Column, ...] = (
    Column("step", pa.int64(), "training step the plan gives this sample to, 0..num_steps-1"),
    Column("slot", pa.int32(), "position within the rank's batch of that step"),
    Column("user_id", pa.string(), "the user whose history this sample is"),
    Column("items", pa.list_(pa.int32()), "history item ids, 1..num_items, oldest first", per_item=True),
    Column("timestamps", pa.list_(pa.int64()), "unix seconds of each history item", per_item=True),
    Column("ratings", pa.list_(pa.float32()), "rating of each history item; null elements when unknown",
           per_item=True),
    Column("length", pa.int32(), "history length L (the size of every per-item list)"),
    Column("cost", pa.float64(), "the cost model's a*L^2 + b*L + c: what the plan expected of this sample"),
    Column("valid_item", pa.int32(), "validation target (second-to-last interaction)"),
    Column("valid_timestamp", pa.int64(), "unix seconds of the validation target"),
    Column("valid_rating", pa.float32(), "rating of the validation target", nullable=True),
    Column("test_item", pa.int32(), "test target (last interaction), held out from training"),
    Column("test_timestamp", pa.int64(), "unix seconds of the test target"),
    Column("origin_step", pa.int64(), "step the sample had before the window planner moved it", read=False),
    Column("step_targets", pa.int64(),
           "next-item targets of this step over all ranks: each rank divides its loss sum by it"),
    Column("user_features", pa.list_(pa.int32()),
           "one id per manifest user feature, in the manifest's order; 0 = unknown", optional=True),
)
BY_NAME = {c.name: c for c in COLUMNS}

USER_FEATURES = BY_NAME["user_features"].name
READ_COLUMNS = tuple(c.name for c in COLUMNS if c.read and not c.optional)
NON_NULL_COLUMNS = tuple(c.name for c in COLUMNS if c.read and not c.optional and not c.nullable)
PER_ITEM_COLUMNS = tuple(c.name for c in COLUMNS if c.per_item)


def arrow_schema(*, user_features: bool = False) -> pa.Schema:
    """The schema of a shard file: every column, the optional ones when asked for."""
    return pa.schema([pa.field(c.name, c.type, nullable=c.nullable)
                      for c in COLUMNS if not c.optional or user_features])


def type_mismatches(schema: pa.Schema, names: tuple[str, ...]) -> list[str]:
    """``"column: found T, expected U"`` for each of ``names`` whose type differs from the format's.

    Nullability and list element names are not compared: writers differ on both (Spark calls a
    list element ``element``, pyarrow ``item``), and nulls are checked on the data.
    """
    return [f"{name}: found {_spelled(schema.field(name).type)}, expected {_spelled(BY_NAME[name].type)}"
            for name in names if not _same_type(schema.field(name).type, BY_NAME[name].type)]


def _spelled(t: pa.DataType) -> str:
    return f"list<{_spelled(t.value_type)}>" if pa.types.is_list(t) else str(t)


def _same_type(found: pa.DataType, expected: pa.DataType) -> bool:
    if pa.types.is_list(found) and pa.types.is_list(expected):
        return _same_type(found.value_type, expected.value_type)
    return found.equals(expected)


def rank_dir(rank: int) -> str:
    return RANK_DIR.format(rank=rank)
