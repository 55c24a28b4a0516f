"""Spark transforms that turn costed samples into a shard plan: shuffle, cut into windows, plan
each window on the executors, and the per-step loads the manifest records.

Every function is DataFrame -> DataFrame over a ``BalanceSpec`` (freescale/shards/balance_spec.py, shipped to
the executors inside the UDF closure); freescale/shards/spark_balance.py wires them together.
pyspark, pandas and numpy are imported inside the functions: ``shards`` stays importable with
the standard library and pyarrow alone (the trainer reads the format without Spark).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame
    from pyspark.sql import types as T

    from freescale.shards.balance_spec import BalanceSpec

ASSIGNMENT_COLUMNS = ("user_id", "step", "rank", "slot", "origin_step")
"""A plan's rows: which sample goes to which (step, rank, slot), and the step it was drawn for."""


def assignment_schema() -> T.StructType:
    from pyspark.sql import types as T

    return T.StructType([
        T.StructField("user_id", T.StringType(), False),
        T.StructField("step", T.LongType(), False),
        T.StructField("rank", T.IntegerType(), False),
        T.StructField("slot", T.IntegerType(), False),
        T.StructField("origin_step", T.LongType(), False),
    ])


def with_global_position(samples: DataFrame, seed: int) -> DataFrame:
    """Add `position`: a seeded random permutation 0..N-1 of the samples, computed without a driver collect.

    The sort key is a hash of (user_id, seed), so the order does not depend on how
    the input happens to be partitioned. Positions are the per-partition row index
    plus the row count of all earlier partitions (a tiny collect of P counts).
    """
    from pyspark.sql import functions as F

    from freescale.runtime.session import checkpoint

    spark = samples.sparkSession
    keyed = samples.withColumn("_key", F.xxhash64(F.col("user_id"), F.lit(seed)))
    num_parts = max(1, spark.sparkContext.defaultParallelism)
    ordered = checkpoint(keyed.repartitionByRange(num_parts, "_key", "user_id")
                         .sortWithinPartitions("_key", "user_id")
                         .withColumn("_part", F.spark_partition_id())
                         # monotonically_increasing_id keeps the row index within its partition in the low 33 bits
                         .withColumn("_row", F.monotonically_increasing_id().bitwiseAND(F.lit((1 << 33) - 1))))
    counts = dict(ordered.groupBy("_part").count().collect())
    offsets, running = [], 0
    for part in range(max(counts, default=-1) + 1):
        offsets.append(running)
        running += counts.get(part, 0)
    offset_of = F.element_at(F.array(*[F.lit(o).cast("long") for o in offsets] or [F.lit(0).cast("long")]),
                             F.col("_part") + 1)
    return ordered.withColumn("position", offset_of + F.col("_row")).drop("_key", "_part", "_row")


def apply_leftover_policy(positioned: DataFrame, num_samples: int, global_batch_size: int,
                          policy: str) -> DataFrame:
    """`drop`: the last partial global batch (random samples, by position) is left out.
    `keep`: it becomes a short last step, split over the ranks as the strategy splits any step."""
    from pyspark.sql import functions as F

    from freescale.balancing.types import LEFTOVER_POLICIES

    if policy not in LEFTOVER_POLICIES:
        raise ValueError(f"leftover policy {policy!r}: expected one of {', '.join(LEFTOVER_POLICIES)}")
    if policy == "keep":
        return positioned
    kept = (num_samples // global_batch_size) * global_batch_size
    return positioned.where(F.col("position") < kept)


def plan_windows(positioned: DataFrame, spec: BalanceSpec) -> DataFrame:
    """(user_id, position, cost, length) -> (user_id, step, rank, slot, origin_step), one plan per window.

    Windows are planned in parallel on the executors (grouped pandas UDF), each with
    ``spec.plan_options(window)``.
    """
    from pyspark.sql import functions as F

    windowed = positioned.select(
        "user_id", "cost", "length", "position",
        (F.col("position") / F.lit(spec.window_size)).cast("long").alias("window"))

    def plan_one_window(frame: pd.DataFrame) -> pd.DataFrame:
        import numpy as np
        import pandas as pd

        from freescale.balancing import plan

        frame = frame.sort_values("position", kind="stable")
        window = int(frame["window"].iloc[0])
        result = plan(frame["cost"].to_numpy(np.float64), spec.world_size, spec.local_batch_size,
                      spec.plan_options(window), lengths=frame["length"].to_numpy(np.int64))
        first_step = window * spec.window_steps
        local_index = np.arange(len(frame))
        out = pd.DataFrame({
            "user_id": frame["user_id"].to_numpy(),
            "step": first_step + result.step.astype(np.int64),
            "rank": result.rank.astype(np.int32),
            "origin_step": first_step + local_index // spec.global_batch_size,
        })
        # Within a (step, rank) keep the shuffled order: the slot is the sample's rank in it.
        out["slot"] = out.groupby(["step", "rank"], sort=False).cumcount().astype(np.int32)
        return out[list(ASSIGNMENT_COLUMNS)]

    return windowed.groupBy("window").applyInPandas(plan_one_window, schema=assignment_schema())


def contiguous_assignment(positioned: DataFrame, spec: BalanceSpec) -> DataFrame:
    """The baseline (next B samples per rank, in shuffled order) as an assignment frame."""
    from pyspark.sql import functions as F

    g, b = spec.global_batch_size, spec.local_batch_size
    step = (F.col("position") / F.lit(g)).cast("long")
    within = F.col("position") - step * F.lit(g)
    return positioned.select(
        "user_id", step.alias("step"), (within / F.lit(b)).cast("int").alias("rank"),
        (within % F.lit(b)).cast("int").alias("slot"), step.alias("origin_step"))


def mirror_assignment(positioned: DataFrame, spec: BalanceSpec, num_steps: int) -> DataFrame:
    """Diagnostic control: step s gives every rank the same B samples (positions s*B .. s*B+B-1).

    Ranks then do identical work each step, so the bubble it measures is the noise
    floor of the machine. Samples are replicated across ranks on purpose.
    """
    from pyspark.sql import functions as F

    spark = positioned.sparkSession
    b = spec.local_batch_size
    step = (F.col("position") / F.lit(b)).cast("long")
    chosen = positioned.where(F.col("position") < num_steps * b).select(
        "user_id", step.alias("step"), (F.col("position") % F.lit(b)).cast("int").alias("slot"))
    ranks = spark.range(spec.world_size).select(F.col("id").cast("int").alias("rank"))
    return chosen.crossJoin(ranks).select("user_id", "step", "rank", "slot", F.col("step").alias("origin_step"))


def step_loads(assignment: DataFrame, costs: DataFrame, spec: BalanceSpec) -> DataFrame:
    """Per step: largest rank time, mean rank time, sample count (tiny: one row per step).

    Rank time is load / capacity (capacities normalised to mean 1), so a slower rank
    given less work counts as balanced.
    """
    import numpy as np
    from pyspark.sql import functions as F

    k = spec.world_size
    caps = np.ones(k) if spec.capacities is None else np.asarray(spec.capacities, dtype=np.float64)
    caps = caps / caps.mean()
    cap_of = F.element_at(F.array(*[F.lit(float(c)) for c in caps]), F.col("rank") + 1)
    per_rank = (assignment.join(costs, "user_id")
                .groupBy("step", "rank")
                .agg(F.sum("cost").alias("load"), F.count(F.lit(1)).alias("samples")))
    return (per_rank.withColumn("time", F.col("load") / cap_of)
            .groupBy("step")
            .agg(F.max("time").alias("max_time"),
                 (F.sum("load") / F.lit(float(caps.sum()))).alias("mean_time"),
                 F.sum("samples").alias("samples"))
            .orderBy("step"))


def bubble_of(step_table: pd.DataFrame) -> float:
    """The predicted bubble of a ``step_loads`` table (the fraction of rank-time spent idle)."""
    from freescale.balancing.metrics import bubble_of_totals

    return bubble_of_totals(float(step_table["mean_time"].sum()), float(step_table["max_time"].sum()))

