"""Prepare job: raw interaction logs (or the seeded synthetic generator) -> per-user sequences.

    spark-submit jobs/prepare.py --input ratings.parquet --output PREPARED
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
import json
import sys
import time

from jobs.job_errors import run_job
from jobs.tracking import add_tracking_arguments  # no mlflow import until a run opens
from pipeline.errors import InputError
from pipeline.layouts import FORMATS  # plain data, no pyspark

PREPARE_FORMAT = "freescale.prepared/1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", help="interaction log: Parquet, CSV or a MovieLens file/directory "
                                   "(omit for the synthetic generator)")
    p.add_argument("--output", required=True, help="directory to create")
    p.add_argument("--format", choices=FORMATS,
                   help="input format (default: from the file name); user-item-lines: one `user item` pair "
                        "per line, a user's lines in time order, the line number as timestamp (SASRec's "
                        "ml-1m.txt, Beauty.txt)")
    p.add_argument("--user-col", help="user column (default: user_id/userId/user/uid)")
    p.add_argument("--item-col", help="item column (default: item_id/movie_id/movieId/item/iid)")
    p.add_argument("--time-col", help="timestamp column (default: timestamp/ts/time/event_time)")
    p.add_argument("--rating-col", help="optional rating/action column (default: rating/action/score)")
    p.add_argument("--user-features", help="user table (Parquet or CSV): a user column plus categorical "
                                           "feature columns, e.g. MovieLens users.parquet")
    p.add_argument("--user-feature-cols", help="comma-separated feature columns of --user-features "
                                               "(default: every column but the user column)")
    p.add_argument("--max-seq-len", type=int, default=1024,
                   help="keep the most recent N training items per user (default 1024)")
    p.add_argument("--keep-duplicates", action="store_true",
                   help="keep repeated (user, item, timestamp) rows; by default they are dropped and counted "
                        "(a duplicated last event would make the test target equal the validation target)")
    g = p.add_argument_group("synthetic data (when --input is omitted)")
    g.add_argument("--synthetic-users", type=int, default=20_000, help="users (default 20000)")
    g.add_argument("--synthetic-items", type=int, default=10_000, help="catalog size (default 10000)")
    g.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--master", help="Spark master (default: spark-submit's, else local[*])")
    add_tracking_arguments(p)
    return p


def validate_args(args: argparse.Namespace) -> None:
    checks = [("--max-seq-len", args.max_seq_len)]
    if args.input is None:
        checks += [("--synthetic-users", args.synthetic_users), ("--synthetic-items", args.synthetic_items)]
    for flag, value in checks:
        if value <= 0:
            raise InputError(f"{flag} must be a positive integer, got {value}")


def feature_columns(args: argparse.Namespace) -> list[str] | None:
    if not args.user_feature_cols:
        return None
    return [c.strip() for c in args.user_feature_cols.split(",") if c.strip()]


def check_inputs(args: argparse.Namespace) -> None:
    """What can be checked without Spark (local paths; remote ones are checked by Spark):
    the output is not an input, the inputs exist, Parquet footers are readable and have
    the needed columns, a --master spark://... takes connections."""
    from jobs.atomic_output import check_local_output_free, check_no_overlap
    from pipeline import preflight

    preflight.check_master(args.master)
    check_no_overlap(args.output, {"--input": args.input, "--user-features": args.user_features})
    check_local_output_free(args.output, args.overwrite)
    if args.input is not None:
        preflight.check_interactions(args.input, args.format, user_col=args.user_col, item_col=args.item_col,
                                     time_col=args.time_col, rating_col=args.rating_col)
    if args.user_features is not None:
        preflight.check_user_table(args.user_features, feature_columns(args))


def prepare(args: argparse.Namespace) -> int:
    # Arguments first: a bad one is reported before Spark (or anything heavy) loads.
    validate_args(args)
    check_inputs(args)

    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    from jobs.atomic_output import atomic_output, check_output_free, remove_stale_siblings, stale_note
    from jobs.hadoop_fs import HadoopFS
    from jobs.tracking import job_run, reachable_tracking_uri
    from pipeline.ingest import drop_duplicate_interactions, read_interactions
    from pipeline.sequences import apply_item_vocab, build_item_vocab, build_sequences, sequence_stats
    from pipeline.session import build_spark_session, checkpoint, checkpoints_removed
    from pipeline.synthetic import synthetic_interactions
    from pipeline.user_features import (
        build_user_feature_vocab,
        count_users_without_features,
        encode_user_features,
        feature_cardinalities,
        read_user_table,
    )
    args.tracking_uri = reachable_tracking_uri("prepare", args.tracking_uri)  # unreachable: one warning, untracked

    # The run spans the job's work: opened before Spark starts, FAILED if the job fails.
    params = {k: v for k, v in vars(args).items() if k not in ("overwrite", "tracking_uri", "experiment")}
    # Inside the run: its checkpoints are removed before the run ends, failed or not.
    with job_run("prepare", tracking_uri=args.tracking_uri, experiment=args.experiment, params=params,
                 output=args.output) as run, \
            checkpoints_removed("prepare"):
        started = time.perf_counter()
        spark = build_spark_session(args.master, "freescale-prepare")
        fs = HadoopFS(spark)
        output_uri = fs.qualify(args.output)
        check_output_free(fs, output_uri, args.overwrite)
        stale_removed = remove_stale_siblings(fs, output_uri)

        if args.input is None:
            source = {"kind": "synthetic", "users": args.synthetic_users, "items": args.synthetic_items,
                      "seed": args.seed}
            interactions = synthetic_interactions(spark, args.synthetic_users, args.synthetic_items, seed=args.seed)
        else:
            source = {"kind": "file", "uri": fs.qualify(args.input), "format": args.format}
            interactions = read_interactions(spark, args.input, fmt=args.format, user_col=args.user_col,
                                             item_col=args.item_col, time_col=args.time_col,
                                             rating_col=args.rating_col)
        interactions = checkpoint(interactions)  # read the raw input once
        users, feature_names = None, []
        if args.user_features is not None:
            columns = feature_columns(args)
            # The user table's user column is recognised by name (user_id, userId, ...):
            # --user-col names the interaction log's, which may differ.
            users, feature_names = read_user_table(spark, args.user_features, feature_cols=columns)
            users = checkpoint(users)
            source["user_features"] = fs.qualify(args.user_features)
        counts = interactions.agg(F.count(F.lit(1)).alias("interactions"),
                                  F.countDistinct("user_id").alias("users")).first()

        with atomic_output(fs, output_uri, args.overwrite) as staging:
            if users is not None:
                build_user_feature_vocab(users, feature_names).write.parquet(f"{staging}/user_feature_vocab")
                feature_vocab = spark.read.parquet(f"{staging}/user_feature_vocab")

            def write_sequences(interactions, repeated=None, mode="errorifexists"):
                vocab = build_item_vocab(interactions)
                vocab.write.mode(mode).parquet(f"{staging}/item_vocab")
                vocab = spark.read.parquet(f"{staging}/item_vocab")
                sequences = build_sequences(apply_item_vocab(interactions, vocab), args.max_seq_len, repeated)
                if users is not None:
                    sequences = encode_user_features(sequences, users, feature_vocab, feature_names)
                sequences.write.mode(mode).parquet(f"{staging}/sequences")
                return vocab, spark.read.parquet(f"{staging}/sequences")

            # Duplicates are counted inside the per-user aggregation of the sequences' write
            # (no pass of their own). A clean input (the usual case) is done; otherwise the
            # vocabulary counts and the sequences are rebuilt from the deduplicated rows.
            observed = Observation("repeated interactions")
            vocab, sequences = write_sequences(interactions, observed)
            repeated = observed.get["repeated"]
            duplicates = 0 if args.keep_duplicates else repeated
            if duplicates:
                interactions = checkpoint(drop_duplicate_interactions(interactions))
                vocab, sequences = write_sequences(interactions, mode="overwrite")
            feature_stats, feature_meta = {}, {}
            if users is not None:
                feature_stats = {"users_without_features": count_users_without_features(sequences, users)}
                feature_meta = {"user_features": feature_cardinalities(feature_vocab, feature_names)}
            stats = {"input_interactions": counts["interactions"], "input_users": counts["users"],
                     "duplicates_dropped": duplicates,
                     "num_items": vocab.count(), **sequence_stats(sequences, interactions), **feature_stats}
            if stats["users"] == 0:
                raise InputError(f"input {source.get('uri', 'synthetic')}: no user has the 3 interactions "
                                 "a leave-one-out split needs")
            meta = {"format": PREPARE_FORMAT, "source": source, "max_seq_len": args.max_seq_len, **stats,
                    **feature_meta}
            fs.write_text(f"{staging}/prepare.json", json.dumps(meta, indent=2) + "\n")

        run.set_tags({"freescale.output": output_uri, "freescale.data": source.get("uri", "synthetic")})
        run.log_metrics({**{k: v for k, v in stats.items() if isinstance(v, (int, float))},
                         "job_seconds": time.perf_counter() - started})
        run.log_text(json.dumps(meta, indent=2), "prepare.json")
    synthetic = (f" from synthetic data ({args.synthetic_users} users, {args.synthetic_items} items, seed {args.seed}; "
                 "no --input)" if args.input is None else "")
    print(f"freescale prepare: {stats['users']} sequences over {stats['num_items']} items{synthetic} to {output_uri}; "
          f"{stats['users_dropped_short']} users dropped (fewer than 3 interactions), "
          f"{stats['users_truncated']} truncated to {args.max_seq_len} items"
          + (f"; user features {', '.join(feature_names)} ({stats['users_without_features']} users "
             "without a row: unknown ids)" if users is not None else "")
          + (f"; {duplicates} duplicate interactions dropped (same user, item and timestamp)" if duplicates
             else f"; {repeated} duplicate interactions kept (--keep-duplicates)" if repeated else "")
          + stale_note(stale_removed))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pipeline.progress import spark_progress  # stdlib only; pyspark loads when a stage runs

    with spark_progress("prepare"):  # one line with the running stage and its fraction done
        return run_job("prepare", lambda: prepare(args))


if __name__ == "__main__":
    sys.exit(main())
