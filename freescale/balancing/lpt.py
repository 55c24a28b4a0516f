"""Greedy longest-processing-time-first assignment under count and token constraints."""
from __future__ import annotations

import heapq

import numpy as np

from freescale.balancing.inputs import Problem
from freescale.balancing.types import InfeasibleError


def lpt_ranks(p: Problem) -> np.ndarray:
    """Each sample, in order of decreasing cost (ties by index), goes to the rank whose load/cap
    after taking it is smallest among ranks that still have count and token room (ties: lowest rank).

    Raises InfeasibleError when a sample finds no rank with room (only possible with a token cap).
    """
    order = np.argsort(-p.costs, kind="stable")
    if p.uniform_cap and p.token_cap is None:
        return _lpt_heap(p, order)
    return _lpt_scan(p, order)


def _count_limits(p: Problem) -> tuple[int, int, int]:
    """(lo, hi, how many ranks may reach hi). With equal counts exactly N mod K ranks take ceil."""
    if p.equal_counts:
        extra = p.n - p.count_lo * p.world_size
        return p.count_lo, p.count_hi, extra if p.count_hi > p.count_lo else p.world_size
    return 0, p.n, p.world_size


def _lpt_heap(p: Problem, order: np.ndarray) -> np.ndarray:
    # Equal capacities: the best rank is simply the least loaded eligible one, so a heap keyed by
    # (load, rank) gives the same choice as a scan. Ranks without token room for this sample are
    # set aside and pushed back (a later, shorter sample may fit); count-full ranks are dropped.
    # Under a tight token cap most ranks end up set aside for every sample, which is slower than
    # the numpy scan, so lpt_ranks only uses the heap without a cap.
    k = p.world_size
    lo, hi, n_hi = _count_limits(p)
    heap = [(0.0, r) for r in range(k)]
    counts = [0] * k
    tokens = [0] * k
    tcap = p.token_cap
    lengths = p.lengths.tolist() if p.lengths is not None else None
    at_hi = 0
    rank = np.empty(p.n, dtype=np.int32)
    costs = p.costs.tolist()
    for i in order.tolist():
        aside = []
        while True:
            if not heap:
                raise InfeasibleError(
                    f"lpt found no rank with room for sample {i} (length {lengths[i]}) under "  # type: ignore[index]
                    f"token_cap={tcap}; fullest rank holds {max(tokens)} tokens"
                )
            load, r = heapq.heappop(heap)
            limit = hi if at_hi < n_hi else lo
            if counts[r] >= limit:
                continue  # a full rank never becomes eligible again
            if tcap is not None and tokens[r] + lengths[i] > tcap:  # type: ignore[index]
                aside.append((load, r))
                continue
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        rank[i] = r
        counts[r] += 1
        if lengths is not None:
            tokens[r] += lengths[i]
        if counts[r] == hi and hi > lo:
            at_hi += 1
        heapq.heappush(heap, (load + costs[i], r))
    return rank


def _lpt_scan(p: Problem, order: np.ndarray) -> np.ndarray:
    k = p.world_size
    lo, hi, n_hi = _count_limits(p)
    loads = np.zeros(k)
    counts = np.zeros(k, dtype=np.int64)
    tokens = np.zeros(k, dtype=np.int64)
    at_hi = 0
    rank = np.empty(p.n, dtype=np.int32)
    inv_cap = 1.0 / p.cap
    lengths = p.lengths
    for i in order.tolist():
        c = p.costs[i]
        limit = hi if at_hi < n_hi else lo
        room = counts < limit
        if p.token_cap is not None:
            room &= tokens + lengths[i] <= p.token_cap
        if not room.any():
            raise InfeasibleError(
                f"lpt found no rank with room for sample {i} (length {int(lengths[i])}) under "
                f"token_cap={p.token_cap}; fullest rank holds {int(tokens.max())} tokens"
            )
        after = np.where(room, (loads + c) * inv_cap, np.inf)
        r = int(np.argmin(after))
        rank[i] = r
        loads[r] += c
        counts[r] += 1
        if lengths is not None:
            tokens[r] += lengths[i]
        if counts[r] == hi and hi > lo:
            at_hi += 1
    return rank
