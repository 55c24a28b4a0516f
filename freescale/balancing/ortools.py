"""Exact and large-neighbourhood makespan minimisation with OR-Tools CP-SAT.

Samples with the same (cost, length) are interchangeable, so the model counts them: x[g, k] is how
many samples of bucket g go to rank k. Costs are scaled to integers per rank (cost / cap_k), so the
objective max_k load_k / cap_k is a plain integer makespan.

Small instances (K * buckets <= FULL_MODEL_MAX_VARS) are solved as one model. Larger ones are
improved by large-neighbourhood search: each round frees the samples of the busiest, the idlest and
a few random ranks and re-solves that sub-problem exactly (within a deterministic time slice).

Determinism: one worker, a fixed seed and limits in CP-SAT's deterministic time (plus a fixed
charge per model variable for model building), so the same inputs give the same assignment and
``time_limit_s`` is honoured approximately, not exactly, in wall seconds. A wall-clock cap at
several times the budget guards against pathological solves; only if it fires can runs differ.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from freescale.balancing.inputs import Problem
from freescale.balancing.metrics import makespan
from freescale.balancing.types import InfeasibleError

if TYPE_CHECKING:  # CP-SAT loads inside the solve (see `_solve_subset`)
    from ortools.sat.python import cp_model

DEFAULT_TIME_LIMIT_S = 2.0
FULL_MODEL_MAX_VARS = 6000
# Without a warm start (kk found nothing under a token cap) only models up to this size are tried.
COLD_MODEL_MAX_VARS = 100_000
LNS_BUSIEST, LNS_IDLEST, LNS_RANDOM = 3, 3, 2
# LNS stops after this many rounds in a row without improvement.
LNS_PATIENCE = 8
# Model building in Python costs wall time that CP-SAT's deterministic clock does not see; each
# solve is charged this much per variable on top, so the budget tracks wall seconds on one core
# while staying a deterministic quantity.
BUILD_CHARGE_S_PER_VAR = 3e-5
# Integer scale: the largest per-rank scaled load stays below 2**30. Rounding then changes a
# rank's time by at most N * 2**-31 relative. Larger scales are not safe: with coefficients near
# 2**40, CP-SAT 9.15 wrongly reported small feasible models INFEASIBLE in our tests.
SCALE_BITS = 30


def ortools_ranks(p: Problem, warm: np.ndarray | None, seed: int, time_limit_s: float | None) -> np.ndarray:
    """Best assignment found by CP-SAT, never worse than ``warm`` (when given)."""
    budget = DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    if p.n == 0:
        return np.zeros(0, dtype=np.int32)
    n_buckets = _buckets(p, np.arange(p.n))[1]
    n_vars = p.world_size * n_buckets
    if warm is None and n_vars > COLD_MODEL_MAX_VARS:
        raise InfeasibleError(
            f"ortools: kk found no assignment under token_cap={p.token_cap} and the instance "
            f"({n_vars} variables) is too large to search from scratch"
        )
    if n_vars <= FULL_MODEL_MAX_VARS or warm is None:
        det = max(budget - BUILD_CHARGE_S_PER_VAR * p.world_size * n_buckets, 0.05 * budget)
        result = _solve_subset(p, np.arange(p.n), np.arange(p.world_size), warm, seed, det, proof=True)
        if result is None:
            if warm is None:
                raise InfeasibleError(
                    f"ortools found no assignment meeting token_cap={p.token_cap} "
                    f"(equal_counts={p.equal_counts}) within {budget:g} s of deterministic time"
                )
            return warm
        rank = result[0]
        if warm is not None and makespan(p, rank) >= makespan(p, warm):
            return warm
        return rank
    return _lns(p, warm, seed, budget)


def _buckets(p: Problem, items: np.ndarray) -> tuple[np.ndarray, int, np.ndarray, np.ndarray | None]:
    """(bucket of each item, number of buckets, cost per bucket, length per bucket)."""
    c = p.costs[items]
    if p.lengths is None:
        vals, inv = np.unique(c, return_inverse=True)
        return inv, vals.size, vals, None
    ln = p.lengths[items]
    keys = np.stack([c, ln.astype(np.float64)], axis=1)
    vals, inv = np.unique(keys, axis=0, return_inverse=True)
    return inv.reshape(-1), vals.shape[0], vals[:, 0], vals[:, 1].astype(np.int64)


def _solve_subset(
    p: Problem,
    items: np.ndarray,
    ranks: np.ndarray,
    hint: np.ndarray | None,
    seed: int,
    det_time: float,
    proof: bool,
) -> tuple[np.ndarray, float] | None:
    """Optimally (within ``det_time``) reassign ``items`` among ``ranks``.

    Returns (rank per item of the whole problem, deterministic time used), or None when CP-SAT
    found no solution. Raises InfeasibleError when ``proof`` and CP-SAT proves infeasibility.
    """
    # Imported here: ortools' CP-SAT module pulls in pandas (~0.3 s), which the other strategies
    # should not pay for.
    from ortools.sat.python import cp_model

    bucket, n_b, b_cost, b_len = _buckets(p, items)
    n_r = ranks.size
    w = _scaled_weights(p, items, ranks, b_cost)  # [n_b, n_r]
    # Ranks with equal capacity are interchangeable: the model orders their loads.
    order_pos = np.argsort(p.cap[ranks], kind="stable")
    model, x, span = _build_model(p, np.bincount(bucket, minlength=n_b), w, b_len, p.cap[ranks], order_pos)
    if hint is not None:
        _add_hint(model, x, span, w, _hint_counts(hint[items], bucket, ranks, n_b, w, p.cap[ranks], order_pos))

    solver = _solver(seed, det_time)
    status = solver.Solve(model)
    # Without a token cap every model here is feasible, so INFEASIBLE can only be a numerical
    # artefact; it is trusted (and raised) only for a token-capped model with no known solution.
    if status == cp_model.INFEASIBLE and proof and hint is None and p.token_cap is not None:
        raise InfeasibleError(
            f"ortools proved that no assignment meets token_cap={p.token_cap} "
            f"(equal_counts={p.equal_counts}, world_size={p.world_size})"
        )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    counts = np.array([[solver.Value(x[g][j]) for j in range(n_r)] for g in range(n_b)], dtype=np.int64)
    rank = np.empty(p.n, dtype=np.int32) if hint is None else hint.astype(np.int32, copy=True)
    rank[items] = _decode(bucket, counts, ranks)
    return rank, float(solver.deterministic_time) + BUILD_CHARGE_S_PER_VAR * n_b * n_r


def _scaled_weights(p: Problem, items: np.ndarray, ranks: np.ndarray, b_cost: np.ndarray) -> np.ndarray:
    """``[buckets, ranks]`` integer cost of one sample of each bucket on each rank (cost / cap,
    scaled so the largest possible load stays below 2**SCALE_BITS)."""
    inv_cap = 1.0 / p.cap[ranks]
    total = float(p.costs[items].sum())
    scale = float(2**SCALE_BITS) / max(total * float(inv_cap.max()), 1e-300)
    return np.rint(b_cost[:, None] * inv_cap[None, :] * scale).astype(np.int64)


def _build_model(
    p: Problem,
    b_count: np.ndarray,
    w: np.ndarray,
    b_len: np.ndarray | None,
    cap: np.ndarray,
    order_pos: np.ndarray,
) -> tuple[cp_model.CpModel, list[list[cp_model.IntVar]], cp_model.IntVar]:
    """(model, x[bucket][rank] counts, span): minimise the largest scaled load ``span`` with every
    bucket placed, under the count and token limits; equal-capacity ranks (adjacent in
    ``order_pos``, ranks by capacity) hold non-increasing loads, which cuts symmetric branches."""
    from ortools.sat.python import cp_model

    n_b, n_r = w.shape
    model = cp_model.CpModel()
    x = [[model.NewIntVar(0, int(b_count[g]), "") for _ in range(n_r)] for g in range(n_b)]
    span = model.NewIntVar(0, 2 ** (SCALE_BITS + 1), "span")
    for g in range(n_b):
        model.Add(sum(x[g]) == int(b_count[g]))
    loads = []
    for j in range(n_r):
        col = [x[g][j] for g in range(n_b)]
        load = cp_model.LinearExpr.WeightedSum(col, w[:, j].tolist())
        loads.append(load)
        model.Add(load <= span)
        if p.equal_counts:
            model.AddLinearConstraint(sum(col), p.count_lo, p.count_hi)
        if p.token_cap is not None:
            model.Add(cp_model.LinearExpr.WeightedSum(col, b_len.tolist()) <= p.token_cap)  # type: ignore[union-attr]
    model.Minimize(span)
    for a, b in zip(order_pos[:-1], order_pos[1:]):
        if cap[a] == cap[b]:
            model.Add(loads[a] >= loads[b])
    return model, x, span


def _add_hint(
    model: cp_model.CpModel,
    x: list[list[cp_model.IntVar]],
    span: cp_model.IntVar,
    w: np.ndarray,
    hint_counts: np.ndarray,
) -> None:
    """Start the search from the hinted bucket counts (and their span)."""
    n_b, n_r = w.shape
    for g in range(n_b):
        for j in range(n_r):
            model.AddHint(x[g][j], int(hint_counts[g, j]))
    model.AddHint(span, int((hint_counts * w).sum(axis=0).max()))


def _solver(seed: int, det_time: float) -> cp_model.CpSolver:
    """A deterministic CP-SAT solver: one worker, ``seed``, ``det_time`` of deterministic time (and a
    wall-clock guard at several times that)."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers = 1
    prm.random_seed = int(seed) % (2**31)
    prm.max_deterministic_time = float(det_time)
    prm.max_time_in_seconds = 4.0 * float(det_time) + 1.0
    return solver


def _hint_counts(
    hint_rank: np.ndarray,
    bucket: np.ndarray,
    ranks: np.ndarray,
    n_b: int,
    w: np.ndarray,
    cap: np.ndarray,
    order_pos: np.ndarray,
) -> np.ndarray:
    """Bucket counts of the hint, with equal-capacity ranks permuted to satisfy the symmetry cuts."""
    pos = np.searchsorted(ranks, hint_rank)
    counts = np.zeros((n_b, ranks.size), dtype=np.int64)
    np.add.at(counts, (bucket, pos), 1)
    loads = (counts * w).sum(axis=0)
    start = 0
    while start < order_pos.size:
        end = start
        while end + 1 < order_pos.size and cap[order_pos[end + 1]] == cap[order_pos[start]]:
            end += 1
        group = order_pos[start : end + 1]
        by_load = group[np.argsort(-loads[group], kind="stable")]
        counts[:, group] = counts[:, by_load]
        start = end + 1
    return counts


def _decode(bucket: np.ndarray, counts: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Rank per item: within each bucket, items in input order fill ranks in model order."""
    by_bucket = np.argsort(bucket, kind="stable")
    flat = np.repeat(np.tile(ranks, counts.shape[0]), counts.reshape(-1))
    out = np.empty(bucket.size, dtype=np.int32)
    out[by_bucket] = flat
    return out


def _lns(p: Problem, warm: np.ndarray, seed: int, budget: float) -> np.ndarray:
    rng = np.random.default_rng(seed % (2**63))  # any int seed; numpy wants a non-negative one
    rank = warm.astype(np.int32, copy=True)
    k = p.world_size
    lb = p.lower_bound()
    slice_s = max(budget / 20.0, 0.02)
    spent = 0.0
    round_no = 0
    idle_rounds = 0
    loads = np.bincount(rank, weights=p.costs, minlength=k)
    while spent < budget and idle_rounds < LNS_PATIENCE:
        key = loads / p.cap
        if key.max() <= lb * (1.0 + 1e-12):
            break
        order = np.argsort(-key, kind="stable")
        chosen = list(order[:LNS_BUSIEST]) + list(order[-LNS_IDLEST:])
        middle = order[LNS_BUSIEST:-LNS_IDLEST]
        if middle.size:
            chosen += list(rng.choice(middle, size=min(LNS_RANDOM, middle.size), replace=False))
        ranks = np.unique(np.array(chosen, dtype=np.int64))
        items = np.flatnonzero(np.isin(rank, ranks))
        before = float(key[ranks].max())
        round_no += 1
        idle_rounds += 1
        result = _solve_subset(p, items, ranks, rank, seed + round_no, min(slice_s, budget - spent), proof=False)
        if result is None:
            spent += slice_s
            continue
        new_rank, used = result
        spent += used
        new_loads = np.bincount(new_rank[items], weights=p.costs[items], minlength=k)[ranks]
        if float((new_loads / p.cap[ranks]).max()) < before * (1.0 - 1e-12):
            rank = new_rank
            loads[ranks] = new_loads
            idle_rounds = 0
    return rank
