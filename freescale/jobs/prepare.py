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
With --previous PREPARED (daily training) the new logs of --input extend an earlier
output: items and feature values keep their ids, new ones get ids after them, a
returning user's sequence goes on from the previous output's <output>/history (every
user's last events, which every prepare writes); <output>/sequences then holds only
the users the new logs touch, and prepare.json counts returning, new and unchanged
users and the late events (freescale/prepare/incremental.py has the rules).
The output appears atomically; it may not be, be inside or contain an input. Local
inputs are checked (existence, Parquet footers and columns) before Spark starts.
"""
from __future__ import annotations

import sys

from freescale.jobs.spark_job import SparkJob, SparkJobRun, check_output
from freescale.prepare.prepare_spec import PrepareSpec, synthetic_text  # standard library only


def check_inputs(spec: PrepareSpec) -> None:
    """What can be checked without Spark (local paths; remote ones are checked by Spark):
    the output is not an input, the inputs exist, Parquet footers are readable and have
    the needed columns, a --master spark://... takes connections."""
    from freescale.runtime.spark_master import check_master
    from freescale.prepare.prepared import check_local_previous
    from freescale.prepare.spark_prepare import check_local_inputs

    check_master(spec.master)
    check_output(spec.output, spec.overwrite, {"--input": spec.input, "--user-features": spec.user_features,
                                               "--previous": spec.previous})
    if spec.previous is not None:
        check_local_previous(spec.previous, spec.max_seq_len)
    check_local_inputs(spec)


def prepare(spec: PrepareSpec, job: SparkJobRun) -> str:
    from freescale.tracking.datasets import DataRef
    from freescale.prepare import spark_prepare
    from freescale.prepare.prepared import METADATA_NAME, metadata_text

    spark, fs = job.start_spark()
    inputs = spark_prepare.read_inputs(spark, fs, spec)
    datasets = {"source": DataRef.logs(inputs.source)}
    if spec.previous is None:
        with job.staging() as staging:
            prepared = spark_prepare.write_prepared(spark, fs, staging, spec, inputs)
    else:
        from freescale.prepare import incremental

        previous = incremental.read_previous(spark, fs, spec, inputs)  # checked before the output exists
        datasets["previous"] = DataRef.prepared(previous.uri, previous.metadata_text)
        with job.staging() as staging:
            prepared = incremental.write_incremental(spark, fs, staging, spec, inputs, previous)
    job.run.set_tags({"freescale.output": job.output_uri, "freescale.data": inputs.source.get("uri", "synthetic")})
    job.run.log_metrics({**{k: v for k, v in prepared.stats.items() if isinstance(v, (int, float))},
                         "job_seconds": job.seconds()})
    job.run.log_text(metadata_text(prepared.meta).rstrip("\n"), METADATA_NAME)
    job.run.log_inputs({**datasets, "output": DataRef.prepared(job.output_uri, metadata_text(prepared.meta))})
    return summary_line(spec, inputs, prepared, job.output_uri)


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
               if prepared.repeated else "")
            + (f"; on --previous {spec.previous}: {stats['returning_users']} returning users, {stats['new_users']} new, "
               f"{stats['unchanged_users']} unchanged left out of sequences/, {stats['new_items']} new items, "
               f"{stats['late_events']} late events (older than its newest, merged in time order)"
               if spec.previous is not None else ""))


JOB = SparkJob("prepare", PrepareSpec, __doc__, prepare, check=check_inputs)
build_parser, run, main = JOB.build_parser, JOB.run, JOB.main


if __name__ == "__main__":
    sys.exit(main())
