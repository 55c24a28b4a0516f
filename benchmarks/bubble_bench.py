"""Measured bubbles of real 2-rank training: contiguous vs balanced shards vs the mirror control.

Same data (MovieLens-100K), same steps, same training seed per repeat. The four
shard sets come from the real jobs: `contiguous` (what every framework does),
`balanced` (--strategy, default kk, with the cost model and rank capacities from
`freescale calibrate` when --calibrate is given), `flops_kk` (the peer's online
balancer: Karmarkar-Karp on FLOPs per global batch, equal counts, no windows) and
`control` (--control mirror: every rank holds the same samples each step, so its
bubble is this machine's noise floor). Runs alternate (contiguous, balanced,
flops_kk, control, contiguous, ...) so drift in machine load hits all alike. Each run's bubble fraction is measured
on the ranks (all-gathered per-step dense compute, wall and thread-CPU clocks).

Target: bubble(balanced) - bubble(control) <= 0.1 x (bubble(contiguous) - bubble(control)),
i.e. balancing removes at least 90% of the removable bubble. Quality: HR@10 and
NDCG@10 of contiguous and balanced agree within the spread across seeds and beat
the most-popular baseline.

Usage (from the repository root): python -m benchmarks.bubble_bench [--repeats 3] [--epochs 4]
           [--local-batch-size 16] [--calibrate] [--strategy kk] [--no-user-features] [--workdir out/bubble-bench]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import typing

from benchmarks.common import REPO, add_run_arguments, build_shards, spread, train

VARIANTS = ("contiguous", "balanced", "flops_kk", "control")


def main() -> None:
    from freescale.training.config import CommMode  # no torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "out/bubble-bench")
    parser.add_argument("--user-features", action=argparse.BooleanOptionalAction, default=True,
                        help="train with MovieLens user features (default on)")
    parser.add_argument("--user-feature-cols", default="age,gender,occupation,zip_code",
                        help="which columns of users.parquet (default: all four)")
    parser.add_argument("--comm-mode", default="plain", choices=typing.get_args(CommMode),
                        help="comm mode of every run (default plain: the straggler bubble alone)")
    args = parser.parse_args()
    work = (REPO / args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    if args.report_only:
        for rep in range(args.repeats):
            for variant in VARIANTS:
                results[variant].append(json.loads((work / f"{variant}-{rep}.json").read_text())["summary"])
        steps = int(results["balanced"][0]["measured_steps"]) + 2
    else:
        shards = build_shards(work, args)
        steps = args.epochs * json.loads((shards["balanced"] / "manifest.json").read_text())["num_steps"]
        for rep in range(args.repeats):
            for variant in VARIANTS:
                summary = train(shards[variant], steps, rep, work / f"{variant}-{rep}.json", args,
                                "--comm-mode", args.comm_mode)
                results[variant].append(summary)
                print(f"repeat {rep} {variant:10s} bubble {summary['bubble_fraction']:.4f} "
                      f"(cpu {summary['bubble_fraction_cpu']:.4f})  step {summary['step_time_s'] * 1e3:.1f} ms  "
                      f"hr@10 {summary['hr_at_10']:.4f}", flush=True)

    print(f"\n## Measured bubbles: MovieLens-100K, 2 gloo ranks x {args.local_batch_size} samples, "
          f"{steps} steps, {args.repeats} repeats (median [min, max])\n")
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; strategy {args.strategy}"
          f"{', calibrated cost model + rank capacities' if args.calibrate else ', default cost model'}"
          f"; user features: {args.user_feature_cols if args.user_features else 'none'}\n")
    print("| shards | bubble (wall) | bubble (thread CPU) | step time (ms) | samples/s | predicted bubble |")
    print("| --- | --- | --- | --- | --- | --- |")
    for variant in VARIANTS:
        rows = results[variant]
        print(f"| {variant} | {spread([r['bubble_fraction'] for r in rows])} | "
              f"{spread([r['bubble_fraction_cpu'] for r in rows])} | "
              f"{statistics.median(r['step_time_s'] for r in rows) * 1e3:.1f} | "
              f"{statistics.median(r['samples_per_s'] for r in rows):.0f} | "
              f"{statistics.median(r['predicted_bubble'] for r in rows):.4f} |")
    med = {v: {k: statistics.median(r[k] for r in results[v]) for k in ("bubble_fraction", "bubble_fraction_cpu")}
           for v in VARIANTS}
    print("\n| shards | clock | removable (contiguous - control) | left (shards - control) | removed "
          "| target >= 90% (balanced) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for variant in ("balanced", "flops_kk"):
        for key, label in (("bubble_fraction", "wall"), ("bubble_fraction_cpu", "thread CPU")):
            removable = med["contiguous"][key] - med["control"][key]
            left = med[variant][key] - med["control"][key]
            removed = 1.0 - left / removable if removable > 0 else float("nan")
            target = ("met" if removed >= 0.9 else "NOT met") if variant == "balanced" else "(baseline)"
            print(f"| {variant} | {label} | {removable:.4f} | {left:.4f} | {removed:.1%} | {target} |")

    print("\n| shards | HR@10 | NDCG@10 | MRR | most-popular HR@10 | most-popular NDCG@10 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for variant in ("contiguous", "balanced"):
        rows = results[variant]
        print(f"| {variant} | {spread([r['hr_at_10'] for r in rows])} | {spread([r['ndcg_at_10'] for r in rows])} | "
              f"{spread([r['mrr'] for r in rows])} | {rows[0]['popular_hr_at_10']:.4f} | "
              f"{rows[0]['popular_ndcg_at_10']:.4f} |")
    print("\n| metric | contiguous - balanced (medians) | spread across seeds (max - min, larger of the two) "
          "| agree | both beat most-popular |")
    print("| --- | --- | --- | --- | --- |")
    for key in ("hr_at_10", "ndcg_at_10", "mrr"):
        values = {v: [r[key] for r in results[v]] for v in ("contiguous", "balanced")}
        difference = statistics.median(values["contiguous"]) - statistics.median(values["balanced"])
        seed_spread = max(max(v) - min(v) for v in values.values())
        popular = results["contiguous"][0][f"popular_{key}"]
        beats = min(min(v) for v in values.values()) > popular
        print(f"| {key} | {difference:+.4f} | {seed_spread:.4f} | {'yes' if abs(difference) <= seed_spread else 'NO'} "
              f"| {'yes' if beats else 'NO'} (worst run {min(min(v) for v in values.values()):.4f} "
              f"vs {popular:.4f}) |")
    print(f"\n(total {time.time() - started:.0f} s; per-run logs and summaries in {work})")


if __name__ == "__main__":
    main()
