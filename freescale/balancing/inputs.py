"""Validation and normalisation of `partition` inputs into one `Problem`.

Every strategy works on a `Problem`, so checks (and the cheap infeasibility proofs for token caps)
live in one place and error messages are uniform: one line naming the argument and the bad value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from freescale.balancing.plan_options import DEFAULT_FLOP_WIDTH, PlanOptions
from freescale.balancing.types import InfeasibleError


@dataclass(frozen=True)
class Problem:
    """A validated partition instance. Capacities are normalised to mean 1."""

    costs: np.ndarray  # float64 [N]
    lengths: np.ndarray | None  # int64 [N]
    world_size: int
    cap: np.ndarray  # float64 [K], mean 1
    token_cap: int | None  # per-rank limit on the sum of lengths
    count_lo: int  # every rank takes between count_lo and count_hi samples
    count_hi: int
    equal_counts: bool
    flop_width: int = DEFAULT_FLOP_WIDTH
    """d of the FLOP formula L^2 + 2.5*d*L that strategy flops_kk balances (the model's width)."""

    @property
    def n(self) -> int:
        return int(self.costs.shape[0])

    @property
    def uniform_cap(self) -> bool:
        return bool(np.all(self.cap == self.cap[0]))

    def lower_bound(self) -> float:
        """max(total/sum(cap), max_cost/max(cap)): no assignment can finish earlier."""
        if self.n == 0:
            return 0.0
        return float(max(self.costs.sum() / self.cap.sum(), self.costs.max() / self.cap.max()))


def check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or int(value) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_costs(costs: object) -> np.ndarray:
    arr = np.asarray(costs, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"costs must be 1-D, got shape {arr.shape}")
    bad = ~np.isfinite(arr)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"costs[{i}] = {float(arr[i])!r} is not finite")
    neg = arr < 0
    if neg.any():
        i = int(np.argmax(neg))
        raise ValueError(f"costs[{i}] = {float(arr[i])!r} is negative")
    return arr


def check_lengths(lengths: object, n: int) -> np.ndarray:
    raw = np.asarray(lengths)
    if raw.ndim != 1 or raw.shape[0] != n:
        raise ValueError(f"lengths must be 1-D with one entry per cost ({n}), got shape {raw.shape}")
    if raw.dtype.kind not in "iu":
        arr = raw.astype(np.float64)
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"lengths[{i}] = {float(arr[i])!r} is not an integer")
        raw = arr
    out = raw.astype(np.int64)
    neg = out < 0
    if neg.any():
        i = int(np.argmax(neg))
        raise ValueError(f"lengths[{i}] = {out[i]} is negative")
    return out


def check_capacities(capacities: object, world_size: int) -> np.ndarray:
    if capacities is None:
        return np.ones(world_size)
    cap = np.asarray(capacities, dtype=np.float64)
    if cap.shape != (world_size,):
        raise ValueError(f"capacities must have one entry per rank ({world_size}), got shape {cap.shape}")
    bad = ~np.isfinite(cap) | (cap <= 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"capacities[{i}] = {float(cap[i])!r} must be finite and > 0")
    return cap / cap.mean()


def check_time_limit(time_limit_s: object) -> float | None:
    if time_limit_s is None:
        return None
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, Real) or not (
        math.isfinite(float(time_limit_s)) and float(time_limit_s) > 0
    ):
        raise ValueError(f"time_limit_s must be a positive number or None, got {time_limit_s!r}")
    return float(time_limit_s)


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return int(seed)


def build_problem(
    costs: object,
    world_size: object,
    options: PlanOptions | None = None,
    *,
    lengths: object = None,
) -> Problem:
    """Validate inputs (ValueError) and reject provably infeasible token caps (InfeasibleError);
    of ``options`` (default: its defaults) the problem takes token_cap, equal_counts, capacities
    and flop_width."""
    options = options if options is not None else PlanOptions()
    token_cap, equal_counts = options.token_cap, options.equal_counts
    c = check_costs(costs)
    k = check_positive_int(world_size, "world_size")
    width = check_positive_int(options.flop_width, "flop_width")
    n = c.shape[0]
    lens = None if lengths is None else check_lengths(lengths, n)
    cap = check_capacities(options.capacities, k)

    tcap: int | None = None
    if token_cap is not None:
        if lens is None:
            raise ValueError("token_cap requires lengths (the per-sample token counts)")
        if isinstance(token_cap, bool) or not isinstance(token_cap, Real) or not (
            math.isfinite(float(token_cap)) and float(token_cap) >= 0
        ):
            raise ValueError(f"token_cap must be a non-negative number, got {token_cap!r}")
        # Token sums are integers, so a fractional cap is equivalent to its floor.
        tcap = int(math.floor(float(token_cap)))

    if equal_counts:
        lo, hi = n // k, -(-n // k)
    else:
        lo, hi = 0, n
    problem = Problem(c, lens, k, cap, tcap, lo, hi, bool(equal_counts), width)
    if tcap is not None:
        _check_token_cap_feasible(problem)
    return problem


def _check_token_cap_feasible(p: Problem) -> None:
    """Necessary conditions only; strategies raise themselves if they still find no assignment."""
    assert p.lengths is not None and p.token_cap is not None
    if p.n == 0:
        return
    i = int(np.argmax(p.lengths))
    if p.lengths[i] > p.token_cap:
        raise InfeasibleError(
            f"token_cap={p.token_cap} is below lengths[{i}]={int(p.lengths[i])}: that sample fits on no rank"
        )
    total = int(p.lengths.sum())
    if total > p.world_size * p.token_cap:
        raise InfeasibleError(
            f"token_cap={p.token_cap} x world_size={p.world_size} = {p.world_size * p.token_cap} tokens "
            f"is below the batch total of {total} tokens"
        )
    if p.equal_counts and p.count_lo > 1:
        # The rank holding the longest sample also holds count_lo - 1 others.
        rest = np.sort(np.delete(p.lengths, i))[: p.count_lo - 1]
        need = int(p.lengths[i]) + int(rest.sum())
        if need > p.token_cap:
            raise InfeasibleError(
                f"token_cap={p.token_cap} is below lengths[{i}]={int(p.lengths[i])} plus the "
                f"{p.count_lo - 1} shortest other lengths ({need} tokens), and equal_counts gives "
                f"every rank at least {p.count_lo} samples"
            )
