"""`freescale simulate`: predicted step time, bubble_fraction and idle_fraction on K ranks.

    freescale simulate --input PREPARED --world-sizes 256,1024 --local-batch-size 16 \\
        --cost-model cost_model.json --noise-from control.json --calibrate-from control.json
    freescale simulate --lengths lognormal:4.2,0.9 --world-sizes 8,64,512,4096 --noise-cv 0.1
    freescale simulate --shards SHARDS --noise-from control.json --calibrate-from control.json

With --input or --lengths, every K gets two plans from the real planner (balancing.window.plan):
`contiguous` (the data-parallel baseline) and `balanced` (--strategy over windows of
--window-steps steps), on K x B x --steps sample lengths: a seeded shuffle of the dataset's, or,
when it has fewer, drawn with replacement from its length distribution (the output says so).
With --shards, the shard set's own plan at its world size. Each plan's per-step loads go through
the Monte Carlo of balancing/simulate.py: seconds per cost unit, per-rank noise and the
non-compute part of a step, each fitted on measured runs (`freescale train --summary-json`) or
given explicitly. Output: a table (per K and plan, and the balanced/contiguous reduction),
--json, and one MLflow run with the numbers and a bubble-vs-K plot.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from balancing.simulate import (  # numpy only
    NOISE_DISTS, PLAN_BYTES_PER_SAMPLE, Noise, TimeModel, plan_memory_bytes)
from balancing.inputs import DEFAULT_FLOP_WIDTH
from balancing.strategies import PER_BATCH, STRATEGIES, per_batch_conflict
from balancing.time_model import (  # numpy only
    check_same_cost_model, describe_cost_model, fit_time_model, mirror_noise, predict, read_run, reductions,
    runs_cost_model)
from jobs.job_errors import run_job
from training.tracking import add_tracking_arguments  # no mlflow import until a run opens
from pipeline.errors import InputError, one_line

LENGTHS_SPEC = re.compile(r"^lognormal:([^,]+),([^,]+)$")
PLOT_NAME = "bubble_vs_k.png"
# `--lengths lognormal:` clips as pipeline/synthetic.py's generator does by default (its module
# imports Spark, so its defaults are not imported here).
MIN_LEN, MAX_LEN = 20, 1024
DEFAULT_WORLD_SIZES, DEFAULT_LOCAL_BATCH_SIZE = "8,64,256,1024", 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale simulate", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="a prepared dataset (`freescale prepare`'s output): its sample lengths")
    source.add_argument("--lengths", help="synthetic sample lengths, lognormal:MU,SIGMA (L = round(exp(MU + SIGMA z)))")
    source.add_argument("--shards", help="a shard directory (`freescale balance`'s output): its own plan")
    p.add_argument("--world-sizes", help=f"ranks K to simulate, comma separated (default {DEFAULT_WORLD_SIZES}; "
                                         "with --shards: the manifest's)")
    p.add_argument("--local-batch-size", type=int,
                   help=f"samples per rank per step B (default {DEFAULT_LOCAL_BATCH_SIZE}; "
                        "with --shards: the manifest's)")
    p.add_argument("--steps", type=int, default=16, help="steps planned per K (default 16)")
    p.add_argument("--window-steps", type=int, help="the balanced plan's window (default: --steps; 1 for "
                                                    "flops_kk, which balances each global batch alone)")
    p.add_argument("--strategy", choices=[s for s in STRATEGIES if s != "contiguous"], default="kk",
                   help="the balanced plan's strategy (default kk)")
    p.add_argument("--flop-width", type=int, default=DEFAULT_FLOP_WIDTH,
                   help="the model width d in flops_kk's FLOP formula L^2 + 2.5*d*L (default %(default)s)")
    p.add_argument("--cost-model", help="cost-model JSON (default: the --calibrate-from runs' shards' model, else "
                                        "the built-in analytic one; with --shards: the manifest's); runs given "
                                        "to --calibrate-from must use the same")
    p.add_argument("--min-seq-len", type=int, default=MIN_LEN, help=f"--lengths clip (default {MIN_LEN})")
    p.add_argument("--max-seq-len", type=int, default=MAX_LEN, help=f"--lengths clip (default {MAX_LEN})")
    noise = p.add_mutually_exclusive_group()
    noise.add_argument("--noise-from", help="a mirror-control run's --summary-json: the per-rank noise")
    noise.add_argument("--noise-cv", type=float, help="per-rank noise: normal with this coefficient of variation")
    p.add_argument("--noise-dist", choices=NOISE_DISTS,
                   help="with --noise-from: draw the measured values (empirical, default) or a normal of their spread")
    p.add_argument("--calibrate-from", nargs="+", metavar="SUMMARY",
                   help="runs' --summary-json: seconds per cost unit and the comm term (latency + per sample)")
    p.add_argument("--seconds-per-cost", type=float, help="seconds per cost unit (overrides --calibrate-from)")
    p.add_argument("--comm-latency-s", type=float, help="seconds per step outside compute (overrides --calibrate-from)")
    p.add_argument("--comm-bytes-per-sample", type=float, help="bytes a rank moves per sample per step "
                                                               "(with --comm-bandwidth; overrides --calibrate-from)")
    p.add_argument("--comm-bandwidth", type=float, default=1e9, help="bytes/s per rank (default 1e9)")
    p.add_argument("--seed", type=int, default=0, help="sample draw, plan and noise seed (default 0)")
    p.add_argument("--json", help="write the predictions here")
    p.add_argument("--plot", help="also write the bubble-vs-K PNG here")
    add_tracking_arguments(p)
    p.add_argument("--run-name", help="MLflow run name (default simulate)")
    return p


# ----------------------------------------------------------------------- arguments


def parse_world_sizes(text: str) -> list[int]:
    sizes = []
    for item in text.split(","):
        try:
            k = int(item.strip())
        except ValueError:
            raise InputError(f"--world-sizes: {item.strip()!r} is not an integer") from None
        if k < 1:
            raise InputError(f"--world-sizes: {k} is not a positive integer")
        sizes.append(k)
    return sorted(set(sizes))


def parse_lengths(text: str) -> tuple[float, float]:
    """``lognormal:MU,SIGMA`` -> (mu, sigma)."""
    match = LENGTHS_SPEC.match(text.strip())
    try:
        mu, sigma = (float(match.group(1)), float(match.group(2))) if match else (math.nan, math.nan)
    except ValueError:
        mu = sigma = math.nan
    if not (math.isfinite(mu) and math.isfinite(sigma) and sigma >= 0):
        raise InputError(f"--lengths {text!r}: expected lognormal:MU,SIGMA with finite MU and SIGMA >= 0")
    return mu, sigma


def check_args(args: argparse.Namespace) -> None:
    positive = [("--steps", args.steps), ("--window-steps", args.window_steps), ("--local-batch-size",
                args.local_batch_size), ("--min-seq-len", args.min_seq_len), ("--max-seq-len", args.max_seq_len),
                ("--flop-width", args.flop_width)]
    for flag, value in positive:
        if value is not None and value < 1:
            raise InputError(f"{flag} must be a positive integer, got {value}")
    conflict = per_batch_conflict(args.strategy, args.window_steps or 1, None)
    if conflict:
        raise InputError(conflict)
    if args.min_seq_len > args.max_seq_len:
        raise InputError(f"--min-seq-len {args.min_seq_len} is above --max-seq-len {args.max_seq_len}")
    for flag, value in (("--noise-cv", args.noise_cv), ("--comm-latency-s", args.comm_latency_s),
                        ("--comm-bytes-per-sample", args.comm_bytes_per_sample)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise InputError(f"{flag} must be a finite number >= 0, got {value}")
    for flag, value in (("--seconds-per-cost", args.seconds_per_cost), ("--comm-bandwidth", args.comm_bandwidth)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise InputError(f"{flag} must be a positive number, got {value}")
    seconds = args.seconds_per_cost is not None or args.calibrate_from
    for flag, value in (("--comm-latency-s", args.comm_latency_s),
                        ("--comm-bytes-per-sample", args.comm_bytes_per_sample)):
        if value is not None and not seconds:
            raise InputError(f"{flag} is in seconds: give --seconds-per-cost or --calibrate-from so compute is too")
    if args.noise_dist and not args.noise_from:
        raise InputError("--noise-dist applies to --noise-from (--noise-cv is normal)")
    for flag, path in (("--input", args.input), ("--shards", args.shards)):
        if path and not Path(path).exists():  # before the MLflow run opens: a typo leaves no failed run
            raise InputError(f"{flag} {path} does not exist")
    if args.lengths:
        parse_lengths(args.lengths)
    if args.world_sizes:
        parse_world_sizes(args.world_sizes)
    if not args.shards:  # a shard set's plan exists already; built plans are sized by K first
        check_plan_memory(parse_world_sizes(args.world_sizes or DEFAULT_WORLD_SIZES),
                          args.local_batch_size or DEFAULT_LOCAL_BATCH_SIZE, args.steps)


def available_memory_bytes() -> int | None:
    """Memory this process may still take: the kernel's MemAvailable, capped by the cgroup's
    limit when one is set; None where neither can be read (no bound is applied)."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = int(re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M).group(1)) * 1024
    except (OSError, AttributeError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def check_plan_memory(world_sizes: list[int], local_batch_size: int, steps: int) -> None:
    """Refuse up front a K whose plans would not fit in this machine's memory: planning starts
    by drawing K x B x steps sample lengths, and a MemoryError after minutes of allocating
    names nothing."""
    available = available_memory_bytes()
    if available is None:
        return
    k = max(world_sizes)
    needed = plan_memory_bytes(k, local_batch_size, steps)
    if needed > available:
        raise InputError(f"--world-sizes: K={k} needs about {needed / 2**30:.3g} GiB to plan ({k} ranks x "
                         f"{local_batch_size} samples x {steps} steps x {PLAN_BYTES_PER_SAMPLE} bytes), more than "
                         f"the {available / 2**30:.3g} GiB of memory available here; simulate fewer ranks, "
                         "--steps or --local-batch-size")


# ----------------------------------------------------------------------- measured runs


def build_noise(args: argparse.Namespace) -> tuple[Noise, dict]:
    if args.noise_cv is not None:
        return Noise("normal", args.noise_cv), {"noise": "normal", "noise_cv": args.noise_cv}
    if not args.noise_from:
        return Noise(), {"noise": "none"}
    noise = mirror_noise(read_run(args.noise_from), args.noise_dist or "empirical")
    return noise, {"noise": noise.dist, "noise_cv": noise.cv, "noise_from": args.noise_from,
                   "noise_samples": int(noise.residuals.size)}


def build_time_model(args: argparse.Namespace):
    """The fitted and explicit parts of the model, where each came from, and the cost model of the
    --calibrate-from runs (None without them)."""
    noise, described = build_noise(args)
    spc, latency, per_sample = 1.0, 0.0, 0.0
    runs_model = None
    if args.calibrate_from:
        runs = [read_run(path) for path in args.calibrate_from]
        runs_model, unnamed = runs_cost_model(runs)
        for path in unnamed:
            print(f"freescale simulate: warning: {path} does not name its shards' cost model (a summary "
                  "from before summaries did): its costs are taken to be in the plans' cost model", file=sys.stderr)
        spc, latency, per_sample = fit_time_model(runs)
        described["calibrate_from"] = list(args.calibrate_from)
    if args.seconds_per_cost is not None:
        spc = args.seconds_per_cost
    if args.comm_latency_s is not None:
        latency = args.comm_latency_s
    if args.comm_bytes_per_sample is not None:
        per_sample = args.comm_bytes_per_sample / args.comm_bandwidth
    described.update(seconds_per_cost=spc, comm_latency_s=latency, comm_seconds_per_sample=per_sample,
                     times_in="seconds" if args.calibrate_from or args.seconds_per_cost else "cost units")
    return TimeModel(spc, latency, per_sample, noise), described, runs_model


def check_runs_cost_model(plans_model, runs_model, args: argparse.Namespace) -> None:
    check_same_cost_model(plans_model, runs_model, f"--calibrate-from {args.calibrate_from[0]}"
                          if args.calibrate_from else "--calibrate-from")


# ----------------------------------------------------------------------- plans


def load_cost_model(path: str | None):
    from pipeline.cost_model import CostModel, default_cost_model

    return CostModel.load(path) if path else default_cost_model()


def shard_plan(args: argparse.Namespace, runs_model) -> tuple[dict, dict]:
    """The shard set's own plan: {plan name: [steps, K] loads} and what it is."""
    import pyarrow.parquet as pq

    from pipeline.cost_model import CostModel
    from pipeline.json_files import read_json
    from shards.manifest import ShardError, load_manifest
    from shards.schema import MANIFEST_NAME

    raw = read_json(Path(args.shards) / MANIFEST_NAME, "shard manifest (freescale balance output)")
    if not isinstance(raw, dict) or not isinstance(raw.get("world_size"), int):
        raise ShardError(f"{Path(args.shards) / MANIFEST_NAME}: no world_size")
    manifest = load_manifest(args.shards, raw["world_size"])
    k, b = manifest.world_size, manifest.local_batch_size
    if args.world_sizes and parse_world_sizes(args.world_sizes) != [k]:
        raise InputError(f"--world-sizes {args.world_sizes}: shard set {args.shards} is planned for {k} ranks")
    if args.local_batch_size not in (None, b):
        raise InputError(f"--local-batch-size {args.local_batch_size}: shard set {args.shards} has {b}")
    model = load_cost_model(args.cost_model) if args.cost_model else CostModel.from_json(
        manifest.cost_model, f"{args.shards} manifest's cost model")
    check_runs_cost_model(model, runs_model, args)
    loads = np.zeros((manifest.num_steps, k))
    for rank in range(k):
        for path in manifest.rank_paths(rank):
            table = pq.read_table(path, columns=["step", "length"]).to_pydict()
            np.add.at(loads[:, rank], np.asarray(table["step"], dtype=np.int64),
                      model.predict(np.asarray(table["length"])))
    name = manifest.control or manifest.strategy
    return {k: {name: loads}}, {"source": "shards", "shards": args.shards, "local_batch_size": b,
                                "plan": name, "cost_model": describe_cost_model(model)}


def prepared_lengths(path: str) -> np.ndarray:
    """Every sample's history length from a prepared dataset (local Parquet, read with pyarrow)."""
    import pyarrow.parquet as pq

    from pipeline.prepared import sequences_path

    sequences = sequences_path(path)
    try:
        table = pq.read_table(sequences, columns=["length"])
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for unreadable input
        raise InputError(f"--input {sequences}: no readable Parquet with column 'length' ({one_line(exc)})") from None
    lengths = table.column("length").to_numpy(zero_copy_only=False)
    if lengths.size == 0:
        raise InputError(f"--input {sequences} holds no samples")
    return lengths.astype(np.int64)


def built_plans(args: argparse.Namespace, runs_model) -> tuple[dict, dict]:
    """{K: {"contiguous": loads, "balanced": loads}} from the real planner, and what they are."""
    from balancing.simulate import lognormal_lengths, plan_loads, sample_lengths

    sizes = parse_world_sizes(args.world_sizes or DEFAULT_WORLD_SIZES)
    b = args.local_batch_size or DEFAULT_LOCAL_BATCH_SIZE
    window = args.window_steps or (1 if args.strategy in PER_BATCH else args.steps)
    # Without --cost-model, the runs' own: the one their seconds per cost unit is for.
    model = load_cost_model(args.cost_model) if args.cost_model or runs_model is None else runs_model
    check_runs_cost_model(model, runs_model, args)
    pool = prepared_lengths(args.input) if args.input else None
    resampled = []
    plans = {}
    for k in sizes:
        n = k * b * args.steps
        if pool is not None:
            lengths, drawn = sample_lengths(pool, n, args.seed)
            if drawn:
                resampled.append(k)
        else:
            mu, sigma = parse_lengths(args.lengths)
            lengths = lognormal_lengths(mu, sigma, n, args.seed, args.min_seq_len, args.max_seq_len)
        costs = model.predict(lengths)
        plans[k] = {"contiguous": plan_loads(costs, k, b, "contiguous", 1, args.seed),
                    "balanced": plan_loads(costs, k, b, args.strategy, window, args.seed, lengths, args.flop_width)}
    what = {"source": "input" if args.input else "lengths", "lengths": args.input or args.lengths,
            "local_batch_size": b, "steps": args.steps, "balanced": f"{args.strategy}, window {window} steps",
            "cost_model": describe_cost_model(model)}
    if pool is not None:
        what.update(dataset_samples=int(pool.size), resampled_world_sizes=resampled)
    return plans, what


# ----------------------------------------------------------------------- the job


def print_report(what: dict, described: dict, rows: list[dict], reduced: list[dict]) -> None:
    unit, scale = ("ms", 1e3) if described["times_in"] == "seconds" else ("cost units", 1.0)
    print(f"freescale simulate: {what['source']} {what.get('lengths') or what.get('shards')}, "
          f"B={what['local_batch_size']}, cost model {what['cost_model']}; noise {described['noise']}"
          f" (cv {described.get('noise_cv', 0.0):.3f}); "
          + (f"{described['seconds_per_cost']:.4g} s per cost unit; " if unit == "ms" else
             "times in cost units (no --calibrate-from or --seconds-per-cost); ")
          + f"non-compute {described['comm_latency_s'] * scale:.3g} {unit} + "
          f"{described['comm_seconds_per_sample'] * scale:.3g} {unit} per sample")
    if what.get("resampled_world_sizes"):
        print(f"freescale simulate: the dataset has {what['dataset_samples']} samples, fewer than K x B x steps for "
              f"K = {', '.join(map(str, what['resampled_world_sizes']))}: their lengths are drawn with "
              "replacement from its length distribution")
    print(f"\n| K | plan | plan bubble | step time ({unit}) | bubble_fraction | idle_fraction | slowest rank's noise |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['world_size']} | {r['plan']} | {r['plan_bubble']:.4f} | {r['step_time_s'] * scale:.4g} | "
              f"{r['bubble_fraction']:.4f} | {r['idle_fraction']:.4f} | x{r['noise_max_factor']:.3f} |")
    if reduced:
        print("\n| K | bubble removed (1 - balanced / contiguous) | idle removed | step-time speedup |")
        print("| --- | --- | --- | --- |")
        for r in reduced:
            print(f"| {r['world_size']} | {r['bubble_reduction']:.1%} | {r['idle_reduction']:.1%} | "
                  f"x{r['speedup']:.3f} |")


def plot_bubbles(rows: list[dict], path: Path, title: str) -> Path:
    """bubble_fraction (solid) and idle_fraction (dashed) vs K, one colour per plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(dict.fromkeys(r["plan"] for r in rows)):
        mine = sorted((r for r in rows if r["plan"] == name), key=lambda r: r["world_size"])
        ks = [r["world_size"] for r in mine]
        ax.plot(ks, [r["bubble_fraction"] for r in mine], "o-", color=f"C{i}", label=f"{name} bubble_fraction")
        ax.plot(ks, [r["idle_fraction"] for r in mine], "s--", color=f"C{i}", alpha=0.6,
                label=f"{name} idle_fraction")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks K")
    ax.set_ylabel("fraction of rank-time")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def simulate_job(args: argparse.Namespace) -> int:
    from training.tracking import job_run, reachable_tracking_uri
    from pipeline.json_files import write_json

    check_args(args)
    model, described, runs_model = build_time_model(args)  # measured runs first: a bad file fails before planning
    uri = reachable_tracking_uri("simulate", args.tracking_uri)
    params = {k: v for k, v in vars(args).items() if v is not None and k not in ("tracking_uri", "json", "plot")}
    with job_run("simulate", tracking_uri=uri, experiment=args.experiment, params=params,
                 run_name=args.run_name or "simulate") as run:
        plans, what = shard_plan(args, runs_model) if args.shards else built_plans(args, runs_model)
        rows = predict(plans, model, what["local_batch_size"], args.seed)
        reduced = reductions(rows)
        print_report(what, described, rows, reduced)
        result = {"what": what, "model": described, "predictions": rows, "reductions": reduced}
        if args.json:
            write_json(args.json, result)
        run.log_metrics({f"k{r['world_size']}/{r['plan']}/{name}": r[name] for r in rows
                         for name in ("bubble_fraction", "idle_fraction", "step_time_s", "plan_bubble")})
        run.log_metrics({f"k{r['world_size']}/{name}": r[name] for r in reduced
                         for name in ("bubble_reduction", "idle_reduction", "speedup")})
        run.log_text(json.dumps(result, indent=2), "simulation.json")
        if args.plot or run.active:
            title = f"{what['source']} {what.get('lengths') or what.get('shards')}, B={what['local_batch_size']}"
            with tempfile.TemporaryDirectory() as tmp:
                picture = plot_bubbles(rows, Path(tmp) / PLOT_NAME, title)
                if args.plot:
                    shutil.copyfile(picture, args.plot)
                run.log_artifact(picture)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_job("simulate", lambda: simulate_job(args))


if __name__ == "__main__":
    sys.exit(main())
