"""Full-catalog ranking with the item table spread over the ranks: each rank holds a contiguous
1/K slice of the normalised table (ids ``first..last-1``) and no rank holds the whole table.

A target's 0-based rank is the number of other non-padding items scoring ``>=`` it (ties against
the target), a sum over the slices: every rank counts the items of its slice at or above each
query's target score, and one ``all_reduce`` adds the counts. The target score comes from the rank
whose slice holds the target, from the same product it counts with, so the target counts itself
exactly once (as in ``ranking_metrics._ranks_by_item_chunks``). The unseen ranking subtracts, per
slice, the query's distinct history ids (never the target or padding) at or above it.

Every function here that takes ``group`` is a collective over the ranks that hold the slices;
queries are exchanged and counts summed on the CPU through ``group`` (``DistEnv.host_group``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from freescale.training.eval.ranking_metrics import ExcludeIds
from freescale.training.model.recommender import SequentialRecommender

QUERY_CHUNK = 64
"""Queries scored at once (``ranking_metrics.retrieval_metrics``' chunk: the same sums)."""
ITEM_CHUNK = 8192
"""Items of a slice scored at once: the ``[queries, items]`` scores stay cache-sized."""
LOOKUP_CHUNK = 65536
"""Ids looked up at once through the (sharded) table (``all_item_embeddings``' chunk)."""


def slice_bounds(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(first, last)``: the ids of rank ``rank``'s slice of ``rows`` rows (ceil(rows / K) each)."""
    per = -(-rows // world_size)
    return min(rank * per, rows), min((rank + 1) * per, rows)


@torch.no_grad()
def item_rows(model: SequentialRecommender, ids: torch.Tensor) -> torch.Tensor:
    """``[len(ids), D]`` raw rows of ``ids`` through the model's table (a collective under DMP, so
    every rank calls it, possibly with no ids: one id is looked up anyway, and dropped)."""
    empty = torch.zeros(0, dtype=torch.int64, device=ids.device)
    wanted = ids if ids.numel() else torch.ones(1, dtype=torch.int64, device=ids.device)
    _, rows = model.lookup(empty, empty, wanted)
    return rows[: ids.numel()]


@dataclass
class CatalogSlice:
    """This rank's rows ``first..last-1`` of the L2-normalised item table (row 0, padding, is zeros)."""

    first: int
    rows: torch.Tensor

    @property
    def last(self) -> int:
        return self.first + self.rows.shape[0]

    @classmethod
    @torch.no_grad()
    def of(cls, model: SequentialRecommender, rank: int, world_size: int, device: torch.device,
           chunk_size: int = LOOKUP_CHUNK) -> "CatalogSlice":
        """Looked up through the (sharded) table, every rank the same number of times (a collective)."""
        rows = model.num_items + 1
        first, last = slice_bounds(rows, rank, world_size)
        per = -(-rows // world_size)
        pieces = []
        for start in range(first, first + per, chunk_size):
            ids = torch.arange(min(start, last), min(start + chunk_size, last), device=device)
            raw = item_rows(model, ids.clamp(min=1))
            pieces.append(torch.where((ids == 0).unsqueeze(1), torch.zeros_like(raw), raw))
        table = torch.cat(pieces) if pieces else torch.zeros(0, model.config.embedding_dim, device=device)
        return cls(first, F.normalize(table, dim=-1))

    def _owned(self, targets: torch.Tensor) -> torch.Tensor:
        return ((targets >= self.first) & (targets < self.last)).nonzero().squeeze(1)

    def target_scores(self, query: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``[M]`` each query's score of its target where this slice holds it, else 0."""
        out = torch.zeros(query.shape[0], dtype=query.dtype, device=query.device)
        for q0 in range(0, query.shape[0], QUERY_CHUNK):
            chunk, wanted = query[q0:q0 + QUERY_CHUNK], targets[q0:q0 + QUERY_CHUNK]
            for i0 in range(self.first, self.last, ITEM_CHUNK):
                i1 = min(i0 + ITEM_CHUNK, self.last)
                mine = ((wanted >= i0) & (wanted < i1)).nonzero().squeeze(1)
                if mine.numel():
                    scores = chunk @ self.rows[i0 - self.first:i1 - self.first].t()
                    out[q0 + mine] = scores[mine, wanted[mine] - i0]
        return out

    def counts(self, query: torch.Tensor, targets: torch.Tensor, target_scores: torch.Tensor,
               history: ExcludeIds | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[M]`` items of this slice scoring at or above each target (the target included where
        held here), and (with ``history``) how many of them are the query's own distinct history ids."""
        at_or_above = torch.zeros(query.shape[0], dtype=torch.int64, device=query.device)
        seen_above = None if history is None else torch.zeros_like(at_or_above)
        pairs = None if history is None else _distinct_pairs(history, targets)
        for q0 in range(0, query.shape[0], QUERY_CHUNK):
            q1 = min(q0 + QUERY_CHUNK, query.shape[0])
            for i0 in range(self.first, self.last, ITEM_CHUNK):
                i1 = min(i0 + ITEM_CHUNK, self.last)
                scores = query[q0:q1] @ self.rows[i0 - self.first:i1 - self.first].t()
                if i0 == 0:
                    scores[:, 0] = float("-inf")  # padding
                wanted = targets[q0:q1]
                mine = ((wanted >= i0) & (wanted < i1)).nonzero().squeeze(1)
                scores[mine, wanted[mine] - i0] = target_scores[q0 + mine]  # counts itself once
                at_or_above[q0:q1] += (scores >= target_scores[q0:q1].unsqueeze(1)).sum(dim=1)
                if pairs is not None:
                    rows, ids = pairs
                    inside = (rows >= q0) & (rows < q1) & (ids >= i0) & (ids < i1)
                    r, i = rows[inside], ids[inside]
                    above = scores[r - q0, i - i0] >= target_scores[r]
                    seen_above += torch.bincount(r[above], minlength=query.shape[0])
        return at_or_above, seen_above


def _distinct_pairs(history: ExcludeIds, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query rows, ids)``: each query's distinct history ids less its target and padding."""
    lengths, ids = history
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths)
    keep = (ids != targets[rows]) & (ids != 0)
    width = int(ids.max()) + 1 if ids.numel() else 1
    pairs = torch.unique(rows[keep] * width + ids[keep])
    return pairs // width, pairs % width


def global_ranks(catalog: CatalogSlice, query: torch.Tensor, targets: torch.Tensor, history: ExcludeIds | None,
                 group: dist.ProcessGroup | None, world_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """0-based full-catalog ranks of every rank's queries (``[M]``, the same on every rank: the
    queries, targets and history are every rank's, concatenated in rank order), and (with
    ``history``) their ranks without the history (a collective)."""
    scores = catalog.target_scores(query, targets).cpu()
    if world_size > 1:  # one slice holds each target: the others add zeros
        dist.all_reduce(scores, group=group)
    at_or_above, seen_above = catalog.counts(query, targets, scores.to(query.device), history)
    counts = at_or_above.cpu() if seen_above is None else torch.stack([at_or_above, seen_above]).cpu()
    if world_size > 1:
        dist.all_reduce(counts, group=group)
    if seen_above is None:
        return counts - 1, None
    return counts[0] - 1, counts[0] - 1 - counts[1]
