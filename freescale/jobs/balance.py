"""Balance job: prepared sequences -> cost-balanced Parquet shards, one directory per rank, plus a manifest.

    spark-submit freescale/jobs/balance.py --input PREPARED --output SHARDS --world-size K --local-batch-size B
    freescale balance ...            (same arguments, local Spark by default)

Steps: compute each sample's cost with the cost model (native Spark expressions),
shuffle with a seed, cut the shuffled order into windows of W global batches,
plan every window on the executors (balancing.plan), write each rank's samples in
step order under rank=<k>/, and record per-step imbalance, predicted bubble,
row counts and checksums in manifest.json. The output appears atomically.

The options are ``freescale.shards.balance_spec.BalanceSpec``'s; the Spark work is freescale/shards/spark_balance.py's.
`freescale compare` and `freescale pipeline` call :func:`run` with a spec.
"""
from __future__ import annotations

import argparse
import sys

from freescale.jobs.spark_job import SparkJob, SparkJobRun, check_output
from freescale.runtime import options
from freescale.shards.balance_spec import BalanceSpec  # the balancing registry's names only: numpy
from freescale.tracking.store import Tracking


def comparison_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--comparison", help="the `freescale compare` this run belongs to (MLflow tag freescale.comparison)")


def check_inputs(spec: BalanceSpec) -> None:
    """What can be checked without Spark (local paths; Spark checks remote ones): the output is not
    an input, --input holds sequences, and a --master spark://... takes connections."""
    from freescale.runtime.spark_master import check_master
    from freescale.shards.spark_balance import check_local_input

    check_master(spec.master)
    check_output(spec.output, spec.overwrite, {"--input": spec.input, "--cost-model": spec.cost_model})
    check_local_input(spec)


def tags(spec: BalanceSpec, tracking: Tracking) -> dict[str, str]:
    from freescale.tracking.runs import run_tags

    return {**run_tags(spec.strategy, spec.control, tracking.comparison), "freescale.world_size": str(spec.world_size)}


def balance(spec: BalanceSpec, job: SparkJobRun) -> str:
    from freescale.tracking.datasets import DataRef
    from freescale.prepare.prepared import METADATA_NAME
    from freescale.costs.cost_model import CostModel, default_cost_model
    from freescale.shards import spark_balance
    from freescale.shards.schema import MANIFEST_NAME

    model = CostModel.load(spec.cost_model) if spec.cost_model else default_cost_model()
    spark, fs = job.start_spark()
    input_uri, output_uri = fs.qualify(spec.input), job.output_uri
    planned = spark_balance.plan_shards(spark, fs, spec, model, input_uri)
    with job.staging() as staging:
        manifest = spark_balance.write_shard_set(spark, fs, staging, planned, spec, model)
    job.run.set_tags({"freescale.output": output_uri})
    job.run.log_metrics({**planned.stats, "num_samples": planned.planned_samples, "num_steps": planned.num_steps,
                         "leftover_samples": planned.leftover, "moved_samples": planned.moved_samples,
                         "job_seconds": job.seconds()})
    job.run.log_text(manifest.dumps(), MANIFEST_NAME)
    metadata = f"{input_uri}/{METADATA_NAME}"
    job.run.log_inputs({**({"input": DataRef.prepared(input_uri, fs.read_text(metadata))} if fs.exists(metadata)
                           else {}), "output": DataRef.shards(output_uri, manifest.dumps())})
    return (f"freescale balance: wrote {planned.planned_samples} samples ({planned.num_rows} rows) in "
            f"{planned.num_steps} steps x {spec.world_size} ranks to {output_uri}; strategy {spec.strategy}"
            f"{' (control ' + spec.control + ')' if spec.control else ''}, predicted bubble "
            f"{planned.stats['bubble']:.2%} vs {planned.stats['bubble_contiguous']:.2%} contiguous; "
            f"{planned.leftover} leftover samples dropped ({spec.leftover_applied}), {planned.moved_samples} moved between "
            "steps")


def spec_of_args(args: argparse.Namespace) -> BalanceSpec:
    from freescale.runtime.atomic_output import check_no_overlap

    if args.capacities and args.capacities.startswith("@"):  # before the file is read
        check_no_overlap(args.output, {"--capacities": args.capacities[1:]})
    return options.from_values(BalanceSpec, vars(args))


JOB = SparkJob("balance", BalanceSpec, __doc__, balance, check=check_inputs, tags=tags,
               run_name=lambda spec: f"balance-{spec.control or spec.strategy}-k{spec.world_size}",
               arguments=comparison_argument, spec_of_args=spec_of_args)
build_parser, run, main = JOB.build_parser, JOB.run, JOB.main


if __name__ == "__main__":
    sys.exit(main())
