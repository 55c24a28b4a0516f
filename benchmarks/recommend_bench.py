"""Benchmark: `freescale recommend`'s scoring speed, users per second per core, on local Spark.

Usage (from the repository root):
    python -m benchmarks.recommend_bench --model out/ml100k/model --input out/ml100k/prepared --cores 1,2
    python -m benchmarks.recommend_bench --synthetic-users 100000 --cores 1,2     # a synthetic set and model

Each row times the job's Spark work -- ship the model, score every user (``mapInPandas``, the model
loaded once per Python worker) and write the Parquet output -- on ``local[c]`` (c executor cores), the
median of ``--repeats``; the JVM's start and the model's resolution are not in it (the job's own
``job_seconds`` metric has them). With ``--synthetic-users N`` the data is `freescale prepare`'s seeded
synthetic set of N users (made once in ``--workdir``) and the model an export folder of a random model
with ``configs/demo.toml``'s shape over its items: the speed does not depend on the weights' values.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, commit, freescale, run


def synthetic(users: int, workdir: Path) -> tuple[Path, Path]:
    """A synthetic prepare output of ``users`` users and a random demo-shaped model over its items."""
    prepared, model = workdir / f"synthetic-{users}u", workdir / f"synthetic-{users}u-model"
    if not prepared.exists():
        run(freescale("prepare", "--output", str(prepared), "--synthetic-users", str(users), "--tracking-uri",
                      "none"), workdir / f"prepare-{users}u.log")
    if not model.exists():
        random_model(prepared, REPO / "configs" / "demo.toml", model)
    return prepared, model


def random_model(prepared: Path, config_file: Path, out: Path) -> None:
    """An export folder of a randomly initialised model of ``config_file``'s shape over ``prepared``'s items."""
    from types import SimpleNamespace

    import torch

    from freescale.prepare.prepared import read_metadata
    from freescale.training.config import load_config
    from freescale.training.export.exporter import Source, read_vocabulary, write_folder
    from freescale.training.export.exported_model import ITEM_TABLE, USER_TABLE, dense_model

    torch.manual_seed(0)
    config = load_config(str(config_file), [])
    meta = read_metadata(prepared)
    vocab = read_vocabulary(prepared, meta["num_items"], [f["num_ids"] for f in meta.get("user_features", [])])
    model = dense_model(meta["num_items"], config.model, vocab.features, config.training.precision)
    dim = config.model.embedding_dim
    state = {ITEM_TABLE: torch.randn(meta["num_items"] + 1, dim),
             **{USER_TABLE.format(index=i): torch.randn(size, dim) for i, (_, size) in enumerate(vocab.features)},
             **model.state_dict()}
    source = Source(out / "none", 0, config, {}, SimpleNamespace(state_dict_metadata={}))
    write_folder(out, source, vocab, state, {})


def timed_runs(model: Path, prepared: Path, cores: int, repeats: int, workdir: Path, k: int) -> list[float]:
    """Seconds of each repeat's ship-score-write on ``local[cores]`` (a fresh session per core count)."""
    from pyspark.sql import SparkSession

    from freescale.runtime.session import build_spark_session
    from freescale.training.export.spark_recommend import recommendations, resolve_model

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    spark = build_spark_session(f"local[{cores}]", "freescale-recommend-bench")
    spark.conf.set("spark.sql.shuffle.partitions", str(cores))
    source = resolve_model(str(model), "none", workdir)
    sequences = spark.read.parquet(str(prepared / "sequences")).repartition(max(4, 2 * cores)).cache()
    sequences.count()
    seconds = []
    for repeat in range(repeats):
        out = workdir / f"top-{cores}-{repeat}"
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        recommendations(spark, sequences, source, k, True, workdir).write.parquet(str(out))
        seconds.append(time.perf_counter() - started)
        shutil.rmtree(out, ignore_errors=True)
    sequences.unpersist()
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="an export folder (with --input)")
    p.add_argument("--input", type=Path, help="the prepare output of the model's vocabulary")
    p.add_argument("--synthetic-users", type=int, help="instead: a synthetic set of this many users, a random model")
    p.add_argument("--cores", default="1,2", help="local Spark executor cores to time, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--workdir", type=Path, default=Path("out/recommend_bench"))
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.synthetic_users:
        prepared, model = synthetic(args.synthetic_users, args.workdir)
    else:
        prepared, model = args.input, args.model
    import pyarrow.parquet as pq

    users = pq.ParquetDataset(str(prepared / "sequences")).read(columns=["user_id"]).num_rows
    print(f"`python -m benchmarks.recommend_bench {' '.join(argv if argv is not None else sys.argv[1:])}`, commit "
          f"{commit()}, {platform.node()} ({os.cpu_count()} CPUs); {users} users, k {args.k}, model {model}\n")
    print("| executor cores | seconds (median) | [min, max] | users/s | users/s per core |\n| --- | --- | --- | --- | --- |")
    for cores in [int(c) for c in args.cores.split(",")]:
        seconds = timed_runs(model, prepared, cores, args.repeats, args.workdir, args.k)
        median = statistics.median(seconds)
        print(f"| {cores} | {median:.2f} | [{min(seconds):.2f}, {max(seconds):.2f}] | {users / median:.0f} | "
              f"{users / median / cores:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
