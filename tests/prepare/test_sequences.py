"""Item vocabulary and leave-one-out sequences: exact small cases, then MovieLens-100K."""
from __future__ import annotations

import pytest
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from freescale.runtime.errors import InputError
from freescale.prepare.ingest import CANONICAL_SCHEMA, read_interactions
from freescale.prepare.sequences import (
    SEQUENCE_COLUMNS,
    apply_item_vocab,
    build_item_vocab,
    build_sequences,
    dropped_short_users,
    sequence_stats,
)

# Item counts: x=4, y=3, w=2, v=1, z=1 -> ids x1 y2 w3 v4 z5 (v before z on the tie).
# User a ties at t=10 between y (id 2) and w (id 3): id order, not name order, decides.
TINY = [
    ("a", "z", 5, None), ("a", "w", 10, 1.0), ("a", "y", 10, 2.0), ("a", "x", 20, 3.0), ("a", "x", 30, 4.0),
    ("b", "y", 100, 5.0), ("b", "x", 50, None), ("b", "w", 70, 4.0),
    ("c", "x", 1, 1.0), ("c", "v", 2, 2.0),  # 2 interactions: dropped
    ("d", "y", 7, 3.0),  # 1 interaction: dropped
]
SEQUENCE_SCHEMA = ("user_id string, items array<int>, timestamps array<bigint>, ratings array<float>, "
                   "length int, valid_item int, valid_timestamp bigint, valid_rating float, test_item int, test_timestamp bigint, "
                   "num_interactions int")


@pytest.fixture(scope="module")
def tiny(spark):
    return spark.createDataFrame(TINY, CANONICAL_SCHEMA)


@pytest.fixture(scope="module")
def movielens(spark, movielens_dir):
    return read_interactions(spark, movielens_dir / "ratings.parquet").cache()


def test_vocab_by_count_then_name(spark, tiny):
    expected = spark.createDataFrame(
        [("x", 1, 4), ("y", 2, 3), ("w", 3, 2), ("v", 4, 1), ("z", 5, 1)], "raw_item string, item_id int, count bigint")
    assertDataFrameEqual(build_item_vocab(tiny), expected)


def test_vocab_ranks_across_prefix_buckets(spark):
    # Same count, names sharing and not sharing 2-char prefixes: ids must follow full-name order.
    names = ["b", "ab", "aab", "aa", "a", "abc", "ba", "c"]
    df = spark.createDataFrame([("u", n, 1, None) for n in names] + [("u", "zz", 2, None)] * 2, CANONICAL_SCHEMA)
    got = build_item_vocab(df).orderBy("item_id").select("raw_item").collect()
    assert [r[0] for r in got] == ["zz"] + sorted(names)


@pytest.mark.parametrize("via_vocab", [True, False], ids=["apply_item_vocab", "implicit-vocab"])
def test_tiny_sequences_exact(spark, tiny, via_vocab):
    inter = apply_item_vocab(tiny, build_item_vocab(tiny)) if via_vocab else tiny
    got = build_sequences(inter, max_seq_len=2)
    assert tuple(got.columns) == SEQUENCE_COLUMNS
    expected = spark.createDataFrame([
        # a: z5@5, y2@10, w3@10, x1@20, x1@30 -> history [z, y, w] truncated to the last 2.
        ("a", [2, 3], [10, 10], [2.0, 1.0], 2, 1, 20, 3.0, 1, 30, 5),
        # b: x1@50 (no rating), w3@70, y2@100.
        ("b", [1], [50], [None], 1, 3, 70, 4.0, 2, 100, 3),
    ], SEQUENCE_SCHEMA)
    assertDataFrameEqual(got, expected, checkRowOrder=False)


def test_tiny_counts_dropped_and_truncated(spark, tiny):
    stats = sequence_stats(build_sequences(tiny, max_seq_len=2), tiny)
    assert stats["users"] == 2
    assert stats["users_truncated"] == 1
    assert stats["users_dropped_short"] == 2
    assert stats["interactions_dropped_short"] == 3
    assert stats["interactions"] + stats["interactions_dropped_short"] == len(TINY)
    dropped = dropped_short_users(tiny)
    assertDataFrameEqual(dropped, spark.createDataFrame([("c", 2), ("d", 1)], "user_id string, num_interactions int"))
    # With room for the whole history nothing is truncated.
    assert sequence_stats(build_sequences(tiny, max_seq_len=3))["users_truncated"] == 0


def test_bad_max_seq_len(tiny):
    with pytest.raises(InputError, match="max_seq_len"):
        build_sequences(tiny, 0)


def test_movielens_sequences_account_for_every_interaction(movielens):
    vocab = build_item_vocab(movielens)
    v = vocab.agg(F.count(F.lit(1)).alias("n"), F.min("item_id").alias("lo"), F.max("item_id").alias("hi"),
                  F.countDistinct("item_id").alias("distinct"), F.sum("count").alias("total")).first()
    assert (v["n"], v["lo"], v["hi"], v["distinct"], v["total"]) == (1682, 1, 1682, 1682, 100000)

    seqs = build_sequences(apply_item_vocab(movielens, vocab), max_seq_len=1024)
    s = seqs.agg(
        F.count(F.lit(1)).alias("users"),
        F.sum(F.col("length") + 2).alias("accounted"),
        F.sum((F.col("length") != F.col("num_interactions") - 2).cast("int")).alias("length_mismatch"),
        F.sum((F.size("timestamps") != F.col("length")).cast("int") + (F.size("ratings") != F.col("length")).cast("int"))
        .alias("misaligned"),
        # Chronological: the last training event is no later than valid, valid no later than test.
        F.sum((F.element_at("timestamps", -1) > F.col("valid_timestamp")).cast("int")
              + (F.col("valid_timestamp") > F.col("test_timestamp")).cast("int")).alias("out_of_order"),
        F.sum(F.expr("size(filter(items, i -> i < 1 or i > 1682))")).alias("ids_out_of_range"),
        F.sum(F.expr("aggregate(ratings, 0, (acc, r) -> acc + if(r is null, 1, 0))")).alias("null_ratings"),
    ).first()
    assert s["users"] == 943
    assert s["accounted"] == 100000
    assert (s["length_mismatch"], s["misaligned"], s["out_of_order"], s["ids_out_of_range"], s["null_ratings"]) \
        == (0, 0, 0, 0, 0)
    stats = sequence_stats(seqs, movielens)
    assert (stats["users_truncated"], stats["users_dropped_short"]) == (0, 0)
    assert (stats["length_min"], stats["length_max"]) == (18, 735)


def test_movielens_truncation(movielens):
    stats = sequence_stats(build_sequences(movielens, max_seq_len=50))
    assert stats["length_max"] == 50
    assert stats["interactions"] == 100000
    assert 0 < stats["users_truncated"] < 943


def test_duplicated_last_event_leaks_the_test_target_unless_dropped(spark, tiny):
    """Why prepare drops duplicate interactions: a user's last event logged twice makes the
    validation target equal the test target (the answer sits in the history)."""
    from freescale.prepare.ingest import drop_duplicate_interactions

    last = [r for r in TINY if r[0] == "b" and r[2] == 100]
    doubled = tiny.unionByName(spark.createDataFrame(last, CANONICAL_SCHEMA))
    leaked = build_sequences(doubled, 10).where("user_id = 'b'").first()
    assert leaked["valid_item"] == leaked["test_item"]
    clean = build_sequences(drop_duplicate_interactions(doubled), 10)
    assertDataFrameEqual(clean, build_sequences(tiny, 10))
