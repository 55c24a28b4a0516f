"""Duplicates counted inside the per-user aggregation (issue 18): build_sequences' observed
count equals the rows drop_duplicate_interactions drops, short users included, and a doubled
input through prepare gives the clean input's sequences, byte for byte, with the right count.
(tests/prepare/test_ingest.py covers drop_duplicate_interactions itself; tests/jobs/test_job_io.py the
slow MovieLens-tripled job.)"""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from pyspark.sql import Observation

from freescale.jobs import prepare
from freescale.prepare.ingest import CANONICAL_SCHEMA, drop_duplicate_interactions
from freescale.prepare.sequences import build_sequences

ROWS = [
    ("a", "z", 5, None), ("a", "w", 10, 1.0), ("a", "y", 10, 2.0), ("a", "x", 20, 3.0), ("a", "x", 30, 4.0),
    ("b", "y", 100, 5.0), ("b", "x", 50, None), ("b", "w", 70, 4.0),
    ("c", "x", 1, 1.0), ("c", "v", 2, 2.0),  # short: dropped from the sequences, its repeats still counted
    ("d", "y", 7, 3.0),
]
# Repeats: a's (w, 10) with another rating and with none, b's last event, c's first, d's only one.
REPEATS = [("a", "w", 10, 5.0), ("a", "w", 10, None), ("b", "y", 100, 5.0), ("c", "x", 1, 1.0), ("d", "y", 7, 1.0)]


def test_observed_repeats_equal_the_rows_dropping_removes(spark):
    df = spark.createDataFrame(ROWS + REPEATS, CANONICAL_SCHEMA).repartition(3)
    observed = Observation("repeats")
    build_sequences(df, 10, observed).collect()
    assert observed.get["repeated"] == df.count() - drop_duplicate_interactions(df).count() == len(REPEATS)

    clean = Observation("clean")
    build_sequences(spark.createDataFrame(ROWS, CANONICAL_SCHEMA), 10, clean).collect()
    assert clean.get["repeated"] == 0


@pytest.fixture(scope="module")
def clean_and_doubled(tmp_path_factory):
    """The same rows once, and every row twice (in another order)."""
    import pyarrow as pa

    root = tmp_path_factory.mktemp("dup_count")
    table = pa.table({"user_id": [str(u) for u in range(40) for _ in range(6)],
                      "item_id": [str((u * 7 + k * 3) % 23) for u in range(40) for k in range(6)],
                      "timestamp": [1000 + (u * 13 + k * 5) % 11 for u in range(40) for k in range(6)],
                      "rating": [float((u + k) % 5 + 1) for u in range(40) for k in range(6)]})
    pq.write_table(table, root / "clean.parquet")
    pq.write_table(pa.concat_tables([table, table]).take(list(range(2 * table.num_rows))[::-1]),
                   root / "doubled.parquet")
    return root, table.num_rows


def _prepare(root, name):
    out = root / f"out-{name}"
    assert prepare.main(["--input", str(root / f"{name}.parquet"), "--output", str(out),
                         "--tracking-uri", "none"]) == 0
    meta = json.loads((out / "prepare.json").read_text())
    sort = [("user_id", "ascending")]
    return meta, pq.read_table(out / "sequences").sort_by(sort), pq.read_table(out / "item_vocab").sort_by(
        [("item_id", "ascending")])


def test_doubled_input_gives_the_clean_sequences_and_counts_the_copies(spark, clean_and_doubled):
    root, rows = clean_and_doubled
    clean_meta, clean_seq, clean_vocab = _prepare(root, "clean")
    meta, seq, vocab = _prepare(root, "doubled")
    assert clean_meta["duplicates_dropped"] == 0
    assert meta["duplicates_dropped"] == rows and meta["input_interactions"] == 2 * rows
    assert seq.equals(clean_seq) and vocab.equals(clean_vocab)
    ignore = ("source", "duplicates_dropped", "input_interactions")
    assert {k: v for k, v in meta.items() if k not in ignore} == \
        {k: v for k, v in clean_meta.items() if k not in ignore}
