"""`freescale simulate` against real 2-rank training: predicted vs measured bubbles, idle time, step time.

MovieLens-100K (with its user features, as benchmarks.bubble_bench), 2 gloo ranks, 16 and 32
samples per rank, three shard sets per batch size from the real balance job (contiguous, kk
balanced, the mirror control), the cost model from `freescale calibrate`. Runs alternate
(control, contiguous, balanced per batch size, then the next repeat) so drift in machine load
hits all alike.

Fit on some runs, predict others: repeat r's two control runs (B=16 and B=32) give seconds per
cost unit and the comm term (`--calibrate-from`, a latency plus a per-sample slope from the two
batch sizes) and the per-rank noise of their batch size (`--noise-from`); `freescale simulate
--shards` then predicts that repeat's contiguous and balanced runs, which the fit never saw.
The table compares medians over repeats. Target: bubble_fraction within 25% of the measured
value, or within one percentage point where the measured bubble is under 4%.

Then the published predictions: 256 and 1,024 ranks on MovieLens-100K lengths and on log-normal
lengths (the synthetic generator's mu=4.2, sigma=0.9), contiguous vs balanced, with repeat 0's
fit.

Usage (from the repository root): python -m benchmarks.simulate_validation [--repeats 3] [--epochs 4]
           [--workdir out/simulate-validation] [--report-only]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.common import MOVIELENS, MOVIELENS_USERS, REPO, freescale, run, train

BATCH_SIZES = (16, 32)
VARIANTS = ("control", "contiguous", "balanced")
STRATEGY = {"control": ["--strategy", "contiguous", "--control", "mirror"], "contiguous": ["--strategy", "contiguous"],
            "balanced": ["--strategy", "kk"]}
BUBBLE_TOLERANCE, SMALL_BUBBLE, SMALL_BUBBLE_TOLERANCE = 0.25, 0.04, 0.01
LARGE_K = "256,1024"
LOGNORMAL = "lognormal:4.2,0.9"  # freescale/prepare/synthetic.py's defaults: median ~67, p99/p50 ~8


def build(work: Path) -> tuple[Path, Path, dict[tuple[int, str], Path]]:
    prepared, cost_model = work / "prepared", work / "cost_model.json"
    if not (prepared / "prepare.json").exists():
        run(freescale("prepare", "--input", str(MOVIELENS), "--user-features",
                      str(MOVIELENS_USERS), "--output", str(prepared), "--overwrite",
                      "--tracking-uri", "none"), work / "prepare.log")
    if not cost_model.exists():
        run(freescale("calibrate", "--output", str(cost_model), "--overwrite", "--tracking-uri", "none"),
            work / "calibrate.log")
    shards = {}
    for b in BATCH_SIZES:
        for variant in VARIANTS:
            out = shards[b, variant] = work / f"shards-b{b}-{variant}"
            if not (out / "manifest.json").exists():
                run(freescale("balance", "--input", str(prepared), "--output", str(out), "--world-size", "2",
                              "--local-batch-size", str(b), "--cost-model", str(cost_model), "--seed", "0",
                              "--overwrite", "--tracking-uri", "none", *STRATEGY[variant]),
                    work / f"balance-b{b}-{variant}.log")
    return prepared, cost_model, shards


def summary_path(work: Path, b: int, variant: str, rep: int) -> Path:
    return work / f"b{b}-{variant}-{rep}.json"


def simulate(work: Path, name: str, *args: str) -> dict:
    out = work / f"simulate-{name}.json"
    run(freescale("simulate", *args, "--json", str(out), "--tracking-uri", "none"), out.with_suffix(".log"))
    return json.loads(out.read_text())


def fit_flags(work: Path, b: int, rep: int) -> list[str]:
    """Repeat rep's control runs: noise of batch size b, seconds per cost and comm from both sizes."""
    return ["--noise-from", str(summary_path(work, b, "control", rep)), "--calibrate-from",
            *[str(summary_path(work, size, "control", rep)) for size in BATCH_SIZES]]


def within_target(predicted: float, measured: float) -> bool:
    if measured < SMALL_BUBBLE:
        return abs(predicted - measured) <= SMALL_BUBBLE_TOLERANCE
    return abs(predicted - measured) <= BUBBLE_TOLERANCE * measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="passes over the shards per run")
    parser.add_argument("--workdir", default="out/simulate-validation")
    parser.add_argument("--report-only", action="store_true", help="reuse the training runs a finished run left")
    args = parser.parse_args()
    work = (REPO / args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    prepared, cost_model, shards = build(work)
    train_args = argparse.Namespace(tracking_uri="none")
    for rep in range(args.repeats):
        for b in BATCH_SIZES:
            steps = args.epochs * json.loads((shards[b, "balanced"] / "manifest.json").read_text())["num_steps"]
            for variant in VARIANTS:
                out = summary_path(work, b, variant, rep)
                if args.report_only and out.exists():
                    continue
                s = train(shards[b, variant], steps, rep, out, train_args)
                print(f"repeat {rep} B={b} {variant:10s} bubble {s['bubble_fraction']:.4f} idle "
                      f"{s['idle_fraction']:.4f} step {s['step_time_s'] * 1e3:.1f} ms", flush=True)

    # Predict every repeat's runs from that repeat's control fit (the control row is the fit itself).
    measured: dict[tuple[int, str], list[dict]] = {}
    predicted: dict[tuple[int, str], list[dict]] = {}
    for rep in range(args.repeats):
        for b in BATCH_SIZES:
            for variant in VARIANTS:
                measured.setdefault((b, variant), []).append(
                    json.loads(summary_path(work, b, variant, rep).read_text())["summary"])
                result = simulate(work, f"b{b}-{variant}-{rep}", "--shards", str(shards[b, variant]),
                                  *fit_flags(work, b, rep))
                predicted.setdefault((b, variant), []).append(result["predictions"][0])
    fit = json.loads((work / "simulate-b16-contiguous-0.json").read_text())["model"]

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"\n#### Predicted vs measured: MovieLens-100K, 2 gloo ranks, {args.repeats} repeats (medians), "
          f"{args.epochs} passes per run\n")
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; calibrated cost model; "
          f"repeat 0's fit: {fit['seconds_per_cost']:.3f} s per cost unit, non-compute "
          f"{fit['comm_latency_s'] * 1e3:.1f} ms + {fit['comm_seconds_per_sample'] * 1e3:.3f} ms per sample, "
          f"noise cv {fit['noise_cv']:.3f} (B=16)\n")
    print("| B | shards | bubble measured | bubble predicted | error | target | idle measured | idle predicted "
          "| step ms measured | step ms predicted | step time error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    met = []
    for b in BATCH_SIZES:
        for variant in VARIANTS:
            m, p = measured[b, variant], predicted[b, variant]
            mb, pb = med(m, "bubble_fraction"), med(p, "bubble_fraction")
            ms, ps = med(m, "step_time_s"), med(p, "step_time_s")
            if variant == "control":
                target = "(fit)"
            else:
                met.append(within_target(pb, mb))
                target = "met" if met[-1] else "NOT met"
            print(f"| {b} | {variant} | {mb:.4f} | {pb:.4f} | {(pb - mb) / mb:+.0%} ({(pb - mb) * 100:+.2f} pt) | "
                  f"{target} | {med(m, 'idle_fraction'):.3f} | {med(p, 'idle_fraction'):.3f} | {ms * 1e3:.1f} | "
                  f"{ps * 1e3:.1f} | {(ps - ms) / ms:+.0%} |")
    print(f"\nbubble target (within 25%, or 1 pt under a 4% bubble) met on {sum(met)} of {len(met)} predicted rows")

    print(f"\n#### Predicted at {LARGE_K} ranks, B=16 (repeat 0's fit, 16 planned steps, balanced = kk over "
          "windows of 16 steps)\n")
    for name, source in (("movielens", ["--input", str(prepared)]), ("lognormal", ["--lengths", LOGNORMAL])):
        for dist in ("empirical", "normal"):
            result = simulate(work, f"large-{name}-{dist}", *source, "--world-sizes", LARGE_K, "--local-batch-size",
                              "16", "--cost-model", str(cost_model), *fit_flags(work, 16, 0), "--noise-dist", dist)
            drawn = (f" (drawn with replacement from {result['what']['dataset_samples']} samples)"
                     if result["what"].get("resampled_world_sizes") else "")
            print(f"{name} lengths{drawn}, {dist} noise (cv {result['model']['noise_cv']:.3f}):\n")
            print("| K | plan | plan bubble | step ms | bubble_fraction | idle_fraction | slowest rank's noise |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for r in result["predictions"]:
                print(f"| {r['world_size']} | {r['plan']} | {r['plan_bubble']:.4f} | {r['step_time_s'] * 1e3:.1f} | "
                      f"{r['bubble_fraction']:.4f} | {r['idle_fraction']:.4f} | x{r['noise_max_factor']:.3f} |")
            for r in result["reductions"]:
                print(f"\nK={r['world_size']}: balancing removes {r['bubble_reduction']:.1%} of the bubble, "
                      f"step time x{r['speedup']:.2f} faster", end="")
            print("\n")
    print(f"(total {time.time() - started:.0f} s; runs, predictions and logs in {work})")


if __name__ == "__main__":
    main()
