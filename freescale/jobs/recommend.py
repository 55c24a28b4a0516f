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

import sys

from freescale.jobs.spark_job import SparkJob, SparkJobRun
from freescale.runtime.errors import InputError
from freescale.training.export.recommend_spec import RecommendSpec, check_arguments  # standard library only


def check_inputs(spec: RecommendSpec) -> None:
    """What can be checked without Spark: the arguments, and that a --master spark://... takes connections."""
    from freescale.runtime.spark_master import check_master

    check_arguments(spec)
    check_master(spec.master)


def recommend(spec: RecommendSpec, job: SparkJobRun) -> str:
    import tempfile
    from pathlib import Path

    from freescale.training.export import spark_recommend

    with tempfile.TemporaryDirectory(prefix="freescale-recommend-") as scratch:
        source = spark_recommend.resolve_model(spec.model, job.tracking.resolved_uri(), Path(scratch))
        exclude = source.exclude_default if spec.exclude_history is None else spec.exclude_history == "true"
        spark, fs = job.start_spark()
        input_uri, output_uri = fs.qualify(spec.input), job.output_uri
        sequences, metadata = read_input(spark, fs, source, input_uri, spec)
        with job.staging() as staging:
            spark_recommend.recommendations(spark, sequences, source, spec.k, exclude,
                                            Path(scratch)).write.parquet(staging)
            users = spark.read.parquet(staging).count()
        seconds = job.seconds()
        job.run.set_tags({"freescale.output": output_uri, "freescale.model_uri": source.uri})
        job.run.log_metrics({"users": users, "job_seconds": seconds, "users_per_second": users / seconds})
        job.run.log_inputs(datasets(input_uri, metadata, output_uri, source.uri, spec, users))
    return (f"freescale recommend: wrote the top {spec.k} of {users} users to {output_uri} from {source.uri} "
            f"({'history excluded' if exclude else 'history included'}) in {seconds:.0f} s"
            + (f"; {len(spec.user_ids()) - users} of the {len(spec.user_ids())} users asked for are not in the input"
               if spec.users is not None and users < len(spec.user_ids()) else ""))


def read_input(spark, fs, source, input_uri: str, spec: RecommendSpec):
    """The input's sequences (only --users' when given: one line when it names none of them) and its
    prepare.json, once the input's vocabulary is checked against the model's."""
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
    if users is None:
        return sequences, metadata
    chosen = sequences.where(F.col("user_id").isin(users))
    if chosen.select("user_id").limit(1).count() == 0:
        raise InputError(f"--users {spec.users}: none of the {len(users)} users it names is in --input {spec.input}")
    return chosen, metadata


def datasets(input_uri: str, metadata: str, output_uri: str, model_uri: str, spec: RecommendSpec, users: int):
    """The run's dataset inputs: the prepare output it read, and the recommendations it wrote."""
    import hashlib

    from freescale.tracking.datasets import DataRef

    made_of = {"model": model_uri, "input": hashlib.sha256(metadata.encode()).hexdigest(), "k": spec.k,
               "exclude_history": spec.exclude_history, "users": spec.users}
    output = DataRef.recommendations(output_uri, made_of, {"users": users, "k": spec.k, "model": model_uri})
    return {"input": DataRef.prepared(input_uri, metadata), "output": output}


JOB = SparkJob("recommend", RecommendSpec, __doc__, recommend, check=check_inputs)
build_parser, run, main = JOB.build_parser, JOB.run, JOB.main


if __name__ == "__main__":
    sys.exit(main())
