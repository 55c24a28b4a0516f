"""`plan`: balance a window of global batches over (step, rank).

Per-step balancing cannot help when one sample costs more than a rank's share of its step: that
rank sets the step time and the others wait. Within a window, samples may change step, so the
heavy samples are gathered into steps whose total is large enough to absorb them, in exchange for
light samples. Moves are 1-for-1 swaps, so every step keeps its sample count.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np

from freescale.balancing.inputs import (
    check_capacities,
    check_costs,
    check_lengths,
    check_seed,
    check_time_limit,
    check_positive_int,
)
from freescale.balancing.metrics import bubble_of_totals
from freescale.balancing.partition import partition
from freescale.balancing.plan_options import PlanOptions
from freescale.balancing.strategies import PER_BATCH, check_strategy
from freescale.balancing.types import Plan

# Swaps per window at most, per step in the window; the search usually stops far earlier, when no
# swap lowers the total overshoot.
MAX_SWAPS_PER_STEP = 4096


def plan(
    costs: object,
    world_size: int,
    local_batch_size: int,
    options: PlanOptions | None = None,
    *,
    lengths: object = None,
    **overrides: Any,
) -> Plan:
    """Assign every sample a (step, rank).

    Sample i originally belongs to step i // (K*B); the last step may be partial. Steps are
    grouped into consecutive windows of ``options.window_steps`` (so N may exceed window_steps*K*B: each
    window is planned on its own). Within a window, samples are swapped between steps only while
    that lowers the sum over steps of max(largest cost / max(cap), step total / sum(cap)), then each
    step is split over ranks by ``partition`` with the same options and a per-step seed.
    ``options`` is a ``PlanOptions`` (default: its defaults), ``overrides`` the same names as
    keywords, replacing its fields; ``lengths`` the per-sample token counts.
    window_steps=1 moves nothing; strategies that balance one global batch at a time (``PER_BATCH``)
    take no other window.

    Raises ValueError on malformed input and InfeasibleError when a step's token cap cannot be met.
    """
    opts = PlanOptions.of(options, **overrides)
    c = check_costs(costs)
    k = check_positive_int(world_size, "world_size")
    b = check_positive_int(local_batch_size, "local_batch_size")
    w = check_positive_int(opts.window_steps, "window_steps")
    strategy = _check_window_strategy(opts.strategy, w)
    seed = check_seed(opts.seed)
    time_limit_s = check_time_limit(opts.time_limit_s)
    lens = _check_plan_lengths(c, lengths, opts.token_cap)
    cap = check_capacities(opts.capacities, k)

    start = time.perf_counter()
    n, g = c.shape[0], k * b
    num_steps = -(-n // g)
    original = (np.arange(n) // g).astype(np.int32)
    step = _rebalance_windows(original, c, k, b, w, float(cap.max()), lens, opts.token_cap, opts.equal_counts)
    per_step = replace(opts, window_steps=1, strategy=strategy, time_limit_s=time_limit_s)
    rank, loads, spans, bounds = _partition_steps(c, step, num_steps, k, lens, seed, per_step)
    elapsed = time.perf_counter() - start

    ideal = float(c.sum()) / float(cap.sum())
    return Plan(
        step=step, rank=rank, loads=loads, num_steps=num_steps, moved=int(np.count_nonzero(step != original)),
        bubble=bubble_of_totals(ideal, float(spans.sum())),
        lower_bound_bubble=bubble_of_totals(ideal, float(bounds.sum())),
        strategy=strategy, solve_time_s=elapsed,
    )


def _check_window_strategy(strategy: str, window_steps: int) -> str:
    """The checked strategy name; one that balances each global batch alone takes no window."""
    strategy = check_strategy(strategy)
    if strategy in PER_BATCH and window_steps != 1:
        raise ValueError(
            f"strategy {strategy!r} balances each global batch alone: window_steps must be 1, got {window_steps}"
        )
    return strategy


def _check_plan_lengths(costs: np.ndarray, lengths: object, token_cap: float | None) -> np.ndarray | None:
    """The checked per-sample token counts (None without); a plan needs samples, a token cap lengths."""
    n = costs.shape[0]
    if n == 0:
        raise ValueError("costs is empty: a plan needs at least one sample")
    lens = None if lengths is None else check_lengths(lengths, n)
    if token_cap is not None and lens is None:
        raise ValueError("token_cap requires lengths (the per-sample token counts)")
    return lens


def _rebalance_windows(
    original: np.ndarray,
    costs: np.ndarray,
    world_size: int,
    local_batch_size: int,
    window_steps: int,
    max_cap: float,
    lengths: np.ndarray | None,
    token_cap: float | None,
    equal_counts: bool,
) -> np.ndarray:
    """New step of each sample (``original``: its step in input order), one window at a time;
    windows of one step move nothing."""
    if window_steps == 1:
        return original.copy()
    n = costs.shape[0]
    g = world_size * local_batch_size
    num_steps = -(-n // g)
    tcap_total = None if token_cap is None else float(token_cap) * world_size
    step = original.copy()
    for first in range(0, num_steps, window_steps):
        lo, hi = first * g, min(n, (first + window_steps) * g)
        local = original[lo:hi] - first
        step[lo:hi] = first + rebalance_steps(
            costs[lo:hi],
            local,
            world_size,
            max_cap,
            None if lengths is None else lengths[lo:hi],
            tcap_total,
            equal_counts=equal_counts,
        )
    return step


def _partition_steps(
    costs: np.ndarray,
    step: np.ndarray,
    num_steps: int,
    world_size: int,
    lengths: np.ndarray | None,
    seed: int,
    options: PlanOptions,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split each step's samples over the ranks with ``partition`` (``options`` with a per-step seed).

    Returns the rank of each sample and, per step, the rank loads [S, K], the makespan and its
    lower bound.
    """
    n = costs.shape[0]
    rank = np.empty(n, dtype=np.int32)
    loads = np.zeros((num_steps, world_size))
    spans = np.zeros(num_steps)
    bounds = np.zeros(num_steps)
    by_step = np.argsort(step, kind="stable")  # input order within each step
    edges = np.searchsorted(step[by_step], np.arange(num_steps + 1))
    for s in range(num_steps):
        idx = by_step[edges[s] : edges[s + 1]]
        part = partition(
            costs[idx],
            world_size,
            replace(options, seed=_step_seed(seed, s)),
            lengths=None if lengths is None else lengths[idx],
        )
        rank[idx] = part.rank
        loads[s] = part.loads
        spans[s] = part.makespan
        bounds[s] = part.lower_bound
    return rank, loads, spans, bounds


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**31 - 1)


def rebalance_steps(
    costs: np.ndarray,
    step: np.ndarray,
    world_size: int,
    max_cap: float,
    lengths: np.ndarray | None,
    step_token_cap: float | None,
    *,
    equal_counts: bool = False,
) -> np.ndarray:
    """New step (0..S-1) for each sample of one window; every step keeps its sample count.

    A step's time is at least f(s) = max(max_cost_s / max_cap, total_s / K) (capacities
    normalised to mean 1, so K is their sum); the window's ideal is sum_s total_s / K, reached when
    every sample fits its step's share: c_i / max_cap <= total_s / K. The descent minimises the
    total overshoot

        phi = sum_s sum_{i in s} max(0, c_i / max_cap - total_s / K),

    which is 0 exactly when every step meets its ideal. Minimising sum_s f(s) directly stalls on
    heavy tails: when every step holds several oversized samples, moving one of them changes no
    step's maximum. phi instead rewards gathering oversized samples into steps whose totals grow
    large enough to absorb them, in exchange for small samples.

    Each iteration takes the step with the largest overshoot and swaps its largest sample x with
    the sample y of another step that lowers phi the most (a few candidate y per step, found by
    binary search: the smallest, those near the kinks of f, and a geometric ladder below x).
    A step with no improving swap is skipped until another swap changes the state. With a token
    cap, a swap must keep both steps' token totals within K * token_cap.

    With equal counts the rank holding a large sample must also take n_s // K - 1 others, so a
    sample only fits if c_i + filler_s <= max_cap * total_s / K, where filler_s is n_s // K - 1
    times the mean of the smallest tenth of the step's costs (held fixed while a swap is scored).
    """
    k = float(world_size)
    cm = max_cap
    n_steps = int(step.max()) + 1
    w = _Window(
        costs, step, n_steps, lengths if step_token_cap is not None else None, world_size if equal_counts else 0
    )
    new_step = step.astype(np.int32, copy=True)
    scale = float(costs.sum()) / k / max(n_steps, 1)
    tol = 1e-9 * max(scale, 1e-300)
    phi = np.array([w.overshoot(s, k, cm) for s in range(n_steps)])
    stuck = np.zeros(n_steps, dtype=bool)
    for _ in range(MAX_SWAPS_PER_STEP * n_steps):
        open_phi = np.where(stuck, -np.inf, phi)
        s = int(np.argmax(open_phi))
        if open_phi[s] <= tol:
            break
        best = _best_swap(w, s, phi, k, cm, step_token_cap)
        if best is None or best[0] >= -tol:
            stuck[s] = True
            continue
        _, t, pos_y = best
        ix, iy = w.swap(s, t, pos_y)
        new_step[ix], new_step[iy] = new_step[iy], new_step[ix]
        phi[s], phi[t] = w.overshoot(s, k, cm), w.overshoot(t, k, cm)
        stuck[:] = False
    return new_step


class _Window:
    """Per-step sorted costs, sample ids and prefix sums as [S, width] arrays, kept sorted.

    ``search`` holds each row's costs plus a row offset (padding above every real value), so one
    searchsorted on its flat view answers a binary search in every step at once.
    """

    def __init__(
        self, costs: np.ndarray, step: np.ndarray, n_steps: int, lengths: np.ndarray | None, count_ranks: int
    ) -> None:
        self.costs = costs
        self.count_ranks = count_ranks  # K when counts are equal (filler matters), else 0
        self.filler = np.zeros(n_steps)
        self.lengths = lengths
        order = np.lexsort((costs, step))
        sizes = np.bincount(step, minlength=n_steps)
        self.n = sizes.astype(np.int64)
        width = int(sizes.max())
        self.width = width
        self.top = float(costs.max()) if costs.size and costs.max() > 0 else 1.0
        self.stride = 4.0 * self.top
        self.pad = 2.0 * self.top
        self.offset = np.arange(n_steps) * self.stride
        self.vals = np.full((n_steps, width), self.pad)
        self.ids = np.full((n_steps, width), -1, dtype=np.int64)
        col = np.arange(order.size) - np.repeat(np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        self.vals[step[order], col] = costs[order]
        self.ids[step[order], col] = order
        self.prefix = np.zeros((n_steps, width + 1))
        self.search = np.empty((n_steps, width))
        self.tokens = None if lengths is None else np.bincount(step, weights=lengths, minlength=n_steps)
        for s in range(n_steps):
            self._refresh(s)

    def _refresh(self, s: int) -> None:
        n = self.n[s]
        self.prefix[s, 1:] = np.cumsum(np.where(np.arange(self.width) < n, self.vals[s], 0.0))
        self.search[s] = self.vals[s] + self.offset[s]
        if self.count_ranks:
            small = max(1, -(-n // 10))
            self.filler[s] = max(n // self.count_ranks - 1, 0) * self.prefix[s, small] / small

    def overshoot(self, s: int, k: float, cm: float) -> float:
        n = int(self.n[s])
        v, pre = self.vals[s, :n], self.prefix[s]
        limit = pre[n] / k * cm - self.filler[s]  # largest cost that fits the step's share
        le = int(np.searchsorted(v, limit, side="right"))
        return float((pre[n] - pre[le] - (n - le) * limit) / cm)

    def find(self, rows: np.ndarray, targets: np.ndarray, side: str) -> np.ndarray:
        """Per-row searchsorted of ``targets`` (broadcast against ``rows[:, None]``)."""
        clipped = np.clip(targets, -self.top, 1.5 * self.top) + self.offset[rows][:, None]
        pos = np.searchsorted(self.search.ravel(), clipped, side=side)  # type: ignore[call-overload]
        return pos - (rows * self.width)[:, None]

    def swap(self, s: int, t: int, pos_y: int) -> tuple[int, int]:
        """Exchange the largest sample of s with sample pos_y of t; returns their indices."""
        ns, nt = int(self.n[s]), int(self.n[t])
        ix, iy = int(self.ids[s, ns - 1]), int(self.ids[t, pos_y])
        x, y = float(self.costs[ix]), float(self.costs[iy])
        # s: drop its last (largest) entry, insert y.
        p = int(np.searchsorted(self.vals[s, : ns - 1], y, side="right"))
        self.vals[s, p + 1 : ns] = self.vals[s, p : ns - 1]
        self.ids[s, p + 1 : ns] = self.ids[s, p : ns - 1]
        self.vals[s, p], self.ids[s, p] = y, iy
        # t: drop pos_y, insert x.
        vt = np.delete(self.vals[t, :nt], pos_y)
        it = np.delete(self.ids[t, :nt], pos_y)
        q = int(np.searchsorted(vt, x, side="right"))
        self.vals[t, :nt] = np.insert(vt, q, x)
        self.ids[t, :nt] = np.insert(it, q, ix)
        self._refresh(s)
        self._refresh(t)
        if self.tokens is not None and self.lengths is not None:
            d = float(self.lengths[ix]) - float(self.lengths[iy])
            self.tokens[s] -= d
            self.tokens[t] += d
        return ix, iy


# Candidate y below x: x * 2**-j for these j (besides the kinks of f and the smallest sample).
_LADDER = 2.0 ** -np.arange(1, 9)


def _best_swap(
    w: _Window, s: int, phi: np.ndarray, k: float, cm: float, step_token_cap: float | None
) -> tuple[float, int, int] | None:
    """(change in phi, t, position of y in t) of the best swap of step s's largest sample x."""
    ns = int(w.n[s])
    vs, ps = w.vals[s, :ns], w.prefix[s]
    x = float(vs[-1])
    second = float(vs[-2]) if ns > 1 else 0.0
    rest = float(ps[ns]) - x
    rows = np.arange(w.n.size)
    nt = w.n
    tt = w.prefix[rows, nt]
    fixed = np.concatenate([[k * second / cm - rest, second, rest * cm / max(k - cm, 1e-12)], x * _LADDER])
    targets = np.concatenate([np.broadcast_to(fixed, (rows.size, fixed.size)), (tt + x - k * x / cm)[:, None]], axis=1)
    pos = w.find(rows, targets, "left")
    pos = np.concatenate([pos - 1, pos, np.zeros((rows.size, 1), dtype=pos.dtype)], axis=1)
    pos = np.clip(pos, 0, (nt - 1)[:, None])
    y = w.vals[rows[:, None], pos]
    valid = (y < x) & (rows != s)[:, None]
    if not valid.any():
        return None

    # Step s without x, with y.
    limit_s = (rest + y) / k * cm - w.filler[s]
    le = np.minimum(np.searchsorted(vs, limit_s, side="right"), ns - 1)
    y_over = y > limit_s
    phi_s = (ps[ns - 1] - ps[le] + np.where(y_over, y, 0.0) - ((ns - 1) - le + y_over) * limit_s) / cm

    # Step t without y, with x.
    limit_t = (tt[:, None] + x - y) / k * cm - w.filler[:, None]
    le = np.clip(w.find(rows, limit_t, "right"), 0, nt[:, None])
    y_was_over = pos >= le
    x_over = x > limit_t
    top = w.prefix[rows[:, None], nt[:, None]] - w.prefix[rows[:, None], le]
    top = top - np.where(y_was_over, y, 0.0) + np.where(x_over, x, 0.0)
    count = nt[:, None] - le - y_was_over + x_over
    phi_t = (top - count * limit_t) / cm

    delta = phi_s + phi_t - phi[s] - phi[:, None]
    if w.tokens is not None and w.lengths is not None and step_token_cap is not None:
        len_x = float(w.lengths[w.ids[s, ns - 1]])
        len_y = w.lengths[w.ids[rows[:, None], pos]].astype(np.float64)
        valid &= (w.tokens[s] - len_x + len_y <= step_token_cap) & (
            w.tokens[:, None] + len_x - len_y <= step_token_cap
        )
    delta = np.where(valid, delta, np.inf)
    j = int(np.argmin(delta))
    if not np.isfinite(delta.flat[j]):
        return None
    t, c = divmod(j, pos.shape[1])
    return float(delta.flat[j]), int(t), int(pos[t, c])
