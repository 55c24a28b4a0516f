"""Prepare job: raw interaction logs (or the seeded synthetic generator) -> per-user sequences.

    spark-submit freescale/jobs/prepare.py --input ratings.parquet --output PREPARED
    freescale prepare --output PREPARED           (no --input: synthetic data)

Writes <output>/sequences (one row per user: chronological item ids, leave-one-out
valid/test targets), <output>/item_vocab (raw item -> contiguous id) and
<output>/prepare.json (parameters and counts, including every user dropped and why).
With --user-features (a user table, e.g. MovieLens users.parquet) the sequences also
carry one categorical id per user feature, <output>/user_feature_vocab maps values to
ids, and prepare.json lists each feature's table size.
Duplicate interactions (same user, item and timestamp) are dropped and counted in
prepare.json (duplicates_dropped) unless --keep-duplicates.
The output appears atomically; it may not be, be inside or contain an input. Local
inputs are checked (existence, Parquet footers and columns) before Spark starts.
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
from freescale.prepare.prepare_spec import PrepareSpec, synthetic_text  # standard library only


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale prepare", description=__doc__.split("\n\n")[0])
    options.add_arguments(p, PrepareSpec, "cli")
    add_tracking_arguments(p)
    return p


def check_inputs(spec: PrepareSpec) -> None:
    """What can be checked without Spark (local paths; remote ones are checked by Spark):
    the output is not an input, the inputs exist, Parquet footers are readable and have
    the needed columns, a --master spark://... takes connections."""
    from freescale.runtime.atomic_output import check_local_output_free, check_no_overlap
    from freescale.runtime.spark_master import check_master
    from freescale.prepare.spark_prepare import check_local_inputs

    check_master(spec.master)
    check_no_overlap(spec.output, {"--input": spec.input, "--user-features": spec.user_features})
    check_local_output_free(spec.output, spec.overwrite)
    check_local_inputs(spec)


def prepare(spec: PrepareSpec, tracking: Tracking) -> int:
    # Arguments first: a bad one is reported before Spark (or anything heavy) loads.
    check_inputs(spec)

    from freescale.runtime.atomic_output import atomic_output, check_output_free, remove_stale_siblings, stale_note
    from freescale.runtime.hadoop_fs import HadoopFS
    from freescale.tracking.datasets import DataRef
    from freescale.tracking.runs import job_run
    from freescale.tracking.store import reachable_tracking_uri
    from freescale.prepare import spark_prepare
    from freescale.prepare.prepared import METADATA_NAME, metadata_text
    from freescale.runtime.session import build_spark_session, checkpoints_removed
    uri = reachable_tracking_uri("prepare", tracking.uri)  # unreachable: one warning, untracked

    # The run spans the job's work: opened before Spark starts, FAILED if the job fails.
    params = {k: v for k, v in asdict(spec).items() if k != "overwrite"}
    # Inside the run: its checkpoints are removed before the run ends, failed or not.
    with job_run("prepare", tracking_uri=uri, experiment=tracking.experiment, params=params,
                 output=spec.output) as run, checkpoints_removed("prepare"):
        started = time.perf_counter()
        spark = build_spark_session(spec.master, "freescale-prepare")
        fs = HadoopFS(spark)
        output_uri = fs.qualify(spec.output)
        check_output_free(fs, output_uri, spec.overwrite)
        stale_removed = remove_stale_siblings(fs, output_uri)
        inputs = spark_prepare.read_inputs(spark, fs, spec)
        with atomic_output(fs, output_uri, spec.overwrite) as staging:
            prepared = spark_prepare.write_prepared(spark, fs, staging, spec, inputs)
        run.set_tags({"freescale.output": output_uri, "freescale.data": inputs.source.get("uri", "synthetic")})
        run.log_metrics({**{k: v for k, v in prepared.stats.items() if isinstance(v, (int, float))},
                         "job_seconds": time.perf_counter() - started})
        run.log_text(metadata_text(prepared.meta).rstrip("\n"), METADATA_NAME)
        run.log_inputs({"source": DataRef.logs(inputs.source),
                        "output": DataRef.prepared(output_uri, metadata_text(prepared.meta))})
    print(summary_line(spec, inputs, prepared, output_uri) + stale_note(stale_removed))
    return 0


def summary_line(spec: PrepareSpec, inputs, prepared, output_uri: str) -> str:
    """The job's last line: what it wrote, and every user and row it left out or changed."""
    stats = prepared.stats
    synthetic = f" from synthetic data ({synthetic_text(spec)}; no --input)" if spec.input is None else ""
    return (f"freescale prepare: {stats['users']} sequences over {stats['num_items']} items{synthetic} to {output_uri}; "
            f"{stats['users_dropped_short']} users dropped (fewer than 3 interactions), "
            f"{stats['users_truncated']} truncated to {spec.max_seq_len} items"
            + (f"; user features {', '.join(inputs.feature_names)} ({stats['users_without_features']} users "
               "without a row: unknown ids)" if inputs.users is not None else "")
            + (f"; {prepared.duplicates} duplicate interactions dropped (same user, item and timestamp)"
               if prepared.duplicates else f"; {prepared.repeated} duplicate interactions kept (--keep-duplicates)"
               if prepared.repeated else ""))


def run(spec_of: Callable[[], PrepareSpec], tracking: Tracking) -> int:
    """The job on the spec ``spec_of()`` builds (inside the job's error handling: a bad value is its
    one line); its exit status. `freescale pipeline` calls it in-process."""
    from freescale.runtime.progress import spark_progress  # stdlib only; pyspark loads when a stage runs

    with spark_progress("prepare"):  # one line with the running stage and its fraction done
        return run_job("prepare", lambda: prepare(spec_of(), tracking))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(lambda: options.from_values(PrepareSpec, vars(args)), Tracking.of(args))


if __name__ == "__main__":
    sys.exit(main())
