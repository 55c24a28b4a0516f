"""Synthetic interactions: determinism across layouts, heavy tails, valid values."""
from __future__ import annotations

import pytest
from pyspark.sql import Window
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual, assertSchemaEqual

from runtime.errors import InputError
from pipeline.ingest import CANONICAL_SCHEMA
from pipeline.synthetic import DEFAULTS, synthetic_interactions

NUM_ITEMS = 1000


@pytest.fixture(scope="module")
def sample(spark):
    """5000 users at the default distributions (~450k events), computed once."""
    return synthetic_interactions(spark, 5000, NUM_ITEMS, seed=7, partitions=4).cache()


def fingerprint(df):
    """Order-independent content hash, so large outputs are compared without collecting."""
    return df.agg(F.sum(F.xxhash64(*df.columns) % (1 << 40)).alias("h"), F.count(F.lit(1)).alias("n")).first()


def test_same_seed_same_rows_for_any_partitioning(spark):
    one = synthetic_interactions(spark, 60, 200, seed=3, partitions=1)
    many = synthetic_interactions(spark, 60, 200, seed=3, partitions=7)
    assert many.rdd.getNumPartitions() == 7
    assertDataFrameEqual(one, many)


def test_seeds_differ(spark):
    a = fingerprint(synthetic_interactions(spark, 200, 500, seed=1))
    b = fingerprint(synthetic_interactions(spark, 200, 500, seed=2))
    assert a != b
    assert a == fingerprint(synthetic_interactions(spark, 200, 500, seed=1, partitions=3))


def test_schema_and_value_ranges(sample):
    assertSchemaEqual(sample.schema, CANONICAL_SCHEMA)
    s = sample.agg(
        F.countDistinct("user_id").alias("users"),
        F.min(F.col("item").cast("int")).alias("item_lo"), F.max(F.col("item").cast("int")).alias("item_hi"),
        F.min("rating").alias("r_lo"), F.max("rating").alias("r_hi"),
        F.countDistinct("rating").alias("r_levels"),
        F.min("timestamp").alias("t_lo"),
        F.sum(F.col("item").isNull().cast("int") + F.col("timestamp").isNull().cast("int")).alias("nulls"),
    ).first()
    assert s["users"] == 5000
    assert 1 <= s["item_lo"] and s["item_hi"] <= NUM_ITEMS
    assert (s["r_lo"], s["r_hi"], s["r_levels"]) == (1.0, 5.0, 5)
    assert s["t_lo"] >= DEFAULTS.start_ts and s["nulls"] == 0


def test_lengths_heavy_tailed_within_bounds(sample):
    lengths = sample.groupBy("user_id").count()
    s = lengths.agg(F.min("count").alias("lo"), F.max("count").alias("hi"),
                    F.percentile_approx("count", 0.5, 10000).alias("p50"),
                    F.percentile_approx("count", 0.99, 10000).alias("p99")).first()
    assert DEFAULTS.min_len <= s["lo"] and s["hi"] <= DEFAULTS.max_len
    assert 55 <= s["p50"] <= 80  # median exp(4.2) ~ 67, like MovieLens-100K's 65
    assert s["p99"] / s["p50"] > 3
    assert s["lo"] == DEFAULTS.min_len  # the clip is reached: ~8% of users fall below 20


def test_length_clip_is_respected(spark):
    df = synthetic_interactions(spark, 300, 50, min_len=5, max_len=12, sigma=2.0)
    s = df.groupBy("user_id").count().agg(F.min("count").alias("lo"), F.max("count").alias("hi")).first()
    assert (s["lo"], s["hi"]) == (5, 12)


def test_item_popularity_skewed(sample):
    per_item = sample.groupBy("item").count()
    top = per_item.orderBy(F.desc("count")).limit(NUM_ITEMS // 100).agg(F.sum("count")).first()[0]
    total, distinct = per_item.agg(F.sum("count"), F.count(F.lit(1))).first()
    # Continuous Zipf(1.1) on [1, 1001): P(rank <= 10) ~ 0.43; uniform would give 0.01.
    assert top / total > 0.3
    assert distinct > NUM_ITEMS * 0.9  # the tail is still sampled
    rank1 = per_item.where(F.col("item") == "1").first()["count"]
    assert rank1 == per_item.agg(F.max("count")).first()[0]


def test_timestamps_strictly_increasing_per_user(sample):
    w = Window.partitionBy("user_id").orderBy("timestamp")
    dup = sample.groupBy("user_id", "timestamp").count().where("count > 1").count()
    gaps = sample.withColumn("gap", F.col("timestamp") - F.lag("timestamp").over(w)).agg(F.min("gap")).first()[0]
    assert dup == 0 and gaps >= 1


@pytest.mark.parametrize("kwargs", [
    {"num_users": 0}, {"num_items": 0}, {"min_len": 0}, {"min_len": 30, "max_len": 20},
    {"sigma": -1.0}, {"zipf_alpha": 0.0},
])
def test_bad_parameters(spark, kwargs):
    args = {"num_users": 10, "num_items": 10, **kwargs}
    with pytest.raises(InputError):
        synthetic_interactions(spark, **args)
