"""Benchmark of freescale.balancing.partition and balancing.plan on heavy-tailed sequence lengths.

Prints markdown tables:

1. Per-step balancing, for K in {8, 64, 256, 1024} ranks and B in {16, 64} samples per rank: for
   each strategy the bubble of one global batch (1 - mean/max of rank loads), the gap of the
   makespan to the lower bound max(total/K, max cost), and the wall time per global batch
   (medians over --repeats global batches).
2. Windowed planning (strategy kk): plan bubble with window_steps=1 and 32 over 32 global batches,
   the lower-bound bubble, the share of samples moved between steps, the planning time per
   global batch, and the W=32 bubble again with equal_counts=True.

Lengths come from (a) MovieLens-100K: history length per user = ratings per user - 2 (the
leave-one-out split removes the last two), read from ../shared/data/movielens-100k (never copied
into the repository), and (b) synthetic log-normal lengths clip(round(lognormal(mu=4.2,
sigma=0.9)), 20, 1024). Global batches sample lengths with replacement (seeded). Cost per sample
is the project's default model L^2 + 160 L + 1000.

Usage (from the repository root): python -m benchmarks.balance_bench [--quick] [--repeats N] [--time-limit S]
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import ortools

from freescale.balancing import STRATEGIES, partition, plan

REPO_ROOT = Path(__file__).resolve().parents[1]

MOVIELENS = REPO_ROOT / ".." / "shared" / "data" / "movielens-100k" / "ratings.parquet"
LOGNORMAL_MU, LOGNORMAL_SIGMA, MIN_LEN, MAX_LEN = 4.2, 0.9, 20, 1024
COST_A, COST_B, COST_C = 1.0, 160.0, 1000.0
WINDOW = 32


def cost(lengths: np.ndarray) -> np.ndarray:
    lengths = lengths.astype(np.float64)
    return COST_A * lengths**2 + COST_B * lengths + COST_C


def movielens_lengths() -> np.ndarray:
    import pyarrow.parquet as pq

    path = MOVIELENS.resolve()
    if not path.exists():
        raise SystemExit(f"MovieLens-100K not found at {path} (expected ../shared/data/movielens-100k)")
    users = pq.read_table(path, columns=["user_id"]).column("user_id").to_numpy()
    _, per_user = np.unique(users, return_counts=True)
    return (per_user - 2).astype(np.int64)


def movielens_sampler() -> Callable[[np.random.Generator, int], np.ndarray]:
    population = movielens_lengths()
    return lambda rng, n: rng.choice(population, size=n, replace=True)


def lognormal_sampler(rng: np.random.Generator, n: int) -> np.ndarray:
    raw = np.round(rng.lognormal(mean=LOGNORMAL_MU, sigma=LOGNORMAL_SIGMA, size=n))
    return np.clip(raw, MIN_LEN, MAX_LEN).astype(np.int64)


def pct(x: float) -> str:
    return f"{100 * x:.2f}%" if x >= 1e-4 else f"{100 * x:.4f}%"


def ms(x: float) -> str:
    return f"{1000 * x:.0f} ms" if x >= 0.01 else f"{1000 * x:.1f} ms"


def partition_table(
    name: str,
    sample: Callable[[np.random.Generator, int], np.ndarray],
    grid: list[tuple[int, int]],
    repeats: int,
    time_limit: float,
    ortools_repeats_at: dict[int, int],
) -> None:
    print(f"\n### Per-step balancing, {name}\n")
    header = "| K | B | " + " | ".join(f"{s} bubble | {s} gap | {s} time" for s in STRATEGIES) + " |"
    print(header)
    print("|" + "---|" * (2 + 3 * len(STRATEGIES)))
    for k, b in grid:
        rng = np.random.default_rng(1000 * k + b)
        batches = [sample(rng, k * b) for _ in range(repeats)]
        cells = []
        for strategy in STRATEGIES:
            reps = batches
            if strategy == "ortools":
                reps = batches[: ortools_repeats_at.get(k, repeats)]
            bubbles, gaps, times = [], [], []
            for r, lengths in enumerate(reps):
                c = cost(lengths)
                start = time.perf_counter()
                part = partition(c, k, strategy=strategy, seed=r, time_limit_s=time_limit)
                times.append(time.perf_counter() - start)
                bubbles.append(1.0 - (c.sum() / k) / part.makespan)
                gaps.append(part.gap)
            note = f" (n={len(reps)})" if len(reps) != repeats else ""
            cells += [pct(float(np.median(bubbles))), pct(float(np.median(gaps))), ms(float(np.median(times))) + note]
        print(f"| {k} | {b} | " + " | ".join(cells) + " |", flush=True)


def window_table(
    name: str,
    sample: Callable[[np.random.Generator, int], np.ndarray],
    grid: list[tuple[int, int]],
    repeats: int,
) -> None:
    print(f"\n### Windowed planning (kk, {WINDOW} global batches), {name}\n")
    print(
        "| K | B | bubble W=1 | bubble W=32 | lower-bound bubble W=32 | moved W=32 "
        "| plan time / batch W=1 | plan time / batch W=32 | bubble W=32 equal_counts |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for k, b in grid:
        rng = np.random.default_rng(7000 * k + b)
        rows = []
        for _ in range(repeats):
            lengths = sample(rng, WINDOW * k * b)
            c = cost(lengths)
            row = []
            for w, equal in ((1, False), (WINDOW, False), (WINDOW, True)):
                start = time.perf_counter()
                pl = plan(c, k, b, window_steps=w, strategy="kk", lengths=lengths, equal_counts=equal)
                elapsed = time.perf_counter() - start
                row.append((pl.bubble, pl.lower_bound_bubble, pl.moved / c.size, elapsed / pl.num_steps))
            rows.append(row)
        med = np.median(np.array(rows), axis=0)  # [window, metric]
        print(
            f"| {k} | {b} | {pct(med[0, 0])} | {pct(med[1, 0])} | {pct(med[1, 1])} | {pct(med[1, 2])} "
            f"| {ms(med[0, 3])} | {ms(med[1, 3])} | {pct(med[2, 0])} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run (K<=64, 2 repeats, short limits)")
    parser.add_argument("--repeats", type=int, default=5, help="global batches per cell (median)")
    parser.add_argument("--window-repeats", type=int, default=3, help="32-batch windows per cell (median)")
    parser.add_argument("--time-limit", type=float, default=2.0, help="ortools budget per global batch, s")
    parser.add_argument(
        "--ortools-repeats-k1024",
        type=int,
        default=None,
        help="global batches for ortools at K=1024 (default: --repeats; each costs up to --time-limit)",
    )
    args = parser.parse_args()

    grid = [(k, b) for k in (8, 64, 256, 1024) for b in (16, 64)]
    repeats, window_repeats, time_limit = args.repeats, args.window_repeats, args.time_limit
    ortools_repeats_at = {1024: args.ortools_repeats_k1024 or repeats}
    if args.quick:
        grid = [(k, b) for k in (8, 64) for b in (16, 64)]
        repeats, window_repeats, time_limit = 2, 1, min(time_limit, 0.2)

    print("## Balancing benchmark\n")
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, ortools {ortools.__version__}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}; cost = L^2 + 160 L + 1000; "
        f"medians over {repeats} global batches (window table: {window_repeats} window(s) of {WINDOW}); "
        f"ortools budget {time_limit:g} s per batch, warm-started from kk, timed in full"
        + (f" ({ortools_repeats_at[1024]} batches at K=1024)" if ortools_repeats_at[1024] != repeats else "")
        + ". Times are wall clock per global batch on one core. Bubble = 1 - mean/max of rank loads; "
        "gap = makespan / max(total/K, max cost) - 1."
    )
    datasets: list[tuple[str, Callable[[np.random.Generator, int], np.ndarray]]] = [
        ("MovieLens-100K lengths (ratings per user - 2; 943 users, 18..735)", movielens_sampler()),
        (
            f"log-normal lengths clip(round(lognormal(mu={LOGNORMAL_MU}, sigma={LOGNORMAL_SIGMA})), "
            f"{MIN_LEN}, {MAX_LEN})",
            lognormal_sampler,
        ),
    ]
    start = time.perf_counter()
    for name, sample in datasets:
        partition_table(name, sample, grid, repeats, time_limit, ortools_repeats_at)
    for name, sample in datasets:
        window_table(name, sample, grid, window_repeats)
    print(f"\nTotal benchmark time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
