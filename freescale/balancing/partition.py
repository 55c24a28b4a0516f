"""`partition`: assign the samples of one global batch to ranks with a chosen strategy."""
from __future__ import annotations

import time
from typing import Any

from freescale.balancing.inputs import build_problem, check_seed, check_time_limit
from freescale.balancing.metrics import check_assignment, summarise
from freescale.balancing.plan_options import PlanOptions
from freescale.balancing.strategies import SOLVERS, check_strategy
from freescale.balancing.types import Partition


def partition(
    costs: object,
    world_size: int,
    options: PlanOptions | None = None,
    *,
    lengths: object = None,
    **overrides: Any,
) -> Partition:
    """Assign every sample to a rank so that max_k load_k / cap_k is small.

    Args:
        costs: per-sample cost (1-D, finite, >= 0), e.g. a*L^2 + b*L + c for history length L.
        world_size: number of ranks K >= 1.
        options: the planner's options (``PlanOptions``; default kk, no cap, equal capacities), with
            ``overrides`` (the same names as keywords) replacing its fields; its window_steps must be 1.
        lengths: per-sample token counts; needed for token_cap and flops_kk, and reported per rank.

    Raises:
        ValueError: malformed input, naming the argument and value.
        InfeasibleError: the token cap (with equal_counts) cannot be met, or the strategy found no
            assignment meeting it.
    """
    opts = PlanOptions.of(options, **overrides)
    if opts.window_steps != 1:
        raise ValueError(f"partition balances one global batch: window_steps must be 1 (plan takes windows), "
                         f"got {opts.window_steps!r}")
    strategy = check_strategy(opts.strategy)
    seed = check_seed(opts.seed)
    time_limit_s = check_time_limit(opts.time_limit_s)
    p = build_problem(costs, world_size, opts, lengths=lengths)
    start = time.perf_counter()
    rank = SOLVERS[strategy](p, seed, time_limit_s)
    elapsed = time.perf_counter() - start
    check_assignment(p, rank, strategy)  # a broken constraint must never leave this function
    return summarise(p, rank, strategy, elapsed)
