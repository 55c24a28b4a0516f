"""Model quality: HSTU against the SASRec baseline and most-popular, trained by the same trainer
with the same recipe, under both evaluation protocols, over several seeds.

MovieLens-100K (with its user features), 2 gloo ranks on kk-balanced shards built by the real
jobs, `configs/ml100k_recipe.toml` (validation every pass, early stopping on the validation
item's sampled NDCG@10 with patience, the best epoch's weights tested); the SASRec runs add
`--model.encoder sasrec` and nothing else. Each run is scored by the full-catalog ranking
(`ndcg_at_10`, ...) and SASRec's protocol (the held-out item against 100 items its user never
interacted with: `sampled_ndcg_at_10`, ...); most-popular is scored on the same queries and
negatives (the same for every model of a seed).

Targets (issue 16): SASRec beats most-popular under both protocols; HSTU beats SASRec on NDCG@10
under both protocols by more than the seed spread.

Usage (from the repository root): python -m benchmarks.quality_bench [--repeats 3] [--local-batch-size 32]
           [--models hstu,sasrec] [--workdir out/quality-bench] [--report-only] [--section.key=value ...]

``--models hstu`` trains one model only (a sweep's probe of that model's settings; the comparison
lines need both).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from benchmarks.common import REPO, add_run_arguments, build_shards, spread, train

CONFIG = "configs/ml100k_recipe.toml"
MODELS = {"hstu": [], "sasrec": ["--model.encoder", "sasrec"]}
METRICS = (("ndcg_at_10", "NDCG@10"), ("hr_at_10", "HR@10"), ("mrr", "MRR"))
PROTOCOLS = (("", "full catalog"), ("sampled_", "100 sampled negatives"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "out/quality-bench")
    parser.set_defaults(local_batch_size=32)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"which models to train, comma-separated (default {','.join(MODELS)})")
    args, args.overrides = parser.parse_known_args()  # the rest: config overrides for every run
    names = args.models.split(",")
    if not set(names) <= set(MODELS):
        parser.error(f"--models: choose from {', '.join(MODELS)}, got {args.models!r}")
    models = {name: MODELS[name] for name in names}
    args.user_features, args.user_feature_cols = True, "age,gender,occupation,zip_code"
    work = (REPO / args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results: dict[str, list[dict]] = {name: [] for name in models}
    minutes: dict[str, list[float]] = {name: [] for name in models}
    shards = None if args.report_only else build_shards(work, args)["balanced"]
    for rep in range(args.repeats):
        for name, extra in models.items():
            out = work / f"{name}-{rep}.json"
            if not args.report_only:
                began = time.time()
                train(shards, 0, rep, out, args, "--config", CONFIG, *extra, *args.overrides)
                minutes[name].append((time.time() - began) / 60)
            summary = json.loads(out.read_text())["summary"]
            results[name].append(summary)
            print(f"seed {rep} {name:7s} best epoch {summary['best_epoch']:.0f}  ndcg@10 {summary['ndcg_at_10']:.4f}  "
                  f"sampled ndcg@10 {summary['sampled_ndcg_at_10']:.4f}", flush=True)
    report(results, minutes, args, work, time.time() - started)


def report(results: dict[str, list[dict]], minutes: dict[str, list[float]], args, work: Path,
           total_s: float) -> None:
    first_rows = next(iter(results.values()))  # most-popular is scored on every run's queries alike
    first = first_rows[0]
    print(f"\n#### Model quality: MovieLens-100K, 2 gloo ranks x {args.local_batch_size} samples, "
          f"{args.repeats} seeds (median [min, max]), {int(first['eval_samples'])} test users\n")
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; config {CONFIG} "
          f"{' '.join(args.overrides)}\n")
    # The validation score early stopping followed (evaluation.metric): what a sweep chooses by.
    chosen = next((k for k in first if k.startswith("best_valid")), None)
    print(f"| protocol | model | {' | '.join(label for _, label in METRICS)} | best epoch | "
          f"{chosen.removeprefix('best_') if chosen else 'validation'} at it | minutes |")
    print("|" + " --- |" * (5 + len(METRICS)))
    for prefix, protocol in PROTOCOLS:
        for name, rows in results.items():
            cells = [spread([r[f"{prefix}{key}"] for r in rows]) for key, _ in METRICS]
            extra = [spread([r["best_epoch"] for r in rows]).replace(".0000", ""),
                     spread([r[chosen] for r in rows]) if chosen else "-",
                     spread(minutes[name]) if minutes[name] else "-"]
            print(f"| {protocol} | {name} | {' | '.join(cells)} | {' | '.join(extra)} |")
        cells = [spread([r[f"popular_{prefix}{key}"] for r in first_rows]) for key, _ in METRICS]
        print(f"| {protocol} | most-popular | {' | '.join(cells)} | - | - | - |")
    print()
    for prefix, protocol in PROTOCOLS if set(results) == set(MODELS) else ():
        key = f"{prefix}ndcg_at_10"
        sasrec = [r[key] for r in results["sasrec"]]
        popular = [r[f"popular_{key}"] for r in results["sasrec"]]
        hstu = [r[key] for r in results["hstu"]]
        spread_width = max(max(hstu) - min(hstu), max(sasrec) - min(sasrec))
        gap = sorted(hstu)[len(hstu) // 2] - sorted(sasrec)[len(sasrec) // 2]
        print(f"- {protocol}: SASRec beats most-popular in every run: "
              f"{'yes' if all(s > p for s, p in zip(sasrec, popular)) else 'NO'}; HSTU - SASRec median NDCG@10 "
              f"{gap:+.4f}, seed spread {spread_width:.4f}: HSTU ahead by more than the spread: "
              f"{'yes' if gap > spread_width else 'NO'}")
    print(f"\n(total {total_s:.0f} s; per-run logs and summaries in {work})")


if __name__ == "__main__":
    main()
