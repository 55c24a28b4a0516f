"""Balance job: prepared sequences -> cost-balanced Parquet shards, one directory per rank, plus a manifest.

    spark-submit jobs/balance.py --input PREPARED --output SHARDS --world-size K --local-batch-size B
    freescale balance ...            (same arguments, local Spark by default)

Steps: compute each sample's cost with the cost model (native Spark expressions),
shuffle with a seed, cut the shuffled order into windows of W global batches,
plan every window on the executors (balancing.plan), write each rank's samples in
step order under rank=<k>/, and record per-step imbalance, predicted bubble,
row counts and checksums in manifest.json. The output appears atomically.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file by spark-submit: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from balancing.inputs import DEFAULT_FLOP_WIDTH  # noqa: E402
from balancing.strategies import STRATEGIES, per_batch_conflict  # noqa: E402  (numpy only; OR-Tools loads when used)
from balancing.types import LEFTOVER_POLICIES  # noqa: E402
from jobs.job_errors import run_job  # noqa: E402
from jobs.tracking import add_tracking_arguments  # noqa: E402  (no mlflow import until a run opens)
from pipeline.errors import InputError, one_line  # noqa: E402

CONTROLS = ("mirror",)
REQUIRED_COLUMNS = ("user_id", "items", "length")
ROW_GROUP_BYTES = 4 << 20  # small row groups: the trainer streams a shard one row group at a time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale balance", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="output directory of `freescale prepare` (holds sequences/)")
    p.add_argument("--output", required=True, help="shard directory to create")
    p.add_argument("--world-size", type=int, required=True, help="number of training ranks K")
    p.add_argument("--local-batch-size", type=int, required=True, help="samples per rank per step B")
    p.add_argument("--strategy", choices=STRATEGIES, default="kk", help="partition strategy (default kk)")
    p.add_argument("--window-steps", type=int, default=1,
                   help="plan W global batches together so heavy samples can share steps (default 1)")
    p.add_argument("--cost-model", help="cost-model JSON (default: the built-in analytic model)")
    p.add_argument("--token-cap", type=int, help="per-rank cap on the sum of history lengths per step")
    p.add_argument("--equal-counts", action="store_true", help="every rank gets B samples (+-1) per step")
    p.add_argument("--capacities", help="relative rank speeds, comma separated, one per rank, or @FILE: "
                                        "a rank-speeds JSON written by `freescale calibrate`")
    p.add_argument("--flop-width", type=int, default=DEFAULT_FLOP_WIDTH,
                   help="the model width d in flops_kk's FLOP formula L^2 + 2.5*d*L (default %(default)s, "
                        "the HSTU embedding_dim)")
    p.add_argument("--seed", type=int, default=0, help="shuffle and tie-break seed (default 0)")
    p.add_argument("--time-limit", type=float, help="seconds per step for the ortools strategy")
    p.add_argument("--leftover", choices=LEFTOVER_POLICIES, default="drop",
                   help="the last partial global batch: drop it (default) or keep it as a short step")
    p.add_argument("--control", choices=CONTROLS,
                   help="diagnostic shards: 'mirror' gives every rank the same samples each step")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--master", help="Spark master (default: spark-submit's, else local[*])")
    add_tracking_arguments(p)
    p.add_argument("--comparison", help="the `freescale compare` this run belongs to (MLflow tag freescale.comparison)")
    return p


def parse_capacities(text: str | None, world_size: int) -> tuple[float, ...] | None:
    """``--capacities``: ``1.0,0.9`` or ``@rank_speeds.json`` (written by `freescale calibrate`)."""
    if text is None:
        return None
    if text.startswith("@"):
        from pipeline.rank_speeds import read_rank_speeds

        path = text[1:]
        values = read_rank_speeds(path)  # InputError naming the file when it is bad
        if len(values) != world_size:
            raise InputError(f"--capacities file {path} has {len(values)} capacities, --world-size is {world_size}")
        return values
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise InputError(f"--capacities {text!r}: expected {world_size} comma-separated numbers") from None
    if len(values) != world_size:
        raise InputError(f"--capacities has {len(values)} values, --world-size is {world_size}")
    bad = [v for v in values if not np.isfinite(v) or v <= 0]
    if bad:
        raise InputError(f"--capacities value {bad[0]} is not a positive number")
    return values


def validate_args(args: argparse.Namespace) -> None:
    for flag, value in (("--world-size", args.world_size), ("--local-batch-size", args.local_batch_size),
                        ("--window-steps", args.window_steps), ("--flop-width", args.flop_width)):
        if value <= 0:
            raise InputError(f"{flag} must be a positive integer, got {value}")
    conflict = per_batch_conflict(args.strategy, args.window_steps, args.token_cap)
    if conflict:
        raise InputError(conflict)
    if args.token_cap is not None and args.token_cap <= 0:
        raise InputError(f"--token-cap must be a positive integer, got {args.token_cap}")
    if args.time_limit is not None and args.time_limit <= 0:
        raise InputError(f"--time-limit must be positive, got {args.time_limit}")


def read_sequences(spark, fs, input_uri: str):
    """The prepared sequences: `<input>/sequences` (a prepare output) or a sequences Parquet directly."""
    if not fs.exists(input_uri):
        raise InputError(f"input {input_uri} does not exist")
    path = f"{input_uri}/sequences" if fs.exists(f"{input_uri}/sequences") else input_uri
    try:
        frame = spark.read.parquet(path)
    except Exception as exc:  # noqa: BLE001 - Spark raises several types for unreadable input
        raise InputError(f"input {path} is not readable Parquet: {one_line(exc)}") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise InputError(f"input {path} lacks column {missing[0]!r} (has {', '.join(frame.columns)}); "
                         "run `freescale prepare` first")
    return path, frame


def check_inputs(args: argparse.Namespace) -> None:
    """What can be checked without Spark (local paths; Spark checks remote ones in
    read_sequences): the output is not an input, --input is a prepare output or a
    sequences Parquet with REQUIRED_COLUMNS in every file's footer, and a --master
    spark://... takes connections."""
    from jobs.atomic_output import check_local_output_free, check_no_overlap
    from pipeline import paths, preflight

    preflight.check_master(args.master)
    capacities_file = args.capacities[1:] if args.capacities and args.capacities.startswith("@") else None
    check_no_overlap(args.output, {"--input": args.input, "--cost-model": args.cost_model,
                                   "--capacities": capacities_file})
    check_local_output_free(args.output, args.overwrite)
    local = paths.local_path(args.input)
    if local is None:
        return
    sequences = Path(local) / "sequences"
    path = f"{args.input.rstrip('/')}/sequences" if sequences.exists() else args.input
    preflight.check_parquet_columns(path, REQUIRED_COLUMNS, "input ",
                                    "expected the output of `freescale prepare` (holds sequences/) "
                                    "or a sequences Parquet; run `freescale prepare` first")


def prepared_metadata(fs, input_uri: str, sequences, sequences_path: str) -> dict:
    """`prepare.json` of a prepare output ({} for a bare sequences Parquet); it must list the user
    features when the sequences carry them (the manifest and the model take the list from it)."""
    meta_path = f"{input_uri}/prepare.json"
    prepared = json.loads(fs.read_text(meta_path)) if fs.exists(meta_path) else {}
    if "user_features" in sequences.columns and not prepared.get("user_features"):
        raise InputError(f"input {sequences_path} has a user_features column but {input_uri}/prepare.json "
                         "does not list the features; rerun `freescale prepare`")
    return prepared


def check_sample_count(num_samples: int, spec, args: argparse.Namespace, sequences_path: str) -> None:
    """Enough samples for one global batch (unless a short last step is kept), and one per rank."""
    g = spec.global_batch_size
    if num_samples == 0:
        raise InputError(f"input {sequences_path} has no samples")
    if num_samples < g and (args.leftover == "drop" or args.control):
        raise InputError(f"input {sequences_path} has {num_samples} samples, fewer than one global batch "
                         f"(world size {spec.world_size} x local batch {spec.local_batch_size} = {g})")
    if num_samples < spec.world_size:
        # Every rank must hold samples: the trainer refuses an empty rank shard.
        raise InputError(f"input {sequences_path} has {num_samples} samples for --world-size {spec.world_size}: "
                         f"{spec.world_size - num_samples} ranks would get none")


def check_token_cap(costs, token_cap: int | None) -> None:
    """No single history may be longer than the per-rank token cap: no rank could hold it."""
    from pyspark.sql import functions as F

    if token_cap is None:
        return
    longest = costs.orderBy(F.col("length").desc(), "user_id").select("user_id", "length").first()
    if longest["length"] > token_cap:
        raise InputError(f"--token-cap {token_cap} is below the history of user {longest['user_id']} "
                         f"({longest['length']} items): no rank can hold it")


def assign_samples(positioned, spec, args: argparse.Namespace, num_samples: int):
    """Each sample's (step, rank, slot): the mirror control, or the strategy's plan of every window
    after the leftover policy. Returns the assignment (checkpointed: it is read several times),
    the samples it plans, and the planning time in seconds."""
    from pyspark.sql import functions as F

    from pipeline.session import checkpoint
    from shards import spark_plan

    started = time.perf_counter()
    if args.control == "mirror":
        num_steps = num_samples // spec.global_batch_size
        assignment = spark_plan.mirror_assignment(positioned, spec, num_steps)
        planned = positioned.where(F.col("position") < num_steps * spec.local_batch_size)
    else:
        planned = spark_plan.apply_leftover_policy(positioned, num_samples, spec.global_batch_size, args.leftover)
        assignment = spark_plan.plan_windows(planned, spec)
    assignment = checkpoint(assignment)
    return assignment, planned, time.perf_counter() - started


def count_assignment(assignment, planned, spec, control: str | None) -> tuple[dict, int]:
    """The plan's rows, users, steps and samples moved between steps, checked against the planned
    samples (each once, or once per rank for the mirror control); and the planned sample count."""
    from pyspark.sql import functions as F

    counts = assignment.agg(F.count(F.lit(1)).alias("rows"), F.countDistinct("user_id").alias("users"),
                            F.max("step").alias("last_step"),
                            F.sum((F.col("step") != F.col("origin_step")).cast("long")).alias("moved")).first()
    planned_samples = planned.count()
    expected_rows = planned_samples * (spec.world_size if control else 1)
    if counts["rows"] != expected_rows or counts["users"] != planned_samples:
        raise RuntimeError(f"plan lost or duplicated samples: {counts['rows']} rows for {planned_samples} samples")
    return counts.asDict(), planned_samples


def plan_statistics(assignment, planned, costs, spec, control: str | None, sequences_path: str,
                    plan_seconds: float):
    """Per-step loads (the plan's and the contiguous baseline's), the manifest's stats (predicted
    bubbles, imbalance), and per-rank tokens and cost; refuses a plan that leaves a rank empty or
    a cost model that gives zero total cost."""
    from pyspark.sql import functions as F

    from shards import spark_plan

    step_table = spark_plan.step_loads(assignment, costs, spec).toPandas()
    baseline = spark_plan.contiguous_assignment(planned, spec) if not control else assignment
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


def shard_rows(sequences, assignment, costs, model):
    """The sequences with their (step, rank, slot), cost and the step's target count, in the shard
    format's columns and types."""
    from pyspark.sql import functions as F

    from pipeline.cost_model import cost_column
    from shards import spark_plan

    # Next-item targets per step over all ranks: the trainer divides each rank's loss
    # sum by it, so every plan weights every target the same.
    step_targets = (assignment.join(costs, "user_id").groupBy("step")
                    .agg(F.sum(F.col("length") - 1).alias("step_targets")))
    rows = (sequences.join(assignment, "user_id")
            .join(F.broadcast(step_targets), "step")
            .withColumn("cost", cost_column(model, "length")))
    return spark_plan.shard_rows(rows)


def write_shards(spark, fs, staging: str, rows, step_table, world_size: int) -> list[dict]:
    """Each rank's rows in step order under rank=<k>/, the per-step loads, and every written file's
    description (size, SHA-256, rows, path relative to the output) for the manifest."""
    from shards.file_stats import describe_files, relative_to
    from shards.schema import STEP_STATS_DIR, rank_dir

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


def balance(args: argparse.Namespace) -> int:
    # Arguments first: a bad one is reported before Spark (or anything heavy) loads.
    validate_args(args)
    check_inputs(args)
    capacities = parse_capacities(args.capacities, args.world_size)

    from jobs.atomic_output import atomic_output, check_output_free, remove_stale_siblings, stale_note
    from jobs.hadoop_fs import HadoopFS
    from jobs.tracking import job_run, reachable_tracking_uri, run_tags
    from pipeline.cost_model import CostModel, cost_column, default_cost_model
    from pipeline.session import build_spark_session, checkpoints_removed
    from shards import spark_plan
    from shards.manifest import UserFeature, build_rank_shards, new_manifest
    from shards.schema import MANIFEST_NAME, STEP_STATS_DIR
    args.tracking_uri = reachable_tracking_uri("balance", args.tracking_uri)  # unreachable: one warning, untracked

    # The run spans the job's work: opened before Spark starts, FAILED if the job fails.
    params = {k: v for k, v in vars(args).items()
              if k not in ("overwrite", "tracking_uri", "experiment", "comparison")}
    tags = {**run_tags(args.strategy, args.control, args.comparison), "freescale.world_size": str(args.world_size)}
    with job_run("balance", tracking_uri=args.tracking_uri, experiment=args.experiment, params=params, tags=tags,
                 run_name=f"balance-{args.control or args.strategy}-k{args.world_size}", output=args.output) as run, \
            checkpoints_removed("balance"):  # inside the run: removed before it ends, failed or not
        model = CostModel.load(args.cost_model) if args.cost_model else default_cost_model()
        started = time.perf_counter()

        spark = build_spark_session(args.master, "freescale-balance")
        fs = HadoopFS(spark)
        input_uri, output_uri = fs.qualify(args.input), fs.qualify(args.output)
        check_output_free(fs, output_uri, args.overwrite)
        stale_removed = remove_stale_siblings(fs, output_uri)
        sequences_path, sequences = read_sequences(spark, fs, input_uri)
        prepared = prepared_metadata(fs, input_uri, sequences, sequences_path)
        spec = spark_plan.PlanSpec(world_size=args.world_size, local_batch_size=args.local_batch_size,
                                   window_steps=args.window_steps, strategy=args.strategy, seed=args.seed,
                                   token_cap=args.token_cap, equal_counts=args.equal_counts,
                                   capacities=capacities, time_limit_s=args.time_limit,
                                   flop_width=args.flop_width)

        costs = sequences.select("user_id", "length", cost_column(model, "length").alias("cost"))
        positioned = spark_plan.with_global_position(costs, args.seed)
        num_samples = positioned.count()
        check_sample_count(num_samples, spec, args, sequences_path)
        check_token_cap(costs, spec.token_cap)

        assignment, planned, plan_seconds = assign_samples(positioned, spec, args, num_samples)
        counts, planned_samples = count_assignment(assignment, planned, spec, args.control)
        num_steps = int(counts["last_step"]) + 1
        step_table, stats, rank_totals = plan_statistics(assignment, planned, costs, spec, args.control,
                                                         sequences_path, plan_seconds)
        rows = shard_rows(sequences, assignment, costs, model)
        leftover = num_samples - planned_samples
        with atomic_output(fs, output_uri, args.overwrite) as staging:
            files = write_shards(spark, fs, staging, rows, step_table, spec.world_size)
            manifest = new_manifest(
                ranks=build_rank_shards(files, rank_totals, spec.world_size),
                world_size=spec.world_size, local_batch_size=spec.local_batch_size,
                global_batch_size=spec.global_batch_size,
                num_steps=num_steps, window_steps=spec.window_steps, strategy=spec.strategy,
                control=args.control, seed=args.seed, equal_counts=spec.equal_counts, token_cap=spec.token_cap,
                capacities=list(capacities) if capacities else None, cost_model=model.to_json(),
                num_items=prepared.get("num_items"),
                user_features=tuple(UserFeature(f["name"], f["num_ids"]) for f in prepared.get("user_features", [])),
                input={"uri": input_uri, "samples": num_samples},
                num_samples=planned_samples, num_rows=counts["rows"],
                leftover={"policy": args.leftover, "samples": leftover},
                moved_samples=int(counts["moved"]), columns=["rank", *rows.columns[1:]], stats=stats,
                step_stats=STEP_STATS_DIR)
            fs.write_text(f"{staging}/{MANIFEST_NAME}", manifest.dumps())

        run.set_tags({"freescale.output": output_uri})
        run.log_metrics({**stats, "num_samples": planned_samples, "num_steps": num_steps, "leftover_samples": leftover,
                         "moved_samples": counts["moved"], "job_seconds": time.perf_counter() - started})
        run.log_text(manifest.dumps(), MANIFEST_NAME)
    print(f"freescale balance: wrote {planned_samples} samples ({counts['rows']} rows) in {num_steps} steps x "
          f"{spec.world_size} ranks to {output_uri}; strategy {spec.strategy}"
          f"{' (control ' + args.control + ')' if args.control else ''}, predicted bubble "
          f"{stats['bubble']:.2%} vs {stats['bubble_contiguous']:.2%} contiguous; "
          f"{leftover} leftover samples dropped ({args.leftover}), {counts['moved']} moved between steps"
          f"{stale_note(stale_removed)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pipeline.progress import spark_progress  # stdlib only; pyspark loads when a stage runs

    with spark_progress("balance"):  # one line with the running stage and its fraction done
        return run_job("balance", lambda: balance(args))


if __name__ == "__main__":
    sys.exit(main())
