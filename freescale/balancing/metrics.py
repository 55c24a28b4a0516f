"""Per-rank sums, makespan, lower bound and bubble of an assignment."""
from __future__ import annotations

import numpy as np

from freescale.balancing.inputs import Problem
from freescale.balancing.types import InfeasibleError, Partition


def bubble(loads_per_step: np.ndarray) -> float:
    """Fraction of rank-time spent waiting: 1 - sum_s mean_k(loads) / sum_s max_k(loads).

    ``loads_per_step`` is [num_steps, K] (a 1-D array is one step). Each step ends when its slowest
    rank does, so the idle time of a step is K*max - sum; summing over steps gives the bubble.
    """
    loads = np.asarray(loads_per_step, dtype=np.float64)
    if loads.ndim == 1:
        loads = loads[None, :]
    if loads.ndim != 2 or loads.shape[1] == 0:
        raise ValueError(f"loads_per_step must be [num_steps, K] with K >= 1, got shape {loads.shape}")
    if not loads.shape[0]:
        return 0.0
    return bubble_of_totals(float(loads.mean(axis=1).sum()), float(loads.max(axis=1).sum()))


def bubble_of_totals(ideal: float, achieved: float) -> float:
    """``1 - ideal / achieved``: the idle share of rank-time when the steps take ``achieved`` in
    all (the sum of their makespans) and perfectly balanced steps would take ``ideal``. Every
    predicted bubble (a partition, a window plan, the balance job's per-step table) is this."""
    return 0.0 if achieved <= 0 else float(1.0 - ideal / achieved)


def rank_sums(p: Problem, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """loads (float64), counts (int64) and tokens (int64 or None) per rank."""
    k = p.world_size
    loads = np.bincount(rank, weights=p.costs, minlength=k).astype(np.float64)
    counts = np.bincount(rank, minlength=k).astype(np.int64)
    tokens = None
    if p.lengths is not None:
        # bincount weights are float64; lengths are far below 2**53 so the sums are exact.
        tokens = np.rint(np.bincount(rank, weights=p.lengths, minlength=k)).astype(np.int64)
    return loads, counts, tokens


def check_assignment(p: Problem, rank: np.ndarray, strategy: str) -> None:
    """Raise InfeasibleError if ``rank`` breaks the token cap or the count constraint."""
    loads, counts, tokens = rank_sums(p, rank)
    if p.token_cap is not None and tokens is not None and tokens.max(initial=0) > p.token_cap:
        r = int(np.argmax(tokens))
        raise InfeasibleError(
            f"strategy {strategy!r} puts {int(tokens[r])} tokens on rank {r}, above token_cap={p.token_cap}"
        )
    if p.n and (counts.min() < p.count_lo or counts.max() > p.count_hi):
        raise InfeasibleError(
            f"strategy {strategy!r} gives rank counts {int(counts.min())}..{int(counts.max())}, "
            f"outside equal_counts bounds {p.count_lo}..{p.count_hi}"
        )


def makespan(p: Problem, rank: np.ndarray) -> float:
    if p.n == 0:
        return 0.0
    loads = np.bincount(rank, weights=p.costs, minlength=p.world_size)
    return float((loads / p.cap).max())


def summarise(p: Problem, rank: np.ndarray, strategy: str, solve_time_s: float) -> Partition:
    loads, counts, tokens = rank_sums(p, rank)
    span = float((loads / p.cap).max()) if p.n else 0.0
    lb = p.lower_bound()
    gap = span / lb - 1.0 if lb > 0 else 0.0
    return Partition(
        rank=np.ascontiguousarray(rank, dtype=np.int32),
        loads=loads,
        counts=counts,
        tokens=tokens,
        lower_bound=lb,
        makespan=span,
        gap=float(gap),
        strategy=strategy,
        solve_time_s=float(solve_time_s),
    )
