"""Model quality of real 2-rank training under both evaluation protocols, beside most-popular.

MovieLens-100K (with its user features), 2 gloo ranks, `configs/ml100k.toml`, the shards
of the bubble benchmark (`contiguous` and `balanced`, built by the real jobs), one run per
training seed and shard set. Each run is evaluated with `evaluation.sampled_negatives` (100
by default), so one run gives both protocols: the full-catalog ranking (`hr_at_10`, ...)
and SASRec's (the held-out item against 100 items its user never interacted with:
`sampled_hr_at_10`, ...), and the most-popular baseline under each. A user's negatives
depend on the training seed and the user only, so both shard sets rank against the same
negatives for a seed.

Target: the model beats most-popular on every metric under both protocols, in every run.

Usage: python benchmarks/quality_bench.py [--repeats 3] [--epochs 4] [--sampled-negatives 100]
                                         [--workdir out/quality-bench] [--report-only]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bubble_bench  # noqa: E402  (the shards and the training runs are the bubble benchmark's)

SHARDS = ("contiguous", "balanced")
METRICS = (("hr_at_10", "HR@10"), ("ndcg_at_10", "NDCG@10"), ("mrr", "MRR"))
PROTOCOLS = (("", "full catalog"), ("sampled_", "{n} sampled negatives"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bubble_bench.add_run_arguments(parser, "out/quality-bench")
    parser.add_argument("--sampled-negatives", type=int, default=100,
                        help="evaluation.sampled_negatives of every run (default 100, SASRec's)")
    parser.add_argument("--config", default="configs/ml100k.toml", help="the runs' training config")
    args = parser.parse_args()
    if args.sampled_negatives < 1:
        parser.error(f"--sampled-negatives must be >= 1 (the benchmark compares two protocols), "
                     f"got {args.sampled_negatives}")
    # The bubble benchmark's shard options this benchmark keeps at their defaults.
    args.user_features, args.user_feature_cols = True, "age,gender,occupation,zip_code"
    work = (REPO / args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results: dict[str, list[dict]] = {name: [] for name in SHARDS}
    if args.report_only:
        for rep in range(args.repeats):
            for name in SHARDS:
                results[name].append(json.loads((work / f"{name}-{rep}.json").read_text())["summary"])
        steps = int(results["balanced"][0]["measured_steps"]) + 2
    else:
        shards = bubble_bench.build_shards(work, args)
        steps = args.epochs * json.loads((shards["balanced"] / "manifest.json").read_text())["num_steps"]
        for rep in range(args.repeats):
            for name in SHARDS:
                summary = bubble_bench.train(shards[name], steps, rep, work / f"{name}-{rep}.json", args,
                                             "--config", args.config,
                                             "--evaluation.sampled_negatives", str(args.sampled_negatives))
                results[name].append(summary)
                print(f"seed {rep} {name:10s} hr@10 {summary['hr_at_10']:.4f} (most-popular "
                      f"{summary['popular_hr_at_10']:.4f})  sampled hr@10 {summary['sampled_hr_at_10']:.4f} "
                      f"(most-popular {summary['popular_sampled_hr_at_10']:.4f})", flush=True)

    first = results["balanced"][0]
    print(f"\n#### Model quality: MovieLens-100K, 2 gloo ranks x {args.local_batch_size} samples, {steps} steps, "
          f"{args.repeats} seeds (median [min, max]), {int(first['eval_samples'])} test users\n")
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; config {args.config}; "
          f"evaluation.sampled_negatives {args.sampled_negatives}\n")
    header = " | ".join(label for _, label in METRICS)
    print(f"| protocol | shards | {header} | most-popular {' | most-popular '.join(l for _, l in METRICS)} |")
    print("|" + " --- |" * (2 + 2 * len(METRICS)))
    beaten = True
    for prefix, protocol in PROTOCOLS:
        for name in SHARDS:
            rows = results[name]
            model = [bubble_bench.spread([r[f"{prefix}{key}"] for r in rows]) for key, _ in METRICS]
            popular = [bubble_bench.spread([r[f"popular_{prefix}{key}"] for r in rows]) for key, _ in METRICS]
            beaten &= all(r[f"{prefix}{key}"] > r[f"popular_{prefix}{key}"] for r in rows for key, _ in METRICS)
            print(f"| {protocol.format(n=args.sampled_negatives)} | {name} | {' | '.join(model)} | "
                  f"{' | '.join(popular)} |")
    print(f"\nthe model beats most-popular on every metric, protocol and run: {'yes' if beaten else 'NO'}")
    print(f"\n(total {time.time() - started:.0f} s; per-run logs and summaries in {work})")


if __name__ == "__main__":
    main()
