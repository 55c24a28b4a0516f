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
import time
from dataclasses import asdict
from typing import Callable

from freescale.runtime.job_errors import run_job
from freescale.tracking.store import Tracking, add_tracking_arguments  # no mlflow import until a run opens
from freescale.runtime import options
from freescale.shards.balance_spec import BalanceSpec  # the balancing registry's names only: numpy


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale balance", description=__doc__.split("\n\n")[0])
    options.add_arguments(p, BalanceSpec, "cli")
    add_tracking_arguments(p)
    p.add_argument("--comparison", help="the `freescale compare` this run belongs to (MLflow tag freescale.comparison)")
    return p


def check_inputs(spec: BalanceSpec) -> None:
    """What can be checked without Spark (local paths; Spark checks remote ones): the output is not
    an input, --input holds sequences, and a --master spark://... takes connections."""
    from freescale.runtime.atomic_output import check_local_output_free, check_no_overlap
    from freescale.runtime.spark_master import check_master
    from freescale.shards.spark_balance import check_local_input

    check_master(spec.master)
    check_no_overlap(spec.output, {"--input": spec.input, "--cost-model": spec.cost_model})
    check_local_output_free(spec.output, spec.overwrite)
    check_local_input(spec)


def balance(spec: BalanceSpec, tracking: Tracking) -> int:
    # Arguments first: a bad one is reported before Spark (or anything heavy) loads.
    check_inputs(spec)

    from freescale.runtime.atomic_output import atomic_output, check_output_free, remove_stale_siblings, stale_note
    from freescale.runtime.hadoop_fs import HadoopFS
    from freescale.tracking.datasets import DataRef
    from freescale.tracking.runs import job_run, run_tags
    from freescale.tracking.store import reachable_tracking_uri
    from freescale.prepare.prepared import METADATA_NAME
    from freescale.costs.cost_model import CostModel, default_cost_model
    from freescale.runtime.session import build_spark_session, checkpoints_removed
    from freescale.shards import spark_balance
    from freescale.shards.schema import MANIFEST_NAME
    uri = reachable_tracking_uri("balance", tracking.uri)  # unreachable: one warning, untracked

    # The run spans the job's work: opened before Spark starts, FAILED if the job fails.
    params = {k: v for k, v in asdict(spec).items() if k != "overwrite"}
    tags = {**run_tags(spec.strategy, spec.control, tracking.comparison), "freescale.world_size": str(spec.world_size)}
    with job_run("balance", tracking_uri=uri, experiment=tracking.experiment, params=params, tags=tags,
                 run_name=f"balance-{spec.control or spec.strategy}-k{spec.world_size}", output=spec.output) as run, \
            checkpoints_removed("balance"):  # inside the run: removed before it ends, failed or not
        model = CostModel.load(spec.cost_model) if spec.cost_model else default_cost_model()
        started = time.perf_counter()
        spark = build_spark_session(spec.master, "freescale-balance")
        fs = HadoopFS(spark)
        input_uri, output_uri = fs.qualify(spec.input), fs.qualify(spec.output)
        check_output_free(fs, output_uri, spec.overwrite)
        stale_removed = remove_stale_siblings(fs, output_uri)
        planned = spark_balance.plan_shards(spark, fs, spec, model, input_uri)
        with atomic_output(fs, output_uri, spec.overwrite) as staging:
            manifest = spark_balance.write_shard_set(spark, fs, staging, planned, spec, model)
        run.set_tags({"freescale.output": output_uri})
        run.log_metrics({**planned.stats, "num_samples": planned.planned_samples, "num_steps": planned.num_steps,
                         "leftover_samples": planned.leftover, "moved_samples": planned.moved_samples,
                         "job_seconds": time.perf_counter() - started})
        run.log_text(manifest.dumps(), MANIFEST_NAME)
        metadata = f"{input_uri}/{METADATA_NAME}"
        run.log_inputs({**({"input": DataRef.prepared(input_uri, fs.read_text(metadata))} if fs.exists(metadata)
                           else {}), "output": DataRef.shards(output_uri, manifest.dumps())})
    print(f"freescale balance: wrote {planned.planned_samples} samples ({planned.num_rows} rows) in "
          f"{planned.num_steps} steps x {spec.world_size} ranks to {output_uri}; strategy {spec.strategy}"
          f"{' (control ' + spec.control + ')' if spec.control else ''}, predicted bubble "
          f"{planned.stats['bubble']:.2%} vs {planned.stats['bubble_contiguous']:.2%} contiguous; "
          f"{planned.leftover} leftover samples dropped ({spec.leftover_applied}), {planned.moved_samples} moved between "
          f"steps{stale_note(stale_removed)}")
    return 0


def run(spec_of: Callable[[], BalanceSpec], tracking: Tracking) -> int:
    """The job on the spec ``spec_of()`` builds (inside the job's error handling: a bad value is its
    one line); its exit status. `freescale compare` and `freescale pipeline` call it in-process."""
    from freescale.runtime.progress import spark_progress  # stdlib only; pyspark loads when a stage runs

    with spark_progress("balance"):  # one line with the running stage and its fraction done
        return run_job("balance", lambda: balance(spec_of(), tracking))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def spec() -> BalanceSpec:
        from freescale.runtime.atomic_output import check_no_overlap

        if args.capacities and args.capacities.startswith("@"):  # before the file is read
            check_no_overlap(args.output, {"--capacities": args.capacities[1:]})
        return options.from_values(BalanceSpec, vars(args))
    return run(spec, Tracking.of(args))


if __name__ == "__main__":
    sys.exit(main())
