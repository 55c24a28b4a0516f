"""Measured communication of real 2-rank training: plain vs overlap vs prioritized, and all of FreeScale.

Same data (MovieLens-100K with its user features), same steps, same seed per repeat.
The shards are the bubble benchmark's (`benchmarks.common.build_shards` builds them with
the real jobs): `balanced` (kk, calibrated cost model when --calibrate) and
`contiguous` (what every framework does), and `control` (--control mirror: both
ranks get the same samples every step, so its bubble is this machine's noise
floor). Runs alternate within each repeat

    contiguous+plain, balanced+plain, balanced+overlap, balanced+prioritized, control+prioritized, ...

so drift in machine load hits every variant alike. Every number is measured on the
ranks: `exposed_comm_s` is the time a rank's compute thread waited on a collective,
`comm_s` the time at least one was in flight, `idle_fraction` = 1 - mean dense
compute / step time (straggler waits, exposed communication and everything else
that is not dense compute), and the dense slowdown compares a variant's median
dense compute per step with balanced+plain's in the same repeat (the same work;
under overlap the transport's threads compete with compute for the 2 cores).

Targets: prioritized exposes at most half of plain's exposed communication and its
step time is lower than plain's; contiguous+plain -> balanced+prioritized removes
90% of the idle fraction (FreeScale's paper reports up to 90.3%).

Usage (from the repository root): python -m benchmarks.comm_bench [--repeats 3] [--epochs 4] [--calibrate]
           [--workdir out/comm-bench]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from benchmarks.common import REPO, add_run_arguments, build_shards, spread, train

VARIANTS = (("contiguous", "plain"), ("balanced", "plain"), ("balanced", "overlap"), ("balanced", "prioritized"),
            ("control", "prioritized"))
BASELINE = ("balanced", "plain")
COMBINED = (("contiguous", "plain"), ("balanced", "prioritized"))


def name(variant: tuple[str, str]) -> str:
    return f"{variant[0]}+{variant[1]}"


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "out/comm-bench")
    args = parser.parse_args()
    # The shard builder reads these.
    args.user_features, args.user_feature_cols = True, "age,gender,occupation,zip_code"
    work = (REPO / args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results: dict[tuple[str, str], list[dict]] = {v: [] for v in VARIANTS}
    if not args.report_only:
        shards = build_shards(work, args)
        steps = args.epochs * json.loads((shards["balanced"] / "manifest.json").read_text())["num_steps"]
    for rep in range(args.repeats):
        for variant in VARIANTS:
            out = work / f"{name(variant)}-{rep}.json"
            if args.report_only:
                summary = json.loads(out.read_text())["summary"]
            else:
                summary = train(shards[variant[0]], steps, rep, out, args, "--comm-mode", variant[1])
                print(f"repeat {rep} {name(variant):22s} step {summary['step_time_s'] * 1e3:6.1f} ms  exposed comm "
                      f"{summary['exposed_comm_s'] * 1e3:5.1f} ms of {summary['comm_s'] * 1e3:5.1f} ms  "
                      f"idle {summary['idle_fraction']:.3f}", flush=True)
            results[variant].append(summary)
    steps = int(results[BASELINE][0]["measured_steps"]) + 2

    print(f"\n## Measured communication: MovieLens-100K + user features, 2 gloo ranks x {args.local_batch_size} "
          f"samples, {steps} steps, {args.repeats} repeats (median [min, max])\n")
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; strategy {args.strategy}"
          f"{', calibrated cost model + rank capacities' if args.calibrate else ', default cost model'}\n")
    print("| shards + comm mode | step time (ms) | comm_s (ms) | exposed_comm_s (ms) | samples/s | bubble_fraction "
          "| idle_fraction | dense compute (ms) | dense slowdown vs balanced+plain | HR@10 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for variant in VARIANTS:
        rows = results[variant]
        slowdown = [r["dense_compute_s"] / b["dense_compute_s"] - 1.0 for r, b in zip(rows, results[BASELINE])]
        print(f"| {name(variant)} | {spread([r['step_time_s'] for r in rows], '.1f', 1e3)} | "
              f"{spread([r['comm_s'] for r in rows], '.1f', 1e3)} | {spread([r['exposed_comm_s'] for r in rows], '.1f', 1e3)} | "
              f"{med(rows, 'samples_per_s'):.0f} | {spread([r['bubble_fraction'] for r in rows], '.4f')} | "
              f"{spread([r['idle_fraction'] for r in rows], '.3f')} | "
              f"{med(rows, 'dense_compute_s') * 1e3:.1f} | {statistics.median(slowdown):+.1%} | "
              f"{med(rows, 'hr_at_10'):.4f} |")

    plain, prioritized = results[BASELINE], results[("balanced", "prioritized")]
    exposed_ratio = med(prioritized, "exposed_comm_s") / med(plain, "exposed_comm_s")
    step_ratio = med(prioritized, "step_time_s") / med(plain, "step_time_s")
    print("\n| target | measured | met |")
    print("| --- | --- | --- |")
    print(f"| prioritized exposed_comm_s <= 0.5 x plain's | {exposed_ratio:.2f} x | "
          f"{'met' if exposed_ratio <= 0.5 else 'NOT met'} |")
    print(f"| prioritized step time < plain's | {step_ratio:.3f} x | {'met' if step_ratio < 1.0 else 'NOT met'} |")
    before, after = (results[v] for v in COMBINED)
    reduction = 1.0 - med(after, "idle_fraction") / med(before, "idle_fraction")
    print(f"| idle_fraction, {name(COMBINED[0])} -> {name(COMBINED[1])}: 90% less | "
          f"{med(before, 'idle_fraction'):.3f} -> {med(after, 'idle_fraction'):.3f} ({reduction:.1%} less) | "
          f"{'met' if reduction >= 0.9 else 'NOT met'} |")
    idle_ms = [med(rows, "idle_fraction") * med(rows, "step_time_s") * 1e3 for rows in (before, after)]
    print(f"| idle rank-time per step, same two | {idle_ms[0]:.1f} ms -> {idle_ms[1]:.1f} ms "
          f"({1.0 - idle_ms[1] / idle_ms[0]:.1%} less) | - |")
    floor = results[("control", "prioritized")]
    print(f"| straggler bubble left vs the noise floor (control+prioritized) | "
          f"{med(after, 'bubble_fraction'):.4f} vs {med(floor, 'bubble_fraction'):.4f} | - |")

    # Where the idle rank-time goes (shares of rank-time over all measured steps and ranks).
    print("\n| shards + comm mode | dense compute | idle | exposed comm (waits on a collective) | of which straggler "
          "bubble | rest of idle (lookups, optimizers, data, bookkeeping) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for variant in VARIANTS:
        rows = results[variant]
        idle, exposed = med(rows, "idle_fraction"), med(rows, "exposed_comm_fraction")
        print(f"| {name(variant)} | {1.0 - idle:.1%} | {idle:.1%} | {exposed:.1%} | "
              f"{med(rows, 'bubble_fraction'):.1%} | {idle - exposed:.1%} |")
    print(f"\n(total {time.time() - started:.0f} s; per-run logs and summaries in {work})")


if __name__ == "__main__":
    main()
