"""`partition`: assign the samples of one global batch to ranks with a chosen strategy."""
from __future__ import annotations

import time

import numpy as np

from balancing.contiguous import contiguous_ranks
from balancing.cpsat import cpsat_ranks
from balancing.inputs import (
    Problem,
    build_problem,
    check_seed,
    check_strategy,
    check_time_limit,
)
from balancing.karmarkar_karp import kk_ranks
from balancing.local_search import refine
from balancing.lpt import lpt_ranks
from balancing.metrics import check_assignment, summarise
from balancing.types import InfeasibleError, Partition


def descent_budget(p: Problem) -> int:
    """Cap on busiest-rank polish iterations after the pair rounds: the pair rounds do the bulk,
    the polish fixes the last few ranks; N=16384, K=1024 stays well under 200 ms. A count, not a
    clock, so results do not depend on machine speed."""
    return 64 + 2 * p.world_size


def partition(
    costs: object,
    world_size: int,
    *,
    strategy: str = "kk",
    lengths: object = None,
    token_cap: float | None = None,
    equal_counts: bool = False,
    capacities: object = None,
    seed: int = 0,
    time_limit_s: float | None = None,
) -> Partition:
    """Assign every sample to a rank so that max_k load_k / cap_k is small.

    Args:
        costs: per-sample cost (1-D, finite, >= 0), e.g. a*L^2 + b*L + c for history length L.
        world_size: number of ranks K >= 1.
        strategy: "contiguous" (consecutive blocks, ignores costs), "lpt" (greedy),
            "kk" (Karmarkar-Karp BLDM + local search; default) or "ortools" (CP-SAT warm-started
            from kk, never worse than kk).
        lengths: per-sample token counts; needed for token_cap, and reported per rank.
        token_cap: per-rank limit on the sum of lengths; never exceeded (InfeasibleError instead).
        equal_counts: every rank gets floor(N/K) or ceil(N/K) samples.
        capacities: relative rank speeds (> 0), normalised to mean 1.
        seed: makes "ortools" reproducible (the other strategies are deterministic anyway).
        time_limit_s: CP-SAT budget in deterministic seconds (default 2).

    Raises:
        ValueError: malformed input, naming the argument and value.
        InfeasibleError: the token cap (with equal_counts) cannot be met, or the strategy found no
            assignment meeting it.
    """
    strategy = check_strategy(strategy)
    seed = check_seed(seed)
    time_limit_s = check_time_limit(time_limit_s)
    p = build_problem(
        costs, world_size, lengths=lengths, token_cap=token_cap, equal_counts=equal_counts, capacities=capacities
    )
    start = time.perf_counter()
    rank = _solve(p, strategy, seed, time_limit_s)
    elapsed = time.perf_counter() - start
    check_assignment(p, rank, strategy)  # a broken constraint must never leave this function
    return summarise(p, rank, strategy, elapsed)


def _solve(p: Problem, strategy: str, seed: int, time_limit_s: float | None) -> np.ndarray:
    if strategy == "contiguous":
        return contiguous_ranks(p.n, p.world_size)
    if strategy == "lpt":
        return lpt_ranks(p)
    if strategy == "kk":
        return _kk(p)
    warm: np.ndarray | None
    try:
        warm = _kk(p)
    except InfeasibleError:
        warm = None  # CP-SAT may still find (or disprove) a feasible assignment from scratch
    return cpsat_ranks(p, warm, seed, time_limit_s)


def _kk(p: Problem) -> np.ndarray:
    try:
        return refine(p, kk_ranks(p), descent_budget(p), "kk")
    except InfeasibleError:
        if p.token_cap is None:
            raise
    # Repair of the LDM start got stuck under the token cap: greedy LPT builds within the cap.
    try:
        start = lpt_ranks(p)
    except InfeasibleError:
        raise InfeasibleError(
            f"kk found no assignment under token_cap={p.token_cap}: neither repair of the LDM start "
            f"nor greedy LPT fits {int(p.lengths.sum())} tokens on {p.world_size} ranks"  # type: ignore[union-attr]
        ) from None
    return refine(p, start, descent_budget(p), "kk")
