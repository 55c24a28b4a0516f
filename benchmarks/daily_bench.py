"""Daily training (issue 47): day 2 on top of day 1 against a full re-run of days 1+2, in wall time and
in model quality.

MovieLens-100K cut by timestamp at its 80th and 90th percentiles: day 1 (the first 80% of the events),
day 2 (the next 10%) and the test part (the last 10%). For each seed:

- **day by day**: `freescale pipeline` in incremental mode over a folder holding day 1, then again
  with day 2 added. The second run prepares day 2 on top of day 1's output (`prepare --previous`),
  balances its samples, trains from day 1's checkpoint (`--init-from`), exports, registers and
  promotes. Its wall time is day 2's cost.
- **from scratch**: `freescale pipeline` (plain) over days 1+2 as one file: prepare, balance, train
  from random weights, export. Its wall time is the full re-run's cost.

Both train the same model and recipe (``--config``, default configs/ml100k.toml) for the same number
of epochs over their samples (``--epochs``, ``training.max_epochs``); day by day trains day 1's samples,
then day 2's touched users. Each stage's seconds come from its MLflow run. Both models are scored on the test part by the same code (freescale/jobs/workflow/promote.py's
``ranking_metrics``): every user with an event in it and one before it; the history is all of that
user's events before the test part, the target their first event in it, ranked among the whole
catalog with the history left out (full-catalog HR@10 and NDCG@10). Each model reads the raw ids
through its own vocabulary.

Usage (from the repository root): python -m benchmarks.daily_bench [--seeds 0,1,2] [--epochs 10]
    [--workdir out/daily-bench] [--config configs/ml100k.toml] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import MOVIELENS, REPO, freescale, run

TRAIN_KEYS = {"training.log_every": 50, "checkpoint.every_steps": 100000, "evaluation.sampled_negatives": 0}


def split(work: Path) -> dict[str, Path]:
    """MovieLens-100K cut at its 80th and 90th percentile timestamps: day1, day2, days 1+2 and test files."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(MOVIELENS)
    p80, p90 = (float(x) for x in np.percentile(table["timestamp"].to_numpy(), [80, 90]))
    ts = table["timestamp"]
    parts = {"day1": table.filter(pc.less_equal(ts, p80)),
             "day2": table.filter(pc.and_(pc.greater(ts, p80), pc.less_equal(ts, p90))),
             "test": table.filter(pc.greater(ts, p90))}
    parts["both"] = pa.concat_tables([parts["day1"], parts["day2"]])
    paths = {}
    for name, part in parts.items():
        folder = work / "data" / ("days" if name.startswith("day") else name)
        folder.mkdir(parents=True, exist_ok=True)
        paths[name] = folder / f"{name}.parquet"
        pq.write_table(part, paths[name])
    return paths


def held_out(paths: dict[str, Path]):
    """The test part's queries: per user with events before and in it, every event before it (raw ids, oldest
    first) and the first one in it."""
    import pyarrow.parquet as pq

    from freescale.jobs.workflow.promote import HeldOut

    def events(path: Path) -> dict[int, list[tuple[int, int, int]]]:
        found: dict[int, list[tuple[int, int, int]]] = {}
        rows = pq.read_table(path).to_pydict()
        for user, item, rating, ts in zip(rows["user_id"], rows["movie_id"], rows["rating"], rows["timestamp"]):
            found.setdefault(user, []).append((ts, item, rating))
        return {user: sorted(e) for user, e in found.items()}

    before, after = events(paths["both"]), events(paths["test"])
    users = sorted(set(before) & set(after))
    return HeldOut([[str(i) for _, i, _ in before[u]] for u in users], [[t for t, _, _ in before[u]] for u in users],
                   [[r for _, _, r in before[u]] for u in users], [str(after[u][0][1]) for u in users])


def pipeline_toml(work: Path, uri: str, input_path: Path, args, seed: int, incremental: bool) -> Path:
    overrides = {**TRAIN_KEYS, "training.seed": seed, "training.max_epochs": args.epochs}
    lines = ["[pipeline]", f'workdir = "{work}"', f'tracking_uri = "{uri}"', "world_size = 2",
             f"local_batch_size = {args.local_batch_size}", f"incremental = {str(incremental).lower()}",
             "[prepare]", f'input = "{input_path}"', "[balance]", 'strategy = "kk"', 'leftover = "keep"',
             "[export]", "enabled = true", f'register = "daily-{seed}"' if incremental else "",
             "[train]", f'config = "{Path(args.config).resolve()}"', "[train.overrides]",
             *(f"{k} = {json.dumps(v)}" for k, v in overrides.items())]
    path = work.parent / f"{work.name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def timed_pipeline(config: Path, log: Path) -> float:
    started = time.perf_counter()
    run(freescale("pipeline", "--config", str(config)), log)
    return time.perf_counter() - started


def one_seed(seed: int, paths: dict[str, Path], queries, args, root: Path) -> dict:
    from freescale.jobs.workflow.promote import ranking_metrics

    root.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    shutil.copy2(paths["day1"], logs / "2026-12-01.parquet")
    inc = pipeline_toml(root / "daily", uri, logs, args, seed, True)
    day1_s = timed_pipeline(inc, root / "day1.log")
    shutil.copy2(paths["day2"], logs / "2026-12-02.parquet")
    day2_s = timed_pipeline(inc, root / "day2.log")
    scratch = pipeline_toml(root / "scratch", uri, paths["both"], args, seed, False)
    full_s = timed_pipeline(scratch, root / "scratch.log")
    daily = ranking_metrics(root / "daily" / "days" / "2026-12-02" / "model", queries)
    fresh = ranking_metrics(root / "scratch" / "model", queries)
    return {"seed": seed, "day1_s": day1_s, "day2_s": day2_s, "full_rerun_s": full_s,
            "daily_hr_at_10": daily["hr_at_10"], "daily_ndcg_at_10": daily["ndcg_at_10"],
            "scratch_hr_at_10": fresh["hr_at_10"], "scratch_ndcg_at_10": fresh["ndcg_at_10"],
            "test_users": int(daily["users"]), "stage_s": stage_seconds(root)}


def stage_seconds(seed_dir: Path) -> dict[str, dict[str, float]]:
    """Each pipeline's stages' seconds, from their MLflow runs' start and end times: {pipeline: {job: s}}
    for day 1, day 2 and the full re-run of a seed's folder."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{seed_dir / 'mlflow.db'}")
    names = {"daily/days/2026-12-01": "day 1", "daily/days/2026-12-02": "day 2", "scratch": "full re-run"}
    found: dict[str, dict[str, float]] = {}
    for experiment in client.search_experiments():
        for found_run in client.search_runs([experiment.experiment_id], max_results=1000):
            where = found_run.data.tags.get("freescale.pipeline", "")
            job = found_run.data.tags.get("freescale.job", "")
            name = next((label for suffix, label in names.items() if where.endswith(suffix)), None)
            if name and job and job != "pipeline" and found_run.info.end_time:
                found.setdefault(name, {})[job] = (found_run.info.end_time - found_run.info.start_time) / 1000
    return found


def table(rows: list[dict]) -> str:
    keys = ("day1_s", "day2_s", "full_rerun_s", "daily_hr_at_10", "scratch_hr_at_10", "daily_ndcg_at_10",
            "scratch_ndcg_at_10")
    out = ["| seed | day 1 s | day 2 s | full re-run s | HR@10 day by day | HR@10 scratch | NDCG@10 day by day "
           "| NDCG@10 scratch |", "|---|" + "---|" * len(keys)]
    for row in rows:
        out.append(f"| {row['seed']} | " + " | ".join(f"{row[k]:.1f}" if k.endswith("_s") else f"{row[k]:.4f}"
                                                     for k in keys) + " |")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    out.append("| median | " + " | ".join(f"{med[k]:.1f}" if k.endswith("_s") else f"{med[k]:.4f}" for k in keys)
               + " |")
    out.append(f"\nday 2 / full re-run wall time: {med['day2_s'] / med['full_rerun_s']:.2f}x "
               f"(medians); test users: {rows[0]['test_users']}\n")
    jobs = ("prepare", "balance", "train", "export", "promote")
    out += ["| seconds per stage (median of seeds) | " + " | ".join(jobs) + " |", "|---|" + "---|" * len(jobs)]
    for run_name in ("day 1", "day 2", "full re-run"):
        cells = [statistics.median(r["stage_s"].get(run_name, {}).get(job, 0.0) for r in rows) for job in jobs]
        out.append(f"| {run_name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=int, default=10, help="passes over each run's samples")
    p.add_argument("--local-batch-size", type=int, default=16)
    p.add_argument("--config", default=str(REPO / "configs" / "ml100k.toml"))
    p.add_argument("--workdir", default="out/daily-bench")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    work = Path(args.workdir).resolve()
    if work.exists():
        shutil.rmtree(work)
    paths = split(work)
    queries = held_out(paths)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        rows.append(one_seed(seed, paths, queries, args, work / f"seed-{seed}"))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

