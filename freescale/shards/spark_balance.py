"""The balance job's Spark work over a ``BalanceSpec``: prepared sequences -> costed samples -> a plan
-> per-rank Parquet shards and their manifest. freescale/jobs/balance.py parses, opens the run, calls
:func:`plan_shards` and :func:`write_shard_set` inside its atomic output, and reports.

The transforms themselves (shuffle, windows, per-window planning, step loads) are
freescale/shards/spark_plan.py's. pyspark is imported inside the functions, as there.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from freescale.runtime.errors import InputError, one_line
from freescale.prepare.prepared import SEQUENCES_DIR
from freescale.shards.balance_spec import BalanceSpec

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame

    from freescale.costs.cost_model import CostModel
    from freescale.shards.manifest import Manifest

REQUIRED_COLUMNS = ("user_id", "items", "length")
ROW_GROUP_BYTES = 4 << 20  # small row groups: the trainer streams a shard one row group at a time


def check_local_input(spec: BalanceSpec) -> None:
    """Before Spark starts (a remote input is read_sequences' to check): a local --input is a prepare
    output or a sequences Parquet with REQUIRED_COLUMNS in every file's footer."""
    from freescale.prepare import preflight
    from freescale.runtime import paths

    local = paths.local_path(spec.input)
    if local is None:
        return
    prepared = Path(local) / SEQUENCES_DIR
    path = f"{spec.input.rstrip('/')}/{SEQUENCES_DIR}" if prepared.exists() else spec.input
    preflight.check_parquet_columns(path, REQUIRED_COLUMNS, "input ",
                                    "expected the output of `freescale prepare` (holds sequences/) "
                                    "or a sequences Parquet; run `freescale prepare` first")


def read_sequences(spark, fs, input_uri: str) -> tuple[str, DataFrame]:
    """The prepared sequences: `<input>/sequences` (a prepare output) or a sequences Parquet directly."""
    if not fs.exists(input_uri):
        raise InputError(f"input {input_uri} does not exist")
    path = f"{input_uri}/{SEQUENCES_DIR}" if fs.exists(f"{input_uri}/{SEQUENCES_DIR}") else input_uri
    try:
        frame = spark.read.parquet(path)
    except Exception as exc:  # noqa: BLE001 - Spark raises several types for unreadable input
        raise InputError(f"input {path} is not readable Parquet: {one_line(exc)}") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise InputError(f"input {path} lacks column {missing[0]!r} (has {', '.join(frame.columns)}); "
                         "run `freescale prepare` first")
    return path, frame


def prepared_metadata(fs, input_uri: str, sequences: DataFrame, sequences_path: str) -> dict:
    """`prepare.json` of a prepare output ({} for a bare sequences Parquet); it must list the user
    features when the sequences carry them (the manifest and the model take the list from it)."""
    from freescale.prepare.prepared import METADATA_NAME, parse_metadata

    meta_path = f"{input_uri}/{METADATA_NAME}"
    prepared = parse_metadata(fs.read_text(meta_path), meta_path) if fs.exists(meta_path) else {}
    if "user_features" in sequences.columns and not prepared.get("user_features"):
        raise InputError(f"input {sequences_path} has a user_features column but {meta_path} "
                         "does not list the features; rerun `freescale prepare`")
    return prepared


def check_sample_count(num_samples: int, spec: BalanceSpec, sequences_path: str) -> None:
    """Enough samples for one global batch (unless a short last step is kept), and one per rank."""
    g = spec.global_batch_size
    if num_samples == 0:
        raise InputError(f"input {sequences_path} has no samples")
    if num_samples < g and spec.leftover_applied == "drop":
        raise InputError(f"input {sequences_path} has {num_samples} samples, fewer than one global batch "
                         f"(world size {spec.world_size} x local batch {spec.local_batch_size} = {g})")
    if num_samples < spec.world_size:
        # Every rank must hold samples: the trainer refuses an empty rank shard.
        raise InputError(f"input {sequences_path} has {num_samples} samples for --world-size {spec.world_size}: "
                         f"{spec.world_size - num_samples} ranks would get none")


def check_token_cap(costs: DataFrame, token_cap: int | None) -> None:
    """No single history may be longer than the per-rank token cap: no rank could hold it."""
    from pyspark.sql import functions as F

    if token_cap is None:
        return
    longest = costs.orderBy(F.col("length").desc(), "user_id").select("user_id", "length").first()
    if longest["length"] > token_cap:
        raise InputError(f"--token-cap {token_cap} is below the history of user {longest['user_id']} "
                         f"({longest['length']} items): no rank can hold it")


def assign_samples(positioned: DataFrame, spec: BalanceSpec, num_samples: int) -> tuple[DataFrame, DataFrame, float]:
    """Each sample's (step, rank, slot): the mirror control, or the strategy's plan of every window
    after the leftover policy. Returns the assignment (checkpointed: it is read several times),
    the samples it plans, and the planning time in seconds."""
    from pyspark.sql import functions as F

    from freescale.runtime.session import checkpoint
    from freescale.shards import spark_plan

    started = time.perf_counter()
    if spec.control == "mirror":
        num_steps = num_samples // spec.global_batch_size
        assignment = spark_plan.mirror_assignment(positioned, spec, num_steps)
        planned = positioned.where(F.col("position") < num_steps * spec.local_batch_size)
    else:
        planned = spark_plan.apply_leftover_policy(positioned, num_samples, spec.global_batch_size, spec.leftover)
        assignment = spark_plan.plan_windows(planned, spec)
    assignment = checkpoint(assignment)
    return assignment, planned, time.perf_counter() - started


def count_assignment(assignment: DataFrame, planned: DataFrame, spec: BalanceSpec) -> tuple[dict, int]:
    """The plan's rows, users, steps and samples moved between steps, checked against the planned
    samples (each once, or once per rank for the mirror control); and the planned sample count."""
    from pyspark.sql import functions as F

    counts = assignment.agg(F.count(F.lit(1)).alias("rows"), F.countDistinct("user_id").alias("users"),
                            F.max("step").alias("last_step"),
                            F.sum((F.col("step") != F.col("origin_step")).cast("long")).alias("moved")).first()
    planned_samples = planned.count()
    expected_rows = planned_samples * (spec.world_size if spec.control else 1)
    if counts["rows"] != expected_rows or counts["users"] != planned_samples:
        raise RuntimeError(f"plan lost or duplicated samples: {counts['rows']} rows for {planned_samples} samples")
    return counts.asDict(), planned_samples


def plan_statistics(assignment: DataFrame, planned: DataFrame, costs: DataFrame, spec: BalanceSpec,
                    sequences_path: str, plan_seconds: float) -> tuple[pd.DataFrame, dict, dict]:
    """Per-step loads (the plan's and the contiguous baseline's), the manifest's stats (predicted
    bubbles, imbalance), and per-rank tokens and cost; refuses a plan that leaves a rank empty or
    a cost model that gives zero total cost."""
    from pyspark.sql import functions as F

    from freescale.shards import spark_plan

    step_table = spark_plan.step_loads(assignment, costs, spec).toPandas()
    baseline = spark_plan.contiguous_assignment(planned, spec) if not spec.control else assignment
    baseline_table = spark_plan.step_loads(baseline, costs, spec).toPandas()
    imbalance = step_table["max_time"] / step_table["mean_time"] - 1.0
    rank_totals = {int(r["rank"]): {"tokens": r["tokens"], "cost": r["cost"]} for r in (
        assignment.join(costs, "user_id").groupBy("rank")
        .agg(F.sum("length").alias("tokens"), F.sum("cost").alias("cost")).collect())}
    empty = sorted(set(range(spec.world_size)) - set(rank_totals))
    if empty:
        raise InputError(f"the {spec.strategy} plan of {sequences_path} leaves {len(empty)} of {spec.world_size} ranks "
                         f"without samples (first: rank {empty[0]}); use fewer ranks or --equal-counts")
    total_cost = sum(t["cost"] for t in rank_totals.values())
    if not math.isfinite(total_cost) or total_cost <= 0:
        raise InputError(f"the cost model gives {sequences_path} a total cost of {total_cost}: "
                         "nothing to balance (check --cost-model)")
    stats = {
        "bubble": spark_plan.bubble_of(step_table),
        "bubble_contiguous": spark_plan.bubble_of(baseline_table),
        "imbalance_mean": float(imbalance.mean()),
        "imbalance_p50": float(imbalance.median()),
        "imbalance_p95": float(imbalance.quantile(0.95)),
        "imbalance_max": float(imbalance.max()),
        "plan_seconds": plan_seconds,
    }
    return step_table, stats, rank_totals


def shard_rows(sequences: DataFrame, assignment: DataFrame, costs: DataFrame, model: CostModel) -> DataFrame:
    """The sequences with their (step, rank, slot), cost and the step's target count: ``rank`` plus
    the shard format's columns (``freescale.shards.schema``), in its order and cast to its types, so
    the files hold exactly what the reader expects whatever the input's integer widths."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import from_arrow_type

    from freescale.costs.cost_model import cost_column
    from freescale.shards.schema import COLUMNS

    # Next-item targets per step over all ranks: the trainer divides each rank's loss
    # sum by it, so every plan weights every target the same.
    step_targets = (assignment.join(costs, "user_id").groupBy("step")
                    .agg(F.sum(F.col("length") - 1).alias("step_targets")))
    rows = (sequences.join(assignment, "user_id")
            .join(F.broadcast(step_targets), "step")
            .withColumn("cost", cost_column(model, "length")))
    missing = [c.name for c in COLUMNS if not c.optional and c.name not in rows.columns]
    if missing:
        raise RuntimeError(f"balance job bug: shard rows lack columns {missing}")
    return rows.select("rank", *[F.col(c.name).cast(from_arrow_type(c.type)).alias(c.name)
                                 for c in COLUMNS if c.name in rows.columns])


def write_shards(spark, fs, staging: str, rows: DataFrame, step_table: pd.DataFrame, world_size: int) -> list[dict]:
    """Each rank's rows in step order under rank=<k>/, the per-step loads, and every written file's
    description (size, SHA-256, rows, path relative to the output) for the manifest."""
    from freescale.shards.file_stats import describe_files, relative_to
    from freescale.shards.schema import STEP_STATS_DIR, rank_dir

    (rows.repartition(min(world_size, 256), "rank")
     .sortWithinPartitions("rank", "step", "slot")
     .write.option("parquet.block.size", ROW_GROUP_BYTES)
     .partitionBy("rank").parquet(staging))
    spark.createDataFrame(step_table).coalesce(1).write.parquet(f"{staging}/{STEP_STATS_DIR}")
    uris = []
    for rank in range(world_size):
        if fs.exists(directory := f"{staging}/{rank_dir(rank)}"):
            uris.extend(fs.list_files(directory, ".parquet"))
    return [{**d, "path": relative_to(staging, d["uri"])} for d in describe_files(spark, uris)]


# ------------------------------------------------------------------ the job's two steps


@dataclass
class PlannedShards:
    """A shard set planned and not yet written: what its manifest, its run and the job's line say."""

    input_uri: str
    prepared: dict
    rows: DataFrame
    step_table: pd.DataFrame
    stats: dict[str, float]
    rank_totals: dict[int, dict[str, Any]]
    num_samples: int
    """Samples in the input."""
    planned_samples: int
    """Samples in the plan (the input less the dropped leftover)."""
    num_rows: int
    num_steps: int
    moved_samples: int

    @property
    def leftover(self) -> int:
        return self.num_samples - self.planned_samples


def plan_shards(spark, fs, spec: BalanceSpec, model: CostModel, input_uri: str) -> PlannedShards:
    """Read and cost the samples, shuffle them with the seed, plan every window (or the mirror control)
    and measure the plan; refuses input that cannot make the shard set asked for."""
    from freescale.costs.cost_model import cost_column
    from freescale.shards import spark_plan

    sequences_path, sequences = read_sequences(spark, fs, input_uri)
    prepared = prepared_metadata(fs, input_uri, sequences, sequences_path)
    costs = sequences.select("user_id", "length", cost_column(model, "length").alias("cost"))
    positioned = spark_plan.with_global_position(costs, spec.seed)
    num_samples = positioned.count()
    check_sample_count(num_samples, spec, sequences_path)
    check_token_cap(costs, spec.token_cap)

    assignment, planned, plan_seconds = assign_samples(positioned, spec, num_samples)
    counts, planned_samples = count_assignment(assignment, planned, spec)
    step_table, stats, rank_totals = plan_statistics(assignment, planned, costs, spec, sequences_path, plan_seconds)
    return PlannedShards(input_uri=input_uri, prepared=prepared, rows=shard_rows(sequences, assignment, costs, model),
                         step_table=step_table, stats=stats, rank_totals=rank_totals, num_samples=num_samples,
                         planned_samples=planned_samples, num_rows=counts["rows"],
                         num_steps=int(counts["last_step"]) + 1, moved_samples=int(counts["moved"]))


def write_shard_set(spark, fs, staging: str, planned: PlannedShards, spec: BalanceSpec,
                    model: CostModel) -> Manifest:
    """The planned rows and step loads under ``staging``, then their manifest; the manifest."""
    from freescale.shards.manifest import UserFeature, build_rank_shards, new_manifest
    from freescale.shards.schema import MANIFEST_NAME, STEP_STATS_DIR

    files = write_shards(spark, fs, staging, planned.rows, planned.step_table, spec.world_size)
    features = tuple(UserFeature(f["name"], f["num_ids"]) for f in planned.prepared.get("user_features", []))
    manifest = new_manifest(
        ranks=build_rank_shards(files, planned.rank_totals, spec.world_size),
        world_size=spec.world_size, local_batch_size=spec.local_batch_size, global_batch_size=spec.global_batch_size,
        num_steps=planned.num_steps, window_steps=spec.window_steps, strategy=spec.strategy,
        control=spec.control, seed=spec.seed, equal_counts=spec.equal_counts, token_cap=spec.token_cap,
        capacities=list(spec.capacities) if spec.capacities else None, cost_model=model.to_json(),
        num_items=planned.prepared.get("num_items"), user_features=features,
        input={"uri": planned.input_uri, "samples": planned.num_samples},
        num_samples=planned.planned_samples, num_rows=planned.num_rows,
        leftover={"policy": spec.leftover_applied, "samples": planned.leftover},
        moved_samples=planned.moved_samples, columns=["rank", *planned.rows.columns[1:]], stats=planned.stats,
        step_stats=STEP_STATS_DIR)
    fs.write_text(f"{staging}/{MANIFEST_NAME}", manifest.dumps())
    return manifest
