"""The partition strategies, by name: the one list `partition`, `plan` and `freescale balance` share.

A strategy is a solver ``(problem, seed, time_limit_s) -> rank of every sample`` (int32 [N]);
strategies that are deterministic anyway ignore the seed, and only ortools reads the time limit.
Adding a strategy is its module (the algorithm, on a ``Problem``) plus one entry in ``SOLVERS``.

Importing this module loads numpy and the strategy modules only: ``freescale.balancing.ortools`` imports
OR-Tools inside its solve, so the balance job's argument parser stays light.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from freescale.balancing.contiguous import contiguous_ranks
from freescale.balancing.flops_kk import flops_kk_ranks
from freescale.balancing.inputs import Problem
from freescale.balancing.karmarkar_karp import kk_ranks
from freescale.balancing.local_search import refine
from freescale.balancing.lpt import lpt_ranks
from freescale.balancing.ortools import ortools_ranks
from freescale.balancing.types import InfeasibleError

Solver = Callable[[Problem, int, float | None], np.ndarray]


def descent_budget(p: Problem) -> int:
    """Cap on busiest-rank polish iterations after the pair rounds: the pair rounds do the bulk,
    the polish fixes the last few ranks; N=16384, K=1024 stays well under 200 ms. A count, not a
    clock, so results do not depend on machine speed."""
    return 64 + 2 * p.world_size


def _contiguous(p: Problem, seed: int, time_limit_s: float | None) -> np.ndarray:
    return contiguous_ranks(p.n, p.world_size)


def _lpt(p: Problem, seed: int, time_limit_s: float | None) -> np.ndarray:
    return lpt_ranks(p)


def _kk(p: Problem, seed: int, time_limit_s: float | None) -> np.ndarray:
    """LDM start, token-cap repair and local search; greedy LPT restarts a repair that got stuck."""
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


def _flops_kk(p: Problem, seed: int, time_limit_s: float | None) -> np.ndarray:
    return flops_kk_ranks(p)


def _ortools(p: Problem, seed: int, time_limit_s: float | None) -> np.ndarray:
    """CP-SAT warm-started from kk, so never worse than kk."""
    warm: np.ndarray | None
    try:
        warm = _kk(p, seed, time_limit_s)
    except InfeasibleError:
        warm = None  # CP-SAT may still find (or disprove) a feasible assignment from scratch
    return ortools_ranks(p, warm, seed, time_limit_s)


SOLVERS: dict[str, Solver] = {
    "contiguous": _contiguous,  # consecutive blocks, ignores costs: the data-parallel baseline
    "lpt": _lpt,  # greedy longest-first
    "kk": _kk,  # Karmarkar-Karp + local search (the default)
    "ortools": _ortools,  # CP-SAT from the kk start
    "flops_kk": _flops_kk,  # the peer's online balancer: kk on FLOPs, equal counts, one batch at a time
}

PER_BATCH: frozenset[str] = frozenset({"flops_kk"})
"""Strategies that balance each global batch alone: a plan with them takes no window (and flops_kk,
like the balancer it reproduces, no token cap)."""


def per_batch_conflict(strategy: str, window_steps: int, token_cap: object) -> str:
    """What a per-batch strategy cannot take, for the jobs' one-line errors; "" when nothing."""
    if strategy not in PER_BATCH:
        return ""
    if window_steps != 1:
        return f"strategy {strategy} balances each global batch alone: --window-steps must be 1, got {window_steps}"
    if token_cap is not None:
        return f"strategy {strategy} takes no --token-cap: the online FLOP balancer it reproduces has none"
    return ""

STRATEGIES: tuple[str, ...] = tuple(SOLVERS)


def check_strategy(strategy: object) -> str:
    if strategy not in SOLVERS:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return str(strategy)
