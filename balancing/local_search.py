"""Local search on a rank assignment: token-cap repair, then makespan descent.

Both work on whole-array numpy views of the assignment; one iteration considers every single-item
move and every pairwise swap between one rank and a set of partner ranks, and applies the best.
"""
from __future__ import annotations

import numpy as np

from balancing.inputs import Problem
from balancing.types import InfeasibleError

# Partner ranks tried first in each descent step (the least loaded). If none of them admits an
# improving move, all ranks are tried once before giving up.
NEAR_PARTNERS = 8
# Rounds of pairwise balancing before the busiest-rank polish (stops early when nothing changes).
PAIR_ROUNDS = 24


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
        src = int(self.rank[i])
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
        if self.counts[dst] == self.members.shape[1]:
            grown = np.full((self.members.shape[0], 2 * self.members.shape[1]), -1, dtype=np.int64)
            grown[:, : self.members.shape[1]] = self.members
            self.members = grown
        self.members[dst, self.counts[dst]] = i
        self.slot[i] = self.counts[dst]
        self.counts[dst] += 1
        self.rank[i] = dst

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


def repair_token_cap(p: Problem, rank: np.ndarray, max_iters: int | None = None) -> np.ndarray | None:
    """Move/swap samples off ranks above ``token_cap`` until none is; None if stuck.

    Each step strictly lowers the total excess (an integer) and never pushes another rank over the
    cap, so it terminates. Among steps with the same remaining excess, the one giving the smaller
    pair makespan wins, so repair disturbs the balance as little as it can.
    """
    if p.token_cap is None or p.n == 0:
        return rank
    assert p.lengths is not None
    s = _State(p, rank)
    tcap = p.token_cap
    lengths, costs = p.lengths, p.costs
    limit = max_iters if max_iters is not None else 4 * p.n + 16
    for _ in range(limit):
        excess = s.tokens - tcap  # type: ignore[operator]
        v = int(np.argmax(excess))
        if excess[v] <= 0:
            return s.rank
        iv = s.items(v)
        others = np.flatnonzero((s.rank != v) & (s.tokens[s.rank] < tcap))  # type: ignore[index]
        best: tuple[float, float, int, int, int] | None = None  # (new excess, pair span, kind, a, b)

        # Moves of an item of v to a rank with token and count room.
        if s.counts[v] > p.count_lo:
            dst = np.flatnonzero((s.counts < p.count_hi) & (np.arange(p.world_size) != v))
            if dst.size and iv.size:
                li = lengths[iv][:, None]
                ok = s.tokens[dst][None, :] + li <= tcap  # type: ignore[index]
                new_ex = np.maximum(excess[v] - li, 0) + np.zeros(dst.size)
                span = np.maximum(
                    (s.loads[v] - costs[iv][:, None]) * s.inv_cap[v],
                    (s.loads[dst][None, :] + costs[iv][:, None]) * s.inv_cap[dst][None, :],
                )
                best = _better(best, ok, new_ex, span, 0, iv, dst)
        # Swaps of an item of v with a shorter item elsewhere.
        if others.size and iv.size:
            li = lengths[iv][:, None]
            lj = lengths[others][None, :]
            rj = s.rank[others]
            delta = li - lj
            ok = (delta > 0) & (s.tokens[rj][None, :] + delta <= tcap)  # type: ignore[index]
            new_ex = np.maximum(excess[v] - delta, 0)
            dc = costs[iv][:, None] - costs[others][None, :]
            span = np.maximum(
                (s.loads[v] - dc) * s.inv_cap[v], (s.loads[rj][None, :] + dc) * s.inv_cap[rj][None, :]
            )
            best = _better(best, ok, new_ex, span, 1, iv, others)
        if best is None:
            return None
        _, _, kind, a, b = best
        if kind == 0:
            s.move(a, b)
        else:
            s.swap(a, b)
    return None


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
        for n_partners in (NEAR_PARTNERS, k - 1):
            partners = _least_loaded(key, m, n_partners)
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
    costs = p.costs
    width = s.members.shape[1]
    col = np.arange(width)
    nh, nl = s.counts[hi], s.counts[lo]
    mh = col[None, :] < nh[:, None]
    mem_h = np.where(mh, s.members[hi], 0)
    ch = np.where(mh, costs[mem_h], np.inf)
    srt = np.argsort(ch, axis=1, kind="stable")
    ch = np.take_along_axis(ch, srt, axis=1)
    mem_h = np.take_along_axis(mem_h, srt, axis=1)

    # Row-wise binary search as one searchsorted: row r's values are offset by r * stride.
    top = max(float(costs.max()), 1e-300)
    stride = 4.0 * top
    pad = 2.0 * top
    flat = (np.where(np.isfinite(ch), ch, pad) + (np.arange(n_pairs) * stride)[:, None]).ravel()
    rows_all = np.arange(n_pairs)

    def nearest(rows: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.searchsorted(flat, np.clip(targets, 0.0, 1.5 * top) + rows * stride) - rows * width
        last = nh[rows] - 1
        return np.clip(pos - 1, 0, last), np.clip(pos, 0, last)

    lh, ll = s.loads[hi], s.loads[lo]
    ih, il = s.inv_cap[hi], s.inv_cap[lo]
    dstar = (lh * ih - ll * il) / (ih + il)
    tcap = p.token_cap
    lens = p.lengths

    best_span = np.full(n_pairs, np.inf)
    best_i = np.zeros(n_pairs, dtype=np.int64)
    best_j = np.full(n_pairs, -1, dtype=np.int64)  # -1 marks a move

    # Moves: the item of hi nearest to d*.
    can_move = (nh > p.count_lo) & (nl < p.count_hi)
    for cand in nearest(rows_all, dstar):
        ci = ch[rows_all, cand]
        span = np.maximum((lh - ci) * ih, (ll + ci) * il)
        ok = can_move & np.isfinite(ci)
        items = mem_h[rows_all, cand]
        if tcap is not None:
            ok &= s.tokens[lo] + lens[items] <= tcap  # type: ignore[index]
        span = np.where(ok, span, np.inf)
        better = span < best_span
        best_span = np.where(better, span, best_span)
        best_i = np.where(better, items, best_i)

    # Swaps: for each item j of lo, the item of hi nearest to c_j + d*.
    ml = col[None, :] < nl[:, None]
    mem_l = np.where(ml, s.members[lo], 0)
    cl = costs[mem_l]
    rows = np.broadcast_to(rows_all[:, None], cl.shape).ravel()
    for cand in nearest(rows, (cl + dstar[:, None]).ravel()):
        cand = cand.reshape(cl.shape)
        ci = ch[rows_all[:, None], cand]
        d = ci - cl
        span = np.maximum((lh[:, None] - d) * ih[:, None], (ll[:, None] + d) * il[:, None])
        ok = ml & (d > 0) & np.isfinite(ci)
        items = mem_h[rows_all[:, None], cand]
        if tcap is not None:
            dl = lens[items] - lens[mem_l]  # type: ignore[index]
            ok &= (s.tokens[hi][:, None] - dl <= tcap) & (s.tokens[lo][:, None] + dl <= tcap)  # type: ignore[index]
        span = np.where(ok, span, np.inf)
        j = np.argmin(span, axis=1)
        sp = span[rows_all, j]
        better = sp < best_span
        best_span = np.where(better, sp, best_span)
        best_i = np.where(better, items[rows_all, j], best_i)
        best_j = np.where(better, mem_l[rows_all, j], best_j)

    improve = best_span < key[hi] * (1.0 - 1e-12)
    swaps = improve & (best_j >= 0)
    moves = improve & (best_j < 0)
    if swaps.any():
        s.swap_many(best_i[swaps], best_j[swaps])
    if moves.any():
        s.move_many(best_i[moves], lo[moves])
    return int(improve.sum())


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
    """(pair span, kind 0=move/1=swap, a, b) of the best step between m and ``partners``."""
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
    exact = p.token_cap is not None

    # Moves: for partner r the ideal cost d* equalises (lm - d)/cap_m and (lr + d)/cap_r.
    if s.counts[m] > p.count_lo:
        dst = partners[s.counts[partners] < p.count_hi]
        if dst.size:
            lr, inv_r = s.loads[dst], s.inv_cap[dst]
            if exact:
                ci = np.broadcast_to(cm[:, None], (cm.size, dst.size))
                rows = np.broadcast_to(np.arange(cm.size)[:, None], ci.shape)
                cols = np.broadcast_to(np.arange(dst.size)[None, :], ci.shape)
            else:
                ideal = (lm * inv_m - lr * inv_r) / (inv_m + inv_r)
                rows = _nearest_two(cm, ideal)
                cols = np.broadcast_to(np.arange(dst.size)[None, :], rows.shape)
                ci = cm[rows]
            span = np.maximum((lm - ci) * inv_m, (lr[cols] + ci) * inv_r[cols])
            if exact:
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
        if exact:
            rows = np.broadcast_to(np.arange(cm.size)[:, None], (cm.size, ij.size))
            cols = np.broadcast_to(np.arange(ij.size)[None, :], rows.shape)
        else:
            ideal = cj + (lm * inv_m - lr * inv_r) / (inv_m + inv_r)
            rows = _nearest_two(cm, ideal)
            cols = np.broadcast_to(np.arange(ij.size)[None, :], rows.shape)
        d = cm[rows] - cj[cols]
        span = np.maximum((lm - d) * inv_m, (lr[cols] + d) * inv_r[cols])
        span = np.where(d > 0, span, np.inf)
        if exact:
            lm_t = s.tokens[m]  # type: ignore[index]
            dl = p.lengths[im][rows] - p.lengths[ij][cols]  # type: ignore[index]
            ok = (lm_t - dl <= p.token_cap) & (s.tokens[rj][cols] + dl <= p.token_cap)  # type: ignore[index]
            span = np.where(ok, span, np.inf)
        f = int(np.argmin(span))
        if np.isfinite(span.flat[f]) and (best is None or span.flat[f] < best[0]):
            best = (float(span.flat[f]), 1, int(im[rows.flat[f]]), int(ij[cols.flat[f]]))
    return best


def _nearest_two(sorted_vals: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """[2, len(targets)] indices of the values just below and just above each target."""
    hi = np.searchsorted(sorted_vals, targets)
    hi = np.minimum(hi, sorted_vals.size - 1)
    lo = np.maximum(hi - 1, 0)
    return np.stack([lo, hi])


def refine(p: Problem, rank: np.ndarray, max_iters: int, strategy: str) -> np.ndarray:
    """Repair token-cap violations, then descend. Raises InfeasibleError if repair gets stuck."""
    repaired = repair_token_cap(p, rank)
    if repaired is None:
        raise InfeasibleError(
            f"{strategy} could not bring every rank under token_cap={p.token_cap} "
            f"(batch total {int(p.lengths.sum())} tokens over {p.world_size} ranks)"  # type: ignore[union-attr]
        )
    return descend(p, repaired, max_iters)
