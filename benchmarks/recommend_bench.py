"""Benchmark: `freescale recommend`'s scoring speed, users per second per core.

Usage (from the repository root):
    python -m benchmarks.recommend_bench --worker-users 100000,1000000 --baseline c32ca2f --profile
    python -m benchmarks.recommend_bench --model out/ml100k/model --input out/ml100k/prepared --cores 1,2
    python -m benchmarks.recommend_bench --synthetic-users 100000 --cores 1,2     # a synthetic set and model

``--worker-users``: what one executor core's Python worker does, in this process with torch at one
thread as a worker runs it: the job's ``mapInArrow`` function (``spark_recommend.scorer``) on Arrow
record batches of ``--batch-users`` (Spark's ``maxRecordsPerBatch``, 10,000) synthetic prepared
sequences -- histories built, scored, top k, the output batch -- the seconds of the calls summed over
every batch (wall-clock, and the process's CPU time: on a shared machine the steadier of the two), the
median of ``--repeats``. The sequences are made batch by batch from a seed (not
timed): prepare's synthetic lengths (log-normal, median ~67, 20..1024) and Zipf items over
``--items`` items; the model a random export folder of ``configs/demo.toml``'s shape (the speed does
not depend on the weights' values). ``--baseline REV`` times REV's `freescale` package on the same
batches in the same run (``git archive REV freescale`` into ``--workdir``; a REV that scores
``mapInPandas`` gets its batches as pandas and its output converted back to Arrow, as Spark's worker
does for it), at the sizes of ``--baseline-users``, and says whether its output is bitwise this tree's.
``--profile`` splits one pass of each tree's work into its phases.

``--same-as REV`` (with ``--model`` and ``--input``): runs the whole job, `freescale recommend`, with this
tree's code and with REV's on local Spark, and compares the two Parquet outputs: schema, rows, order, score
bits (``--k``, and ``--exclude-history false`` too).

Without ``--worker-users`` each row times the job's Spark work -- ship the model, score every user and
write the Parquet output -- on ``local[c]`` (c executor cores), the median of ``--repeats``; the JVM's
start and the model's resolution are not in it (the job's own ``job_seconds`` metric has them). With
``--synthetic-users N`` the data is `freescale prepare`'s seeded synthetic set of N users (made once in
``--workdir``) and the model a random demo-shaped one over its items.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, commit, freescale, run

OUTPUT_COLUMNS = ("user_id", "items", "scores")


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
    from freescale.prepare.prepared import read_metadata
    from freescale.training.export.exporter import read_vocabulary

    meta = read_metadata(prepared)
    vocab = read_vocabulary(prepared, meta["num_items"], [f["num_ids"] for f in meta.get("user_features", [])])
    write_random_model(vocab, config_file, out)


def write_random_model(vocab, config_file: Path, out: Path) -> None:
    """An export folder of a randomly initialised model of ``config_file``'s shape over ``vocab``."""
    from types import SimpleNamespace

    import torch

    from freescale.training.config import load_config
    from freescale.training.export.exporter import Source, write_folder
    from freescale.training.export.exported_model import ITEM_TABLE, USER_TABLE, dense_model

    torch.manual_seed(0)
    config = load_config(str(config_file), [])
    num_items = len(vocab.raw_items) - 1
    model = dense_model(num_items, config.model, vocab.features, config.training.precision)
    dim = config.model.embedding_dim
    state = {ITEM_TABLE: torch.randn(num_items + 1, dim),
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


def spark_table(args: argparse.Namespace) -> None:
    import pyarrow.parquet as pq

    if args.synthetic_users:
        prepared, model = synthetic(args.synthetic_users, args.workdir)
    else:
        prepared, model = args.input, args.model
    users = pq.ParquetDataset(str(prepared / "sequences")).read(columns=["user_id"]).num_rows
    print(f"{users} users, k {args.k}, model {model}\n")
    print("| executor cores | seconds (median) | [min, max] | users/s | users/s per core |\n| --- | --- | --- | --- | --- |")
    for cores in [int(c) for c in args.cores.split(",")]:
        seconds = timed_runs(model, prepared, cores, args.repeats, args.workdir, args.k)
        median = statistics.median(seconds)
        print(f"| {cores} | {median:.2f} | [{min(seconds):.2f}, {max(seconds):.2f}] | {users / median:.0f} | "
              f"{users / median / cores:.0f} |", flush=True)


# ---------------------------------------------------------------- one Python worker, in this process

DEMO_MAX_HISTORY = 1025  # prepare's default max_seq_len (1024) + the validation item: what export records


def synthetic_model(items: int, workdir: Path) -> Path:
    """A random demo-shaped export folder over ``items`` items, popularity by id as prepare numbers them."""
    from freescale.training.export.exporter import Vocabulary

    out = workdir / f"worker-model-{items}i"
    if not out.exists():
        raw = [None, *(str(i) for i in range(1, items + 1))]
        counts = [None, *range(items, 0, -1)]
        write_random_model(Vocabulary(workdir, raw, [], {}, DEMO_MAX_HISTORY, counts), REPO / "configs" / "demo.toml",
                           out)
    return out


def synthetic_batch(index: int, users: int, items: int, seed: int):
    """Batch ``index`` of synthetic prepared sequences (prepare's column types): log-normal lengths (mu 4.2,
    sigma 0.9, 20..1024 interactions: the last two the targets), Zipf(1.1) items, ratings 1..5."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng([seed, index])
    total = np.clip(np.rint(np.exp(4.2 + 0.9 * rng.standard_normal(users))), 20, 1024).astype(np.int64)
    n = int(total.sum())
    top = float(items + 1)
    ids = np.minimum(np.floor(((top ** -0.1 - 1) * rng.random(n) + 1) ** (1 / -0.1)), items).astype(np.int32)
    gaps = np.repeat(rng.integers(60, 86_400, users), total)
    times = np.cumsum(gaps) + 1_600_000_000
    ratings = rng.integers(1, 6, n).astype(np.float32)
    ends = np.cumsum(total)
    train = np.ones(n, bool)
    train[ends - 1] = train[ends - 2] = False
    offsets = pa.array(np.concatenate([[0], np.cumsum(total - 2)]).astype(np.int32))

    def listed(values, kind):
        return pa.ListArray.from_arrays(offsets, pa.array(values[train], kind))

    return pa.RecordBatch.from_arrays(
        [pa.array([f"u{index}-{u}" for u in range(users)]), listed(ids, pa.int32()), listed(times, pa.int64()),
         listed(ratings, pa.float32()), pa.array(ids[ends - 2]), pa.array(times[ends - 2]), pa.array(ratings[ends - 2]),
         pa.array(ids[ends - 1]), pa.array(times[ends - 1])],
        names=["user_id", "items", "timestamps", "ratings", "valid_item", "valid_timestamp", "valid_rating",
               "test_item", "test_timestamp"])


def worker_run(spec: dict) -> dict:
    """In the subprocess: the seconds of every repeat (and the phases, and the output's digest) of the
    ``freescale`` package first on the path scoring ``spec["users"]`` synthetic users."""
    import hashlib

    import torch

    from freescale.training.export import spark_recommend
    from freescale.training.export.exported_model import ExportedModel

    torch.set_num_threads(1)
    spark_recommend._LOADED["bench"] = ExportedModel(spec["model"])
    arrow_native = hasattr(spark_recommend, "history_batch")
    call = batch_call(spark_recommend.scorer("bench", spec["k"], True), arrow_native)
    sizes = [min(spec["batch_users"], spec["users"] - start) for start in range(0, spec["users"], spec["batch_users"])]
    seconds, cpu_seconds, digest = [], [], hashlib.sha256()
    for repeat in range(spec["repeats"]):
        took = cpu = 0.0
        for index, size in enumerate(sizes):
            batch = synthetic_batch(index, size, spec["items"], spec["seed"])
            started, cpu_started = time.perf_counter(), time.process_time()
            out = call(batch)
            took, cpu = took + time.perf_counter() - started, cpu + time.process_time() - cpu_started
            if repeat == 0:
                digest.update(output_bytes(out))
        seconds.append(took)
        cpu_seconds.append(cpu)
    phases = (new_phases if arrow_native else old_phases)(spec, sizes) if spec["profile"] else {}
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "digest": digest.hexdigest(), "phases": phases}


def batch_call(score, arrow_native: bool):
    """One record batch through the job's function as Spark's worker calls it: Arrow in and out; a
    ``mapInPandas`` function's batch converted to pandas and its output back to Arrow."""
    import pyarrow as pa

    if arrow_native:
        return lambda batch: pa.Table.from_batches(list(score(iter([batch]))))
    schema = pa.schema([("user_id", pa.string()), ("items", pa.list_(pa.string())), ("scores", pa.list_(pa.float32()))])
    return lambda batch: pa.Table.from_batches([pa.RecordBatch.from_pandas(frame, schema=schema, preserve_index=False)
                                                for frame in score(iter([batch.to_pandas()]))])


def output_bytes(table) -> bytes:
    """The output's users, items, list lengths and score bits, in order: equal bytes, equal outputs."""
    import numpy as np

    assert table.column_names == list(OUTPUT_COLUMNS), table.column_names
    items, scores = table.column("items").combine_chunks(), table.column("scores").combine_chunks()
    return b"".join([
        "\n".join(table.column("user_id").to_pylist()).encode(), "\n".join(items.flatten().to_pylist()).encode(),
        np.asarray(items.value_lengths().to_numpy(), np.int64).tobytes(),
        np.asarray(scores.value_lengths().to_numpy(), np.int64).tobytes(),
        np.asarray(scores.flatten().to_numpy(), np.float32).tobytes()])


def new_phases(spec: dict, sizes: list[int]) -> dict[str, float]:
    """One pass of the Arrow path, phase by phase (the job's own functions, called one after the other)."""
    import torch

    with torch.no_grad():
        return _new_phases(spec, sizes)


def _new_phases(spec: dict, sizes: list[int]) -> dict[str, float]:
    import pyarrow as pa
    import torch

    from freescale.training.export.spark_recommend import _LOADED, history_batch, recommendation_batch

    model = _LOADED["bench"]
    raw_items, phases = pa.array(model.raw_items, pa.string()), dict.fromkeys(
        ("histories (Arrow/NumPy)", "encoder + score matrix", "top-k", "output batch (Arrow)"), 0.0)
    width = min(spec["k"], model.num_items)
    for index, size in enumerate(sizes):
        batch = synthetic_batch(index, size, spec["items"], spec["seed"])
        clock = time.process_time()
        histories = history_batch(batch, model.max_history)
        clock = _lap(phases, "histories (Arrow/NumPy)", clock)
        found = []
        for start in range(0, len(histories), model.chunk_users):
            scores = model.scores(histories.rows(start, min(start + model.chunk_users, len(histories))), True)
            clock = _lap(phases, "encoder + score matrix", clock)
            found.append(torch.topk(scores, width, dim=1))
            clock = _lap(phases, "top-k", clock)
        recommendation_batch(batch.column("user_id"), torch.cat([f.values for f in found]).numpy(),
                             torch.cat([f.indices for f in found]).numpy(), raw_items)
        _lap(phases, "output batch (Arrow)", clock)
    return phases


def old_phases(spec: dict, sizes: list[int]) -> dict[str, float]:
    """One pass of the per-user path (``mapInPandas``), phase by phase."""
    import pandas as pd
    import pyarrow as pa

    from freescale.training.export.spark_recommend import _LOADED, histories

    model = _LOADED["bench"]
    phases = dict.fromkeys(("input to pandas", "histories (per user)", "rank (tensors, encoder, scores, top-k, lists)",
                            "output to Arrow"), 0.0)
    for index, size in enumerate(sizes):
        batch = synthetic_batch(index, size, spec["items"], spec["seed"])
        clock = time.process_time()
        frame = batch.to_pandas()
        clock = _lap(phases, "input to pandas", clock)
        found = histories(frame, model.max_history)
        clock = _lap(phases, "histories (per user)", clock)
        ranked = model.rank(found, spec["k"], True)
        clock = _lap(phases, "rank (tensors, encoder, scores, top-k, lists)", clock)
        pa.RecordBatch.from_pandas(pd.DataFrame({"user_id": frame["user_id"].astype(str),
                                                 "items": [r.items for r in ranked],
                                                 "scores": [r.scores for r in ranked]}), preserve_index=False)
        _lap(phases, "output to Arrow", clock)
    return phases


def _lap(phases: dict[str, float], name: str, started: float) -> float:
    now = time.process_time()
    phases[name] += now - started
    return now


def baseline_tree(rev: str, workdir: Path) -> Path:
    """REV's ``freescale`` package alone (the benchmarks stay this tree's), extracted once into ``workdir``."""
    tree = workdir / f"baseline-{rev}"
    if not (tree / "freescale").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "freescale"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def in_subprocess(code: Path, spec: dict) -> dict:
    """``worker_run(spec)`` in a fresh interpreter with ``code``'s ``freescale`` package first on the path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    program = (f"import sys, json; sys.path.insert(0, {str(code)!r}); from benchmarks.recommend_bench import worker_run;"
               f" print(json.dumps(worker_run(json.loads(sys.argv[1]))))")
    done = subprocess.run([sys.executable, "-c", program, json.dumps(spec)], cwd=REPO, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"the worker failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker_table(args: argparse.Namespace) -> None:
    model = synthetic_model(args.items, args.workdir)
    baseline = baseline_tree(args.baseline, args.workdir) if args.baseline else None
    runs = [("this tree", REPO, users) for users in args.worker_users]
    runs += [(f"{args.baseline} (baseline)", baseline, users) for users in args.baseline_users] if baseline else []
    print(f"model: demo shape (HSTU 1 layer, dim 32), {args.items} items, max_history {DEMO_MAX_HISTORY}; k {args.k}, "
          f"history excluded; batches of {args.batch_users} users; torch at 1 thread\n")
    print("| code | users | seconds (median) | [min, max] | users/s per core | CPU seconds (median) | "
          "users per CPU second | output sha256 |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    results = {}
    for name, code, users in runs:
        spec = {"model": str(model), "users": users, "items": args.items, "batch_users": args.batch_users,
                "repeats": args.repeats, "k": args.k, "seed": 0, "profile": args.profile and users == min(
                    u for n, _, u in runs if n == name)}
        result = results[name, users] = in_subprocess(code, spec)
        median, cpu = statistics.median(result["seconds"]), statistics.median(result["cpu_seconds"])
        print(f"| {name} | {users:,} | {median:.2f} | [{min(result['seconds']):.2f}, {max(result['seconds']):.2f}] | "
              f"{users / median:,.0f} | {cpu:.2f} | {users / cpu:,.0f} | {result['digest'][:16]} |", flush=True)
    for (name, users), result in results.items():
        if name != "this tree" and ("this tree", users) in results:
            same = result["digest"] == results["this tree", users]["digest"]
            print(f"\n{name} at {users:,} users: output {'bitwise identical' if same else 'DIFFERENT'} to this tree's")
    for (name, users), result in results.items():
        if result["phases"]:
            total = sum(result["phases"].values())
            print(f"\nPhases of {name} at {users:,} users (one pass, {total:.1f} CPU s):\n\n| phase | CPU seconds | share |\n"
                  "| --- | --- | --- |")
            for phase, took in result["phases"].items():
                print(f"| {phase} | {took:.2f} | {took / total:.0%} |")


def same_as(args: argparse.Namespace) -> None:
    """The job's output with this tree's code and with ``--same-as``'s, on the same model and input."""
    import pyarrow.parquet as pq

    trees = {"this tree": REPO, args.same_as: baseline_tree(args.same_as, args.workdir)}
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for exclude in ("true", "false"):
        tables = {}
        for name, tree in trees.items():
            out = args.workdir / f"same-as-{name.replace(' ', '-')}-{exclude}"
            shutil.rmtree(out, ignore_errors=True)
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "freescale.jobs.cli", "recommend", "--model", str(args.model.resolve()),
                            "--input", str(args.input.resolve()), "--output", str(out), "--k", str(args.k),
                            "--exclude-history", exclude, "--tracking-uri", "none"],
                           cwd=tree, env={**env, "PYTHONPATH": str(tree)}, check=True, capture_output=True)
            tables[name] = pq.read_table(out)
            print(f"{name}: {tables[name].num_rows} users, --exclude-history {exclude}, "
                  f"{time.perf_counter() - started:.0f} s (the JVM's start included)")
        ours, theirs = tables.values()
        same = (ours.schema.equals(theirs.schema, check_metadata=True) and ours.equals(theirs)
                and output_bytes(ours) == output_bytes(theirs))
        print(f"--exclude-history {exclude}: schema, rows, order and score bits "
              f"{'identical' if same else 'DIFFERENT'} ({ours.num_rows} rows, "
              f"{sum(len(i) for i in ours.column('items').to_pylist())} items)\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="an export folder (with --input)")
    p.add_argument("--input", type=Path, help="the prepare output of the model's vocabulary")
    p.add_argument("--synthetic-users", type=int, help="instead: a synthetic set of this many users, a random model")
    p.add_argument("--cores", default="1,2", help="local Spark executor cores to time, comma-separated")
    p.add_argument("--worker-users", help="instead of Spark: one worker's users/s at these sizes, comma-separated")
    p.add_argument("--baseline", help="with --worker-users: also this git revision's code, in the same run")
    p.add_argument("--baseline-users", help="the sizes to time the baseline at (default: the smallest)")
    p.add_argument("--profile", action="store_true", help="with --worker-users: the phases of one pass")
    p.add_argument("--same-as", metavar="REV", help="with --model and --input: the job's output equals REV's?")
    p.add_argument("--items", type=int, default=10_000, help="with --worker-users: the catalog's size")
    p.add_argument("--batch-users", type=int, default=10_000, help="users per Arrow batch (Spark's default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--workdir", type=Path, default=Path("out/recommend_bench"))
    args = p.parse_args(argv)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"`python -m benchmarks.recommend_bench {' '.join(argv if argv is not None else sys.argv[1:])}`, commit "
          f"{commit()}, {platform.node()} ({os.cpu_count()} CPUs)\n")
    if args.worker_users:
        args.worker_users = [int(u) for u in args.worker_users.split(",")]
        args.baseline_users = ([int(u) for u in args.baseline_users.split(",")] if args.baseline_users
                               else [min(args.worker_users)])
        worker_table(args)
    elif args.same_as:
        same_as(args)
    else:
        spark_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
