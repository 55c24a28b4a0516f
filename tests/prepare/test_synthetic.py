"""Synthetic interactions: determinism across layouts, heavy tails, valid values; the opt-in taste
groups (a user's items concentrate on its group's slice of the catalog; off, the rows are the old ones)."""
from __future__ import annotations

import hashlib

import pytest
from pyspark.sql import Window
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual, assertSchemaEqual

from freescale.runtime.errors import InputError
from freescale.prepare.ingest import CANONICAL_SCHEMA
from freescale.prepare.synthetic import DEFAULTS, synthetic_interactions

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
    {"sigma": -1.0}, {"zipf_alpha": 0.0}, {"taste_groups": -1}, {"taste_share": -0.1},
    {"taste_groups": 4, "taste_share": 1.5},
])
def test_bad_parameters(spark, kwargs):
    args = {"num_users": 10, "num_items": 10, **kwargs}
    with pytest.raises(InputError):
        synthetic_interactions(spark, **args)


# ------------------------------------------------------------------ taste groups (opt-in)

def digest(df) -> tuple[str, int]:
    """sha256 of the sorted rows, and their count: pins a small output exactly."""
    rows = sorted((r.user_id, r.item, r.timestamp, r.rating) for r in df.collect())
    return hashlib.sha256(repr(rows).encode()).hexdigest(), len(rows)


# Computed from the generator before taste groups existed (commit a92c27c): the default rows must not move.
PINNED_DEFAULT = ("9de900db9d07c21beeafcefb1d3b41ec5651577080c2abcdaffe907f204dd2f4", 4233)


def test_without_groups_the_rows_are_the_ones_before_groups_existed(spark):
    assert digest(synthetic_interactions(spark, 40, 300, seed=5, partitions=3)) == PINNED_DEFAULT
    # groups off whatever the share; a share of 0 draws nothing from the groups: the same rows again
    assert digest(synthetic_interactions(spark, 40, 300, seed=5, taste_share=0.3)) == PINNED_DEFAULT
    assert digest(synthetic_interactions(spark, 40, 300, seed=5, taste_groups=6, taste_share=0.0)) == PINNED_DEFAULT
    assert digest(synthetic_interactions(spark, 40, 300, seed=5, taste_groups=6)) != PINNED_DEFAULT


def test_groups_give_the_same_rows_for_any_partitioning(spark):
    one = synthetic_interactions(spark, 60, 200, seed=3, taste_groups=5, partitions=1)
    many = synthetic_interactions(spark, 60, 200, seed=3, taste_groups=5, partitions=7)
    assert many.rdd.getNumPartitions() == 7
    assertDataFrameEqual(one, many)


def group_heads(df, groups: int, num_items: int):
    """Per user: the share of its events in each group's head (the first half of its slice, from the
    documented offset ``(g + 1) * num_items // (groups + 1)``), best group first."""
    width = num_items // (2 * (groups + 1))
    item = F.col("item").cast("long")
    shares = [F.avg(((item > off) & (item <= off + width)).cast("double")).alias(f"g{g}")
              for g, off in enumerate((g + 1) * num_items // (groups + 1) for g in range(groups))]
    per_user = df.groupBy("user_id").agg(*shares).toPandas().set_index("user_id")
    return per_user.max(axis=1), per_user.idxmax(axis=1)


def test_with_groups_a_users_items_concentrate_on_its_groups_slice(spark):
    groups, num_items = 8, 2000
    best, which = group_heads(synthetic_interactions(spark, 400, num_items, seed=11, taste_groups=groups),
                              groups, num_items)
    # ~80% of a user's events come from its group, ~71% of those in the head half of its slice (Zipf(1.1)
    # over 2,000 items): ~57%.
    assert 0.5 < best.median() < 0.65 and (best > 0.3).mean() > 0.95
    assert which.value_counts().min() > 400 / groups / 2  # every group has its users
    # Without groups the same windows are mid-catalog and nearly empty: a few percent (short histories more).
    chance, _ = group_heads(synthetic_interactions(spark, 400, num_items, seed=11), groups, num_items)
    assert chance.median() < 0.08 and chance.max() < 0.3


def hit_rates(df) -> tuple[float, float]:
    """Share of each user's last 20% of events among (its own 10 most frequent items in its first 80%,
    the 10 most frequent items overall): a personal history against global popularity."""
    w = Window.partitionBy("user_id")
    ranked = df.withColumn("k", F.percent_rank().over(w.orderBy("timestamp")))
    early, late = ranked.where("k < 0.8"), ranked.where("k >= 0.8")
    own = early.groupBy("user_id", "item").count().withColumn(
        "r", F.row_number().over(w.orderBy(F.desc("count"), "item"))).where("r <= 10").select("user_id", "item")
    popular = [r["item"] for r in df.groupBy("item").count().orderBy(F.desc("count"), "item").limit(10).collect()]
    total = late.count()
    return (late.join(own, ["user_id", "item"]).count() / total,
            late.where(F.col("item").isin(popular)).count() / total)


def test_with_groups_a_users_history_beats_global_popularity(spark):
    """What the demo needs: with groups a user's own past predicts its next items better than the most
    popular items do; without them (one global law) popularity is the better guess."""
    own, popular = hit_rates(synthetic_interactions(spark, 400, 2000, seed=11, taste_groups=8))
    assert own > 1.5 * popular, (own, popular)
    own, popular = hit_rates(synthetic_interactions(spark, 400, 2000, seed=11))
    assert own < popular, (own, popular)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--synthetic-groups", "-1"], "--synthetic-groups must be >= 0 (0: none), got -1"),
    (["--synthetic-group-share", "1.5"], "--synthetic-group-share must be in [0, 1], got 1.5"),
])
def test_prepare_refuses_bad_group_settings_in_one_line(tmp_path, capsys, argv, fragment):
    from freescale.jobs import prepare

    assert prepare.main(["--output", str(tmp_path / "out"), *argv, "--tracking-uri", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"freescale prepare: error: {fragment}"), err


def test_prepare_defaults_are_the_generators():
    from freescale.prepare.prepare_spec import PrepareSpec
    from freescale.runtime.options import default_of

    assert default_of(PrepareSpec, "synthetic_groups") == DEFAULTS.taste_groups == 0
    assert default_of(PrepareSpec, "synthetic_group_share") == DEFAULTS.taste_share
