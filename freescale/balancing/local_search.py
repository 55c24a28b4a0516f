"""Local search on a rank assignment: token-cap repair, then makespan descent.

Both consider single-item moves and pairwise swaps, evaluated as numpy arrays over candidate
items; descent also runs whole rounds of disjoint rank pairs in one vectorised pass.
"""
from __future__ import annotations

import numpy as np

from freescale.balancing.inputs import Problem
from freescale.balancing.types import InfeasibleError

# Partner ranks tried in each busiest-rank step: the 8 least loaded, then 64, then all ranks.
PARTNER_TIERS = (8, 64, 1 << 62)
# Items scanned, over a whole descent, by steps that try every rank as a partner.
WIDE_SEARCH_ITEMS = 1 << 20
# Under a token cap, candidate items this far either side of the ideal cost are checked.
TOKEN_NEIGHBOURS = 4
# Rounds of pairwise balancing before the busiest-rank polish (stops early when nothing changes).
PAIR_ROUNDS = 24
# Token-cap repair swaps items of the worst rank with items of this many roomiest ranks.
REPAIR_PARTNERS = 32
# Vectorised repair rounds before the one-rank-at-a-time finish.
REPAIR_ROUNDS = 64


class _State:
    """Per-rank sums and member lists kept in step with ``rank``.

    ``members[r, :counts[r]]`` are the items on rank r (unordered) and ``slot[i]`` is item i's
    position in its row, so a move is O(1) and a rank's items are read without scanning all N.
    """

    def __init__(self, p: Problem, rank: np.ndarray) -> None:
        k = p.world_size
        self.p = p
        self.rank = rank.astype(np.int32, copy=True)
        self.loads = np.bincount(rank, weights=p.costs, minlength=k).astype(np.float64)
        self.counts = np.bincount(rank, minlength=k).astype(np.int64)
        self.tokens = None
        if p.lengths is not None:
            self.tokens = np.rint(np.bincount(rank, weights=p.lengths, minlength=k)).astype(np.int64)
        self.inv_cap = 1.0 / p.cap
        width = int(self.counts.max(initial=0)) + 8
        order = np.argsort(rank, kind="stable")
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        self.slot = np.empty(p.n, dtype=np.int64)
        self.slot[order] = np.arange(p.n) - np.repeat(starts, self.counts)
        self.members = np.full((k, width), -1, dtype=np.int64)
        self.members[self.rank[order], self.slot[order]] = order

    def items(self, r: int) -> np.ndarray:
        return self.members[r, : self.counts[r]]

    def items_of(self, ranks: np.ndarray) -> np.ndarray:
        rows = self.members[ranks]
        return rows[np.arange(rows.shape[1])[None, :] < self.counts[ranks][:, None]]

    def move(self, i: int, dst: int) -> None:
        self.move_many(np.array([i]), np.array([dst]))

    def swap(self, i: int, j: int) -> None:
        ri, rj = int(self.rank[i]), int(self.rank[j])
        self.move(i, rj)
        self.move(j, ri)

    def swap_many(self, i: np.ndarray, j: np.ndarray) -> None:
        """Swap items i[t] and j[t] for all t; all ranks involved must be distinct."""
        ri, rj = self.rank[i], self.rank[j]
        d = self.p.costs[i] - self.p.costs[j]
        self.loads[ri] -= d
        self.loads[rj] += d
        if self.tokens is not None:
            dl = self.p.lengths[i] - self.p.lengths[j]  # type: ignore[index]
            self.tokens[ri] -= dl
            self.tokens[rj] += dl
        si, sj = self.slot[i], self.slot[j]
        self.members[ri, si] = j
        self.members[rj, sj] = i
        self.slot[i], self.slot[j] = sj, si
        self.rank[i], self.rank[j] = rj, ri

    def apply_choices(self, chosen: np.ndarray, i: np.ndarray, j: np.ndarray, dst: np.ndarray) -> int:
        """Carry out the chosen row-wise decisions: swap i with j where j >= 0, else move i to dst."""
        swaps = chosen & (j >= 0)
        moves = chosen & (j < 0)
        if swaps.any():
            self.swap_many(i[swaps], j[swaps])
        if moves.any():
            self.move_many(i[moves], dst[moves])
        return int(chosen.sum())

    def move_many(self, i: np.ndarray, dst: np.ndarray) -> None:
        """Move item i[t] to rank dst[t] for all t; all ranks involved must be distinct."""
        src = self.rank[i]
        c = self.p.costs[i]
        self.loads[src] -= c
        self.loads[dst] += c
        if self.tokens is not None:
            ln = self.p.lengths[i]  # type: ignore[index]
            self.tokens[src] -= ln
            self.tokens[dst] += ln
        last = self.members[src, self.counts[src] - 1]
        self.members[src, self.slot[i]] = last
        self.slot[last] = self.slot[i]
        self.counts[src] -= 1
        if (self.counts[dst] >= self.members.shape[1]).any():
            grown = np.full((self.members.shape[0], 2 * self.members.shape[1]), -1, dtype=np.int64)
            grown[:, : self.members.shape[1]] = self.members
            self.members = grown
        self.members[dst, self.counts[dst]] = i
        self.slot[i] = self.counts[dst]
        self.counts[dst] += 1
        self.rank[i] = dst


class _SortedRows:
    """The items of several ranks as rows sorted by a per-item value, with one searchsorted
    answering a binary search in every row (row i is offset by i * stride above row i-1)."""

    def __init__(self, s: _State, ranks: np.ndarray, value: np.ndarray) -> None:
        width = s.members.shape[1]
        self.n = s.counts[ranks]
        mask = np.arange(width)[None, :] < self.n[:, None]
        items = np.where(mask, s.members[ranks], 0)
        vals = np.where(mask, value[items], np.inf)
        order = np.argsort(vals, axis=1, kind="stable")
        self.items = np.take_along_axis(items, order, axis=1)
        self.vals = np.take_along_axis(vals, order, axis=1)
        self.width = width
        self.top = max(float(value.max(initial=0.0)), 1e-300)
        self.stride = 4.0 * self.top
        pad = 2.0 * self.top
        self.flat = (np.where(np.isfinite(self.vals), self.vals, pad) + self._offset(np.arange(ranks.size))[:, None]).ravel()

    def _offset(self, rows: np.ndarray) -> np.ndarray:
        return rows * self.stride

    def nearest(self, rows: np.ndarray, targets: np.ndarray, reach: int) -> list[np.ndarray]:
        """Positions of the ``reach`` entries below and above each target in its row (clipped)."""
        shape = targets.shape
        rows_b = np.broadcast_to(rows.reshape(rows.shape + (1,) * (len(shape) - rows.ndim)), shape)
        t = np.clip(targets, -self.top, 1.5 * self.top) + self._offset(rows_b)
        pos = np.searchsorted(self.flat, t) - rows_b * self.width
        last = self.n[rows_b] - 1
        return [np.clip(pos + d, 0, last) for d in range(-reach, reach)]


def repair_token_cap(p: Problem, rank: np.ndarray, max_iters: int | None = None) -> np.ndarray | None:
    """Move/swap samples off ranks above ``token_cap`` until none is; None if stuck.

    Every step strictly lowers the total excess (an integer) and never pushes another rank over
    the cap, so it terminates. Among steps leaving the same excess, the one giving the smaller
    pair makespan wins, so repair disturbs the balance as little as it can. Whole rounds of
    (over-cap rank, roomiest rank) pairs go first, vectorised; one rank at a time finishes.
    """
    if p.token_cap is None or p.n == 0:
        return rank
    assert p.lengths is not None
    s = _State(p, rank)
    for _ in range(REPAIR_ROUNDS):
        if _repair_round(s) == 0:
            break
    limit = max_iters if max_iters is not None else 4 * p.n + 16
    for _ in range(limit):
        excess = s.tokens - p.token_cap  # type: ignore[operator]
        v = int(np.argmax(excess))
        if excess[v] <= 0:
            return s.rank
        best = _best_repair(s, v, excess[v])
        if best is None:
            return None
        _, _, kind, a, b = best
        if kind == 0:
            s.move(a, b)
        else:
            s.swap(a, b)
    return None


def _best_repair(s: _State, v: int, excess_v: np.integer) -> tuple[float, float, int, int, int] | None:
    """(new excess, pair span, kind 0=move/1=swap, a, b) of the best step taking tokens off the
    over-cap rank v (``excess_v`` tokens over), or None when no step lowers its excess."""
    p = s.p
    iv = s.items(v)
    roomy = _repair_partners(s, v)
    best: tuple[float, float, int, int, int] | None = None
    # Moves of an item of v to one of those ranks with count room.
    if s.counts[v] > p.count_lo:
        dst = roomy[s.counts[roomy] < p.count_hi]
        if dst.size and iv.size:
            best = _better(best, *_repair_moves(s, v, iv, dst, excess_v), 0, iv, dst)
    # Swaps of an item of v with a shorter item elsewhere.
    others = s.items_of(roomy)
    if others.size and iv.size:
        best = _better(best, *_repair_swaps(s, v, iv, others, excess_v), 1, iv, others)
    return best


def _repair_partners(s: _State, v: int) -> np.ndarray:
    """The ranks with the most token room (all ranks with room would make the candidate matrix
    |items of v| x N): at most REPAIR_PARTNERS, v excluded."""
    slack = np.where(np.arange(s.p.world_size) == v, 0, s.p.token_cap - s.tokens)  # type: ignore[operator]
    roomy = np.flatnonzero(slack > 0)
    if roomy.size > REPAIR_PARTNERS:
        roomy = roomy[np.argsort(-slack[roomy], kind="stable")[:REPAIR_PARTNERS]]
    return roomy


def _repair_moves(
    s: _State, v: int, iv: np.ndarray, dst: np.ndarray, excess_v: np.integer
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fits, excess left, pair span), each [items of v, dst], of moving an item of v to a rank of dst."""
    p = s.p
    li = p.lengths[iv][:, None]  # type: ignore[index]
    ok = s.tokens[dst][None, :] + li <= p.token_cap  # type: ignore[index,operator]
    new_ex = np.maximum(excess_v - li, 0) + np.zeros(dst.size)
    span = np.maximum(
        (s.loads[v] - p.costs[iv][:, None]) * s.inv_cap[v],
        (s.loads[dst][None, :] + p.costs[iv][:, None]) * s.inv_cap[dst][None, :],
    )
    return ok, new_ex, span


def _repair_swaps(
    s: _State, v: int, iv: np.ndarray, others: np.ndarray, excess_v: np.integer
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fits, excess left, pair span), each [items of v, others], of swapping an item of v with a
    shorter item of ``others``."""
    p = s.p
    li = p.lengths[iv][:, None]  # type: ignore[index]
    lj = p.lengths[others][None, :]  # type: ignore[index]
    rj = s.rank[others]
    delta = li - lj
    ok = (delta > 0) & (s.tokens[rj][None, :] + delta <= p.token_cap)  # type: ignore[index,operator]
    new_ex = np.maximum(excess_v - delta, 0)
    dc = p.costs[iv][:, None] - p.costs[others][None, :]
    span = np.maximum((s.loads[v] - dc) * s.inv_cap[v], (s.loads[rj][None, :] + dc) * s.inv_cap[rj][None, :])
    return ok, new_ex, span


def _repair_round(s: _State) -> int:
    """Pair the i-th most over-cap rank with the i-th roomiest; each pair applies its best move or
    swap by (remaining excess, pair makespan). Returns how many pairs changed."""
    p = s.p
    tcap = p.token_cap
    assert tcap is not None and s.tokens is not None and p.lengths is not None
    excess = s.tokens - tcap
    over = np.argsort(-excess, kind="stable")
    over = over[excess[over] > 0]
    roomy = np.argsort(excess, kind="stable")
    roomy = roomy[excess[roomy] < 0]
    h = min(over.size, roomy.size)
    if h == 0:
        return 0
    v, r = over[:h], roomy[:h]
    lengths = p.lengths.astype(np.float64)
    rows_v = _SortedRows(s, v, lengths)
    need, room = excess[v].astype(np.float64), (-excess[r]).astype(np.float64)
    best = _PairChoices(h)
    _offer_repair_moves(s, v, r, rows_v, need, room, best)
    _offer_repair_swaps(s, v, r, rows_v, lengths, need, room, best)
    progress = np.floor(best.score) < need  # the excess left is the integer part of the score
    return s.apply_choices(progress, best.i, best.j, r)


def _repair_norm(s: _State) -> float:
    """Lexicographic (excess left, pair makespan) as one number, excess + makespan / norm: excess
    is an integer and the makespan term is scaled into [0, 0.5)."""
    return 2.0 * float(s.p.costs.sum()) * float(s.inv_cap.max()) + 1e-300


def _offer_repair_moves(
    s: _State, v: np.ndarray, r: np.ndarray, rows_v: _SortedRows, need: np.ndarray, room: np.ndarray,
    best: _PairChoices,
) -> None:
    """Offer each pair (v, r) the moves of the items of v whose length is nearest the tokens to shed."""
    p = s.p
    rows = np.arange(v.size)
    lv, lr, iv, ir = s.loads[v], s.loads[r], s.inv_cap[v], s.inv_cap[r]
    norm = _repair_norm(s)
    can_move = (s.counts[v] > p.count_lo) & (s.counts[r] < p.count_hi)
    for pos in rows_v.nearest(rows, np.minimum(need, room), 2):
        li = rows_v.vals[rows, pos]
        item = rows_v.items[rows, pos]
        ci = p.costs[item]
        ok = can_move & np.isfinite(li) & (li <= room)
        span = np.maximum((lv - ci) * iv, (lr + ci) * ir)
        best.offer_moves(np.where(ok, np.maximum(need - li, 0.0) + span / norm, np.inf), item)


def _offer_repair_swaps(
    s: _State, v: np.ndarray, r: np.ndarray, rows_v: _SortedRows, lengths: np.ndarray, need: np.ndarray,
    room: np.ndarray, best: _PairChoices,
) -> None:
    """Offer each pair (v, r) the swaps of an item of r with the items of v whose length exceeds it
    by about the tokens to shed."""
    p = s.p
    rows = np.arange(v.size)
    lv, lr, iv, ir = s.loads[v], s.loads[r], s.inv_cap[v], s.inv_cap[r]
    norm = _repair_norm(s)
    width = s.members.shape[1]
    mask_r = np.arange(width)[None, :] < s.counts[r][:, None]
    mem_r = np.where(mask_r, s.members[r], 0)
    len_r = lengths[mem_r]
    cost_r = p.costs[mem_r]
    for pos in rows_v.nearest(rows, len_r + np.minimum(need, room)[:, None], 2):
        li = rows_v.vals[rows[:, None], pos]
        item = rows_v.items[rows[:, None], pos]
        dl = li - len_r
        ok = mask_r & np.isfinite(li) & (dl > 0) & (dl <= room[:, None])
        dc = p.costs[item] - cost_r
        span = np.maximum((lv[:, None] - dc) * iv[:, None], (lr[:, None] + dc) * ir[:, None])
        best.offer_swaps(np.where(ok, np.maximum(need[:, None] - dl, 0.0) + span / norm, np.inf), item, mem_r)


class _PairChoices:
    """The best move or swap found so far for each of ``h`` rank pairs: its score (lower is
    better), the item ``i`` leaving the pair's first rank and the item ``j`` it is swapped with
    (-1 marks a move)."""

    def __init__(self, h: int) -> None:
        self.score = np.full(h, np.inf)
        self.i = np.zeros(h, dtype=np.int64)
        self.j = np.full(h, -1, dtype=np.int64)

    def offer_moves(self, score: np.ndarray, items: np.ndarray) -> None:
        """Keep, per pair, the move of ``items[p]`` where ``score[p]`` beats the best so far."""
        better = score < self.score
        self.score = np.where(better, score, self.score)
        self.i = np.where(better, items, self.i)

    def offer_swaps(self, score: np.ndarray, items: np.ndarray, partners: np.ndarray) -> None:
        """Keep, per pair, the lowest-scoring swap of row p (``items[p, c]`` with ``partners[p, c]``,
        scored ``score[p, c]``) where it beats the best so far."""
        rows = np.arange(score.shape[0])
        c = np.argmin(score, axis=1)
        sc = score[rows, c]
        better = sc < self.score
        self.score = np.where(better, sc, self.score)
        self.i = np.where(better, items[rows, c], self.i)
        self.j = np.where(better, partners[rows, c], self.j)


def _better(
    best: tuple[float, float, int, int, int] | None,
    ok: np.ndarray,
    new_ex: np.ndarray,
    span: np.ndarray,
    kind: int,
    rows: np.ndarray,
    cols: np.ndarray,
) -> tuple[float, float, int, int, int] | None:
    if not ok.any():
        return best
    ex = np.where(ok, new_ex, np.iinfo(np.int64).max)
    ex_min = ex.min()
    sp = np.where(ex == ex_min, span, np.inf)
    flat = int(np.argmin(sp))
    r, c = divmod(flat, ok.shape[1])
    cand = (float(ex_min), float(sp.flat[flat]), kind, int(rows[r]), int(cols[c]))
    if best is None or cand[:2] < best[:2]:
        return cand
    return best


def descend(p: Problem, rank: np.ndarray, max_iters: int, pair_rounds: int = PAIR_ROUNDS) -> np.ndarray:
    """Lower the makespan by moves and swaps: first whole rounds of disjoint rank pairs, then the
    busiest rank alone.

    Pair rounds: ranks are sorted by load/cap and the i-th busiest is paired with the i-th idlest;
    every pair applies, in one vectorised pass, its best single move or swap (the one minimising
    the pair's larger load/cap) if it lowers the pair's maximum. This fixes many ranks at once.

    Polish: each iteration takes the rank m with the largest load/cap and applies the best move or
    swap between m and the least loaded ranks (all ranks if those admit none), if it lowers m's
    load/cap. The sorted vector of load/cap values decreases lexicographically in both phases, so
    nothing cycles. Counts stay within [count_lo, count_hi] and tokens within token_cap.
    Deterministic: ties break by index.
    """
    if p.n == 0 or p.world_size == 1:
        return rank
    s = _State(p, rank)
    k = p.world_size
    lb = p.lower_bound()
    wide_left = WIDE_SEARCH_ITEMS
    for _ in range(pair_rounds if k >= 4 else 0):
        if float((s.loads * s.inv_cap).max()) <= lb * (1.0 + 1e-12) or _pair_round(s) == 0:
            break
    for _ in range(max_iters):
        key = s.loads * s.inv_cap
        m = int(np.argmax(key))
        cur = float(key[m])
        if cur <= lb * (1.0 + 1e-12):
            break
        tol = cur * 1e-12
        step = None
        for n_partners in PARTNER_TIERS:
            if n_partners >= k - 1 and n_partners > PARTNER_TIERS[0]:
                # Trying every rank costs O(N) per step: rationed so a hard instance (e.g. a
                # tight token cap) cannot stall the caller. The ration is a count, not a clock.
                if wide_left < p.n:
                    break
                wide_left -= p.n
            partners = _least_loaded(key, m, min(n_partners, k - 1))
            step = _best_step(s, m, partners)
            if step is not None and step[0] < cur - tol:
                break
            step = None
            if n_partners >= k - 1:
                break
        if step is None:
            break
        _, kind, a, b = step
        if kind == 0:
            s.move(a, b)
        else:
            s.swap(a, b)
    return s.rank


def _pair_round(s: _State) -> int:
    """One round of pairwise balancing (see `descend`); returns how many pairs changed."""
    p = s.p
    key = s.loads * s.inv_cap
    order = np.argsort(key, kind="stable")
    h = p.world_size // 2
    lo, hi = order[:h], order[::-1][:h]
    keep = (key[hi] > key[lo] * (1.0 + 1e-12)) & (s.counts[hi] > 0)
    lo, hi = lo[keep], hi[keep]
    n_pairs = hi.size
    if n_pairs == 0:
        return 0
    rows_h = _SortedRows(s, hi, p.costs)
    # d*: the cost whose transfer from hi to lo would equalise their load/cap.
    lh, ll = s.loads[hi], s.loads[lo]
    ih, il = s.inv_cap[hi], s.inv_cap[lo]
    dstar = (lh * ih - ll * il) / (ih + il)
    best = _PairChoices(n_pairs)
    _offer_balance_moves(s, hi, lo, rows_h, dstar, best)
    _offer_balance_swaps(s, hi, lo, rows_h, dstar, best)
    improve = best.score < key[hi] * (1.0 - 1e-12)
    return s.apply_choices(improve, best.i, best.j, lo)


def _offer_balance_moves(
    s: _State, hi: np.ndarray, lo: np.ndarray, rows_h: _SortedRows, dstar: np.ndarray, best: _PairChoices
) -> None:
    """Offer each pair (hi, lo) the moves of the items of hi nearest to d*, scored by pair span."""
    p = s.p
    rows_all = np.arange(hi.size)
    reach = TOKEN_NEIGHBOURS if p.token_cap is not None else 1
    lh, ll = s.loads[hi], s.loads[lo]
    ih, il = s.inv_cap[hi], s.inv_cap[lo]
    can_move = (s.counts[hi] > p.count_lo) & (s.counts[lo] < p.count_hi)
    for cand in rows_h.nearest(rows_all, dstar, reach):
        ci = rows_h.vals[rows_all, cand]
        span = np.maximum((lh - ci) * ih, (ll + ci) * il)
        ok = can_move & np.isfinite(ci)
        items = rows_h.items[rows_all, cand]
        if p.token_cap is not None:
            ok &= s.tokens[lo] + p.lengths[items] <= p.token_cap  # type: ignore[index]
        best.offer_moves(np.where(ok, span, np.inf), items)


def _offer_balance_swaps(
    s: _State, hi: np.ndarray, lo: np.ndarray, rows_h: _SortedRows, dstar: np.ndarray, best: _PairChoices
) -> None:
    """Offer each pair (hi, lo) the swaps of each item j of lo with the items of hi nearest to
    c_j + d*, scored by pair span."""
    p = s.p
    rows_all = np.arange(hi.size)
    reach = TOKEN_NEIGHBOURS if p.token_cap is not None else 1
    lh, ll = s.loads[hi], s.loads[lo]
    ih, il = s.inv_cap[hi], s.inv_cap[lo]
    tcap, lens = p.token_cap, p.lengths
    width = s.members.shape[1]
    ml = np.arange(width)[None, :] < s.counts[lo][:, None]
    mem_l = np.where(ml, s.members[lo], 0)
    cl = p.costs[mem_l]
    for cand in rows_h.nearest(rows_all, cl + dstar[:, None], reach):
        ci = rows_h.vals[rows_all[:, None], cand]
        d = ci - cl
        span = np.maximum((lh[:, None] - d) * ih[:, None], (ll[:, None] + d) * il[:, None])
        ok = ml & (d > 0) & np.isfinite(ci)
        items = rows_h.items[rows_all[:, None], cand]
        if tcap is not None:
            dl = lens[items] - lens[mem_l]  # type: ignore[index]
            ok &= (s.tokens[hi][:, None] - dl <= tcap) & (s.tokens[lo][:, None] + dl <= tcap)  # type: ignore[index]
        best.offer_swaps(np.where(ok, span, np.inf), items, mem_l)


def _least_loaded(key: np.ndarray, m: int, n: int) -> np.ndarray:
    k = key.size
    if n >= k - 1:
        out = np.arange(k)
        return out[out != m]
    cand = np.argpartition(key, n)[: n + 1]
    cand = np.sort(cand[cand != m])[:n]
    return cand


def _best_step(
    s: _State, m: int, partners: np.ndarray
) -> tuple[float, int, int, int] | None:
    """(pair span, kind 0=move/1=swap, a, b) of the best step between m and ``partners``.

    The pair span max((L_m - d)/cap_m, (L_r + d)/cap_r) is V-shaped in the transferred cost d, so
    the best item of m for a given partner lies next to the ideal d*: a binary search finds it.
    Under a token cap the nearest item may not fit, so a few neighbours on each side are checked.
    """
    p = s.p
    costs = p.costs
    im = s.items(m)
    if im.size == 0:
        return None
    cm = costs[im]
    srt = np.argsort(cm, kind="stable")
    im, cm = im[srt], cm[srt]
    lm, inv_m = s.loads[m], s.inv_cap[m]
    best: tuple[float, int, int, int] | None = None
    capped = p.token_cap is not None
    reach = TOKEN_NEIGHBOURS if capped else 1

    # Moves: for partner r the ideal cost d* equalises (lm - d)/cap_m and (lr + d)/cap_r.
    if s.counts[m] > p.count_lo:
        dst = partners[s.counts[partners] < p.count_hi]
        if dst.size:
            lr, inv_r = s.loads[dst], s.inv_cap[dst]
            rows = _nearest(cm, (lm * inv_m - lr * inv_r) / (inv_m + inv_r), reach)
            cols = np.broadcast_to(np.arange(dst.size)[None, :], rows.shape)
            ci = cm[rows]
            span = np.maximum((lm - ci) * inv_m, (lr[cols] + ci) * inv_r[cols])
            if capped:
                span = np.where(s.tokens[dst][cols] + p.lengths[im][rows] <= p.token_cap, span, np.inf)  # type: ignore[index]
            f = int(np.argmin(span))
            if np.isfinite(span.flat[f]):
                best = (float(span.flat[f]), 0, int(im[rows.flat[f]]), int(dst[cols.flat[f]]))

    # Swaps: for item j on rank r the ideal partner cost is c_j + d*(r).
    ij = s.items_of(partners)
    if ij.size:
        cj = costs[ij]
        rj = s.rank[ij]
        lr, inv_r = s.loads[rj], s.inv_cap[rj]
        rows = _nearest(cm, cj + (lm * inv_m - lr * inv_r) / (inv_m + inv_r), reach)
        cols = np.broadcast_to(np.arange(ij.size)[None, :], rows.shape)
        d = cm[rows] - cj[cols]
        span = np.maximum((lm - d) * inv_m, (lr[cols] + d) * inv_r[cols])
        span = np.where(d > 0, span, np.inf)
        if capped:
            dl = p.lengths[im][rows] - p.lengths[ij][cols]  # type: ignore[index]
            ok = (s.tokens[m] - dl <= p.token_cap) & (s.tokens[rj][cols] + dl <= p.token_cap)  # type: ignore[index]
            span = np.where(ok, span, np.inf)
        f = int(np.argmin(span))
        if np.isfinite(span.flat[f]) and (best is None or span.flat[f] < best[0]):
            best = (float(span.flat[f]), 1, int(im[rows.flat[f]]), int(ij[cols.flat[f]]))
    return best


def _nearest(sorted_vals: np.ndarray, targets: np.ndarray, reach: int) -> np.ndarray:
    """[2*reach, len(targets)] indices of the ``reach`` values below and above each target."""
    pos = np.searchsorted(sorted_vals, targets)
    offsets = np.arange(-reach, reach)[:, None]
    return np.clip(pos[None, :] + offsets, 0, sorted_vals.size - 1)


def refine(p: Problem, rank: np.ndarray, max_iters: int, strategy: str) -> np.ndarray:
    """Repair token-cap violations, then descend. Raises InfeasibleError if repair gets stuck."""
    repaired = repair_token_cap(p, rank)
    if repaired is None:
        raise InfeasibleError(
            f"{strategy} could not bring every rank under token_cap={p.token_cap} "
            f"(batch total {int(p.lengths.sum())} tokens over {p.world_size} ranks)"  # type: ignore[union-attr]
        )
    return descend(p, repaired, max_iters)
