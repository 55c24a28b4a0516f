"""Recommend job: an exported model and a prepare output -> every user's top k, as Parquet.

    spark-submit freescale/jobs/recommend.py --model out/model --input PREPARED --output RECOMMENDATIONS
    freescale recommend --model models:/NAME/1 --input PREPARED --output RECOMMENDATIONS [--k 10]

Scores each user's whole prepared sequence (its training items, then the validation and test items) with
the model `freescale export` wrote (its folder, an MLflow model folder, or a models:/ or runs:/ URI),
on the executors, the model loaded once per Python worker, and writes <output> atomically: one row per
user, user_id (raw), items (raw ids, best first) and scores. --exclude-history leaves the history's
items out (default: the model's own default, true). The input must be prepared with the model's
vocabulary. The options are freescale/training/export/recommend_spec.py's RecommendSpec; the Spark work is
freescale/training/export/spark_recommend.py's.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from typing import Callable

from freescale.runtime import options
from freescale.runtime.job_errors import run_job
from freescale.training.export.recommend_spec import RecommendSpec, check_arguments  # standard library only
from freescale.tracking.store import Tracking, add_tracking_arguments  # no mlflow import until a run opens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale recommend", description=__doc__.split("\n\n")[0])
    options.add_arguments(p, RecommendSpec, "cli")
    add_tracking_arguments(p)
    return p


def check_inputs(spec: RecommendSpec) -> None:
    """What can be checked without Spark: the arguments, and that a --master spark://... takes connections."""
    from freescale.runtime.spark_master import check_master

    check_arguments(spec)
    check_master(spec.master)


def recommend(spec: RecommendSpec, tracking: Tracking) -> int:
    # Arguments first: a bad one is reported before Spark, torch or mlflow loads.
    check_inputs(spec)

    import tempfile
    from pathlib import Path

    from freescale.runtime.atomic_output import atomic_output, check_output_free, remove_stale_siblings, stale_note
    from freescale.runtime.hadoop_fs import HadoopFS
    from freescale.runtime.session import build_spark_session, checkpoints_removed
    from freescale.training.export import spark_recommend
    from freescale.tracking.runs import job_run
    from freescale.tracking.store import reachable_tracking_uri, resolve_tracking_uri
    uri = reachable_tracking_uri("recommend", tracking.uri)  # unreachable: one warning, untracked

    params = {k: v for k, v in asdict(spec).items() if k != "overwrite"}
    with job_run("recommend", tracking_uri=uri, experiment=tracking.experiment, params=params,
                 output=spec.output) as run, checkpoints_removed("recommend"), \
            tempfile.TemporaryDirectory(prefix="freescale-recommend-") as scratch:
        source = spark_recommend.resolve_model(spec.model, resolve_tracking_uri(tracking.uri), Path(scratch))
        exclude = source.exclude_default if spec.exclude_history is None else spec.exclude_history == "true"
        started = time.perf_counter()
        spark = build_spark_session(spec.master, "freescale-recommend")
        fs = HadoopFS(spark)
        input_uri, output_uri = fs.qualify(spec.input), fs.qualify(spec.output)
        check_output_free(fs, output_uri, spec.overwrite)
        stale_removed = remove_stale_siblings(fs, output_uri)
        sequences, metadata = read_input(spark, fs, source, input_uri, spec)
        with atomic_output(fs, output_uri, spec.overwrite) as staging:
            spark_recommend.recommendations(spark, sequences, source, spec.k, exclude,
                                            Path(scratch)).write.parquet(staging)
            users = spark.read.parquet(staging).count()
        seconds = time.perf_counter() - started
        run.set_tags({"freescale.output": output_uri, "freescale.model_uri": source.uri})
        run.log_metrics({"users": users, "job_seconds": seconds, "users_per_second": users / seconds})
        run.log_inputs(datasets(input_uri, metadata, output_uri, source.uri, spec, users))
    print(f"freescale recommend: wrote the top {spec.k} of {users} users to {output_uri} from {source.uri} "
          f"({'history excluded' if exclude else 'history included'}) in {seconds:.0f} s"
          + (f"; {len(spec.user_ids()) - users} of the {len(spec.user_ids())} users asked for are not in the input"
             if spec.users is not None and users < len(spec.user_ids()) else "") + stale_note(stale_removed))
    return 0


def read_input(spark, fs, source, input_uri: str, spec: RecommendSpec):
    """The input's sequences (only --users' when given) and its prepare.json, once the input's vocabulary is
    checked against the model's."""
    from pyspark.sql import functions as F

    from freescale.prepare.prepared import METADATA_NAME, SEQUENCES_DIR, parse_metadata
    from freescale.training.export.spark_recommend import check_vocabulary

    metadata = fs.read_text(f"{input_uri}/{METADATA_NAME}")
    meta = parse_metadata(metadata, f"{input_uri}/{METADATA_NAME}")
    vocab = {int(row.item_id): row.raw_item for row in
             spark.read.parquet(f"{input_uri}/item_vocab").select("item_id", "raw_item").collect()}
    features = [(f["name"], int(f["num_ids"])) for f in meta.get("user_features", [])]
    check_vocabulary(source, vocab, features, spec.input)
    sequences = spark.read.parquet(f"{input_uri}/{SEQUENCES_DIR}")
    users = spec.user_ids()
    return (sequences if users is None else sequences.where(F.col("user_id").isin(users))), metadata


def datasets(input_uri: str, metadata: str, output_uri: str, model_uri: str, spec: RecommendSpec, users: int):
    """The run's dataset inputs: the prepare output it read, and the recommendations it wrote."""
    import hashlib

    from freescale.tracking.datasets import DataRef

    made_of = {"model": model_uri, "input": hashlib.sha256(metadata.encode()).hexdigest(), "k": spec.k,
               "exclude_history": spec.exclude_history, "users": spec.users}
    output = DataRef.recommendations(output_uri, made_of, {"users": users, "k": spec.k, "model": model_uri})
    return {"input": DataRef.prepared(input_uri, metadata), "output": output}


def run(spec_of: Callable[[], RecommendSpec], tracking: Tracking) -> int:
    """The job on the spec ``spec_of()`` builds (inside the job's error handling: a bad value is its one
    line); its exit status. `freescale pipeline` calls it in-process."""
    from freescale.runtime.progress import spark_progress  # stdlib only; pyspark loads when a stage runs

    with spark_progress("recommend"):  # one line with the running stage and its fraction done
        return run_job("recommend", lambda: recommend(spec_of(), tracking))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(lambda: options.from_values(RecommendSpec, vars(args)), Tracking.of(args))


if __name__ == "__main__":
    sys.exit(main())
