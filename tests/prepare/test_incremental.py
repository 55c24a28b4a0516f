"""`prepare --previous`'s DataFrame transforms (freescale/prepare/incremental.py) on exact small cases:
yesterday's states plus today's events give what one prepare of both days gives."""
from __future__ import annotations

import pytest
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from freescale.prepare.incremental import (
    extend_feature_vocab,
    extend_item_vocab,
    merge_states,
    states_from_sequences,
    with_features,
)
from freescale.prepare.ingest import CANONICAL_SCHEMA, drop_duplicate_interactions
from freescale.prepare.sequences import (
    apply_item_vocab,
    build_item_vocab,
    build_sequences,
    events_per_user,
    states_to_sequences,
    user_states,
)

DAY1 = [
    ("a", "z", 5, None), ("a", "w", 10, 1.0), ("a", "y", 10, 2.0), ("a", "x", 20, 3.0), ("a", "x", 30, 4.0),
    ("b", "y", 100, 5.0), ("b", "x", 50, None),
    ("c", "x", 1, 1.0),  # too short for a sequence on day 1: its state still counts it
    ("e", "v", 40, 1.0), ("e", "x", 41, 1.0), ("e", "y", 42, 1.0),  # not in day 2: unchanged
]
DAY2 = [
    ("a", "v", 200, 1.0),
    ("a", "z", 1, 5.0),  # late, and older than a's kept window at max_seq_len 2: counted only
    ("b", "y", 100, 4.0),  # repeats b's day-1 event with a lower rating: dropped, 5.0 stays
    ("b", "w", 60, 2.0),  # late, inside b's history
    ("b", "q", 300, 1.0),
    ("c", "v", 150, 2.0), ("c", "w", 160, None),  # c reaches 3 interactions
    ("d", "q", 310, 3.0), ("d", "q", 310, 3.0),  # a new user with a repeat inside the new logs
]


@pytest.fixture(scope="module")
def days(spark):
    day1 = spark.createDataFrame(DAY1, CANONICAL_SCHEMA)
    day2 = spark.createDataFrame(DAY2, CANONICAL_SCHEMA)
    return day1, day2


def states_of(interactions, vocab, max_seq_len):
    return user_states(events_per_user(apply_item_vocab(interactions, vocab)), max_seq_len)


def test_states_give_the_sequences_of_the_whole_logs(days):
    max_seq_len = 2  # truncates a's history, not b's; c and e are too short
    logs = days[0].unionByName(days[1])
    vocab = build_item_vocab(logs)
    states = states_of(logs, vocab, max_seq_len)
    assert states.agg(F.max(F.size("events"))).first()[0] <= max_seq_len + 2
    assertDataFrameEqual(states_to_sequences(states, max_seq_len),
                         build_sequences(apply_item_vocab(logs, vocab), max_seq_len), checkRowOrder=False)


def test_merged_states_equal_one_prepare_of_both_days(days):
    max_seq_len = 2  # a's late event falls before its kept window
    day1, day2 = days
    both = drop_duplicate_interactions(day1.unionByName(day2))
    vocab = build_item_vocab(both)  # one vocabulary for both sides: ids compare directly
    previous = states_of(day1, vocab, max_seq_len)
    new = events_per_user(apply_item_vocab(drop_duplicate_interactions(day2), vocab))
    merged = merge_states(previous, new, max_seq_len, keep_duplicates=False)
    touched = merged.select("user_id").distinct()
    expected = states_of(both, vocab, max_seq_len).join(touched, "user_id", "left_semi")
    assertDataFrameEqual(merged.select("user_id", "events", "num_interactions"), expected, checkRowOrder=False)
    flags = {r["user_id"]: (r["returning"], r["duplicates"]) for r in merged.collect()}
    assert flags == {"a": (True, 0), "b": (True, 1), "c": (True, 0), "d": (False, 0)}
    b = merged.where("user_id = 'b'").first()
    assert [(e["item_id"], e["rating"]) for e in b["events"] if e["timestamp"] == 100] == [
        (vocab.where("raw_item = 'y'").first()["item_id"], 5.0)]
    # a's late event fell before its kept window at max_seq_len 2, yet counts.
    assert merged.where("user_id = 'a'").first()["num_interactions"] == 7


def test_keep_duplicates_keeps_the_repeat_across_days(days):
    day1, day2 = days
    vocab = build_item_vocab(day1.unionByName(day2))
    merged = merge_states(states_of(day1, vocab, 10), events_per_user(apply_item_vocab(day2, vocab)), 10,
                          keep_duplicates=True)
    b = merged.where("user_id = 'b'").first()
    assert b["num_interactions"] == 5 and b["duplicates"] == 0
    assert [e["rating"] for e in b["events"] if e["timestamp"] == 100] == [4.0, 5.0]


def test_items_keep_their_ids_and_new_ones_follow(spark, days):
    day1, day2 = days
    previous = build_item_vocab(day1)
    extended = {r["raw_item"]: (r["item_id"], r["count"]) for r in extend_item_vocab(previous, day2).collect()}
    for row in previous.collect():
        assert extended[row["raw_item"]][0] == row["item_id"]
    day2_counts = {}
    for _, item, _, _ in DAY2:
        day2_counts[item] = day2_counts.get(item, 0) + 1
    assert all(extended[r["raw_item"]][1] == r["count"] + day2_counts.get(r["raw_item"], 0)
               for r in previous.collect())
    # q is the only new item: id after the previous largest.
    assert extended["q"] == (previous.count() + 1, 3)
    assert sorted(i for i, _ in extended.values()) == list(range(1, previous.count() + 2))


def test_new_items_by_count_then_name(spark):
    previous = spark.createDataFrame([("x", 1, 5), ("y", 2, 1)], "raw_item string, item_id int, count bigint")
    rows = [("u", item, t, None) for t, item in enumerate(["n", "m", "m", "x", "b", "a"])]
    got = extend_item_vocab(previous, spark.createDataFrame(rows, CANONICAL_SCHEMA)).orderBy("item_id").collect()
    assert [(r["raw_item"], r["item_id"], r["count"]) for r in got] == [
        ("x", 1, 6), ("y", 2, 1), ("m", 3, 2), ("a", 4, 1), ("b", 5, 1), ("n", 6, 1)]


def test_feature_values_keep_their_ids(spark):
    previous = spark.createDataFrame([("g", "F", 1, 3), ("g", "M", 2, 2), ("o", "x", 1, 5)],
                                     "feature string, value string, id int, count bigint")
    users = spark.createDataFrame([("1", "M", "y"), ("2", "N", "y"), ("3", "K", None)],
                                  "user_id string, g string, o string")
    got = {(r["feature"], r["value"]): r["id"] for r in extend_feature_vocab(previous, users, ["g", "o"]).collect()}
    assert got == {("g", "F"): 1, ("g", "M"): 2, ("g", "K"): 3, ("g", "N"): 4, ("o", "x"): 1, ("o", "y"): 2}


def test_a_user_without_a_new_row_keeps_its_features(spark):
    vocab = spark.createDataFrame([("g", "F", 1, 1), ("g", "M", 2, 1)], "feature string, value string, id int, count bigint")
    states = spark.createDataFrame([("kept", [1]), ("updated", [1]), ("new", None)],
                                   "user_id string, user_features array<int>")
    users = spark.createDataFrame([("updated", "M")], "user_id string, g string")
    got = {r["user_id"]: r["user_features"] for r in with_features(states, users, vocab, ["g"]).collect()}
    assert got == {"kept": [1], "updated": [2], "new": [0]}
    got = {r["user_id"]: r["user_features"] for r in with_features(states, None, vocab, ["g"]).collect()}
    assert got == {"kept": [1], "updated": [1], "new": [0]}


def test_states_rebuilt_from_sequences_give_them_back(days):
    logs = days[0].unionByName(days[1])
    vocab = build_item_vocab(logs)
    sequences = build_sequences(apply_item_vocab(logs, vocab), 2)
    rebuilt = states_from_sequences(sequences)
    assertDataFrameEqual(states_to_sequences(rebuilt, 2), sequences, checkRowOrder=False)
    # The same events as the states, but the test target's rating, which the sequences drop.
    full = states_of(logs, vocab, 2).join(sequences.select("user_id"), "user_id", "left_semi")
    without_test_rating = F.transform("events", lambda e, i: F.when(i == F.size("events") - 1, e.withField(
        "rating", F.lit(None).cast("float"))).otherwise(e))
    assertDataFrameEqual(rebuilt, full.withColumn("events", without_test_rating), checkRowOrder=False)
