"""Karmarkar-Karp k-way largest differencing (LDM), organised for speed on sorted costs.

k-way LDM keeps K-tuples of partial rank sums and repeatedly merges the two tuples with the
largest spread (max - min), pairing the largest entry of one with the smallest of the other.
Run on costs in decreasing order, it does two different things:

* Head. While the next cost is no larger than the spread of the main tuple, merging a single
  item into it just adds the item to the smallest entry: greedy LPT. We run that with a heap.
* Tail. Once items are larger than the remaining spread, LDM groups consecutive items into fresh
  K-tuples (one item per slot) and differences those against each other and the main tuple.
  We cut the tail into chunks of K consecutive items (the last one padded with zero-cost dummies)
  and run balanced LDM (BLDM) on those tuples plus the head's rank sums as one pinned tuple.

Running BLDM on everything instead fails on heavy tails: it gives each rank exactly one item per
chunk, so the rank holding the largest item must also take one item from every other chunk
(measured: 20-60% above the lower bound at K=256..1024 on log-normal lengths, against <0.4%).

Two adjustments make the result fit the constraints:

* Free counts: an item that alone exceeds the remaining average load first gets a rank of its
  own (it sets the makespan anyway).
* Equal counts: the head is a count-limited greedy over all but the last TAIL_ROUNDS*K items
  (every rank takes exactly that many), so a rank holding a large item is filled up with the
  head's smallest items; the tail then adds one item per rank per chunk, keeping counts +-1.

Membership is not tracked per slot during merging; each merge records only the slot permutation,
and the merge tree is resolved top-down at the end with one numpy scatter per node.
"""
from __future__ import annotations

import heapq

import numpy as np

from freescale.balancing.inputs import Problem

# With equal counts, the BLDM tail gets this many rounds of K items (the smallest ones).
TAIL_ROUNDS = 1


def kk_ranks(p: Problem) -> np.ndarray:
    """Initial assignment by LDM (before local search)."""
    rank = np.full(p.n, -1, dtype=np.int32)
    if p.n == 0:
        return rank
    order = np.argsort(-p.costs, kind="stable")
    ranks_left = np.argsort(-p.cap, kind="stable").astype(np.int32)  # fastest ranks first
    if not p.equal_counts:
        order, ranks_left = _assign_dominant_items(p, order, ranks_left, rank)
    if order.size == 0:
        return rank
    head_loads = np.zeros(p.world_size)
    n_head = _greedy_head(p, order, ranks_left, rank, head_loads)
    tail = order[n_head:]
    if tail.size:
        rank[tail] = _bldm(p.costs[tail], head_loads[ranks_left], p.cap[ranks_left], ranks_left)
    return rank


def _assign_dominant_items(
    p: Problem, order: np.ndarray, ranks_left: np.ndarray, rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Give each item that alone exceeds the remaining average its own (fastest) rank.

    Such an item sets the makespan anyway, so anything next to it is wasted; LDM would add small
    items to it to even out sums. Only used when counts are free.
    """
    costs = p.costs[order]
    remaining = float(costs.sum())
    cap_left = float(p.cap[ranks_left].sum())
    taken = 0
    while taken < costs.size and ranks_left.size - taken > 1:
        c = float(costs[taken])
        r = ranks_left[taken]
        if c / p.cap[r] < remaining / cap_left:
            break
        rank[order[taken]] = r
        remaining -= c
        cap_left -= float(p.cap[r])
        taken += 1
    return order[taken:], ranks_left[taken:]


def _greedy_head(
    p: Problem, order: np.ndarray, ranks_left: np.ndarray, rank: np.ndarray, loads: np.ndarray
) -> int:
    """LDM's head phase: items (decreasing) go to the least loaded rank while they are no larger
    than the spread of the rank sums. Returns how many items were placed.

    The first K items always go one per rank (that is LDM's first tuple). With equal counts the
    head has a fixed length instead (see the module docstring). With unequal capacities the heap
    is keyed by load/cap.
    """
    k = ranks_left.size
    n = order.size
    costs = p.costs[order].tolist()
    inv = (1.0 / p.cap[ranks_left]).tolist()
    ids = ranks_left.tolist()
    heap = [(0.0, j) for j in range(k)]
    local = [0.0] * k
    top = 0.0  # largest load/cap so far (never decreases in the head)
    done = 0
    out = np.empty(n, dtype=np.int32)
    if p.equal_counts:
        # Count-limited greedy: a rank that is full leaves the heap, so the ranks holding the
        # largest items end up taking the smallest items of the head (what the optimum does).
        per_rank = (n - n % k) // k - TAIL_ROUNDS if n // k > TAIL_ROUNDS else 0
        count = [0] * k
        for i in range(per_rank * k):
            key, j = heapq.heappop(heap)
            local[j] += costs[i]
            out[i] = j
            count[j] += 1
            if count[j] < per_rank:
                heapq.heappush(heap, (local[j] * inv[j], j))
        done = per_rank * k
    else:
        while done < n:
            if done >= k and costs[done] > top - heap[0][0]:
                break
            key, j = heapq.heappop(heap)
            local[j] += costs[done]
            out[done] = j
            key = local[j] * inv[j]
            if key > top:
                top = key
            heapq.heappush(heap, (key, j))
            done += 1
    ranks_arr = np.asarray(ids, dtype=np.int32)
    rank[order[:done]] = ranks_arr[out[:done]]
    loads[ranks_left] = np.asarray(local)
    return done


def _bldm(sorted_costs: np.ndarray, pinned: np.ndarray, cap: np.ndarray, rank_ids: np.ndarray) -> np.ndarray:
    """Ranks (from ``rank_ids``) for items in decreasing cost order, given per-rank preloads.

    ``pinned`` holds the loads already on each rank; it becomes one extra tuple whose slots carry
    rank identities. With unequal capacities it also carries (max_cap - cap_r) * T, T the target
    time, so equal slot sums mean load_r = cap_r * T.
    """
    k = rank_ids.size
    n = sorted_costs.size
    if k == 1:
        return np.full(n, rank_ids[0], dtype=np.int32)
    n_chunks = -(-n // k)
    padded = np.zeros(n_chunks * k)
    padded[:n] = sorted_costs
    chunks = padded.reshape(n_chunks, k)  # rows already in decreasing order

    pre = pinned.astype(np.float64, copy=True)
    if not np.all(cap == cap[0]):
        target = (sorted_costs.sum() + pinned.sum()) / cap.sum()
        pre += (cap.max() - cap) * target
    pin_order = np.argsort(-pre, kind="stable")
    leaf_values = [chunks[i] for i in range(n_chunks)] + [pre[pin_order] - pre.min()]
    n_leaves = len(leaf_values)

    values: list[np.ndarray | None] = list(leaf_values)
    children: list[tuple[int, int, np.ndarray] | None] = [None] * n_leaves
    heap = [(-(v[0] - v[-1]), i) for i, v in enumerate(leaf_values)]
    heapq.heapify(heap)
    nodes = n_leaves
    reverse = np.arange(k - 1, -1, -1)
    while len(heap) > 1:
        _, a = heapq.heappop(heap)
        _, b = heapq.heappop(heap)
        combined = values[a] + values[b][::-1]  # type: ignore[operator,index]  # largest with smallest
        perm = np.argsort(-combined, kind="stable")
        merged = combined[perm]
        values[a] = values[b] = None
        values.append(merged)
        children.append((a, b, perm))
        heapq.heappush(heap, (-(merged[0] - merged[-1]), nodes))
        nodes += 1

    # Top-down: slot_of[node][j] = final slot that the node's slot j ends up in.
    root = nodes - 1
    slot_of: list[np.ndarray | None] = [None] * nodes
    slot_of[root] = np.arange(k)
    for node in range(root, n_leaves - 1, -1):
        a, b, perm = children[node]  # type: ignore[misc]
        m = slot_of[node]
        sa = np.empty(k, dtype=np.int64)
        sb = np.empty(k, dtype=np.int64)
        sa[perm] = m
        sb[reverse[perm]] = m
        slot_of[a], slot_of[b] = sa, sb
        slot_of[node] = None

    rank_of_slot = np.empty(k, dtype=np.int32)
    rank_of_slot[slot_of[n_leaves - 1]] = rank_ids[pin_order]  # type: ignore[index]
    final_slot = np.concatenate([slot_of[i] for i in range(n_chunks)])[:n]  # type: ignore[misc]
    return rank_of_slot[final_slot]
