"""`partition`: assign the samples of one global batch to ranks with a chosen strategy."""
from __future__ import annotations

import time

from freescale.balancing.inputs import DEFAULT_FLOP_WIDTH, build_problem, check_seed, check_time_limit
from freescale.balancing.metrics import check_assignment, summarise
from freescale.balancing.strategies import SOLVERS, check_strategy
from freescale.balancing.types import Partition


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
    flop_width: int = DEFAULT_FLOP_WIDTH,
) -> Partition:
    """Assign every sample to a rank so that max_k load_k / cap_k is small.

    Args:
        costs: per-sample cost (1-D, finite, >= 0), e.g. a*L^2 + b*L + c for history length L.
        world_size: number of ranks K >= 1.
        strategy: a name in ``STRATEGIES`` (``freescale.balancing.strategies`` describes each); default "kk"
            (Karmarkar-Karp + local search); "ortools" is never worse than kk.
        lengths: per-sample token counts; needed for token_cap, and reported per rank.
        token_cap: per-rank limit on the sum of lengths; never exceeded (InfeasibleError instead).
        equal_counts: every rank gets floor(N/K) or ceil(N/K) samples.
        capacities: relative rank speeds (> 0), normalised to mean 1.
        seed: makes "ortools" reproducible (the other strategies are deterministic anyway).
        time_limit_s: CP-SAT budget in deterministic seconds (default 2).
        flop_width: the model width d in the FLOP formula L^2 + 2.5*d*L of "flops_kk" (needs lengths).

    Raises:
        ValueError: malformed input, naming the argument and value.
        InfeasibleError: the token cap (with equal_counts) cannot be met, or the strategy found no
            assignment meeting it.
    """
    strategy = check_strategy(strategy)
    seed = check_seed(seed)
    time_limit_s = check_time_limit(time_limit_s)
    p = build_problem(
        costs, world_size, lengths=lengths, token_cap=token_cap, equal_counts=equal_counts, capacities=capacities,
        flop_width=flop_width,
    )
    start = time.perf_counter()
    rank = SOLVERS[strategy](p, seed, time_limit_s)
    elapsed = time.perf_counter() - start
    check_assignment(p, rank, strategy)  # a broken constraint must never leave this function
    return summarise(p, rank, strategy, elapsed)
