"""Helpers for jagged (concatenated, unpadded) sequence batches.

A jagged batch stores ``B`` variable-length sequences as one ``[T, ...]`` tensor
of all positions back to back plus ``offsets`` ``[B+1]`` (sample ``i`` owns rows
``offsets[i]:offsets[i+1]``). The balancer assigns samples to ranks by
``cost(L) = a*L^2 + b*L + c``; that cost only describes the step time if the
model never pads a batch to its longest member, so everything quadratic in
``L`` (attention) is computed per group of equal-length samples, and everything
linear in ``L`` (projections, norms) runs on the ``[T, ...]`` values directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``[B]`` lengths -> ``[B+1]`` int64 offsets starting at 0."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=offsets[1:])
    return offsets


def check_jagged(values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor) -> None:
    """``ValueError`` when an encoder's inputs disagree in length. ``offsets[-1]`` is only read
    where it lives on the host: on a GPU reading it waits for every queued kernel, once per
    forward, so the host could never run ahead of the GPU (the loader builds offsets and
    values together, so there the check guards nothing the data could break)."""
    end = int(offsets[-1]) if offsets.device.type == "cpu" else None
    if end not in (None, values.shape[0]) or timestamps.shape[0] != values.shape[0]:
        shown = end if end is not None else f"? (not read on {offsets.device.type})"
        raise ValueError(f"jagged shapes disagree: values {tuple(values.shape)}, timestamps "
                         f"{tuple(timestamps.shape)}, offsets end at {shown}")


def lengths_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """``[B+1]`` offsets -> ``[B]`` int64 lengths."""
    return (offsets[1:] - offsets[:-1]).to(torch.int64)


def jagged_positions(offsets: torch.Tensor, max_seq_len: int, total: int | None = None) -> torch.Tensor:
    """``[T]`` position of each row within its sample, counted from the sample's oldest item
    (0), clamped to ``max_seq_len - 1``.

    The paper pads each history on the left into a window of ``n`` and numbers window
    slots, so its most recent item always has the last position and a training position's
    embedding depends on how many items follow it. Here every position of a jagged
    history is a next-item query, so positions count from the start instead: position
    ``t``'s embedding depends on ``t`` alone, the output at ``t`` depends on items
    ``0..t`` alone (a prefix encodes exactly as the whole history does at its positions,
    tested), and the query scored at evaluation is encoded as a training query of the
    same length was. Histories longer than ``max_seq_len`` share the last embedding past it.
    """
    lengths = lengths_from_offsets(offsets)
    # ``total``: the rows, from the caller's values, so a GPU need not be read (and a CUDA graph can capture this)
    total = int(offsets[-1]) if total is None else total
    rows = torch.arange(total, dtype=torch.int64, device=offsets.device)
    starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=total)
    return (rows - starts).clamp(max=max_seq_len - 1)


def last_positions(offsets: torch.Tensor) -> torch.Tensor:
    """Row index of each sample's last position (samples must be non-empty)."""
    return offsets[1:] - 1


def next_item_positions(offsets: torch.Tensor, num_targets: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that predict and rows that are predicted in next-item training.

    For a sample of length ``L``, positions ``0..L-2`` are queries and positions
    ``1..L-1`` their targets; samples with ``L < 2`` contribute nothing.
    Returns ``(query_rows, target_rows)``, both int64 ``[N]``, ``N = sum max(L - 1, 0)``.

    ``num_targets``: ``N`` counted on the host (``SequenceBatch.num_targets``). With it nothing here
    reads the device, so a GPU step does not wait for its queued work here; without it ``N`` is
    read from ``offsets`` (on a GPU, a wait).
    """
    counts = (lengths_from_offsets(offsets) - 1).clamp(min=0)
    if num_targets is None:
        num_targets = int(counts.sum())
    ends = torch.cumsum(counts, 0)
    # Target i belongs to the first sample whose targets end past it; its row is that sample's
    # start plus its place among the sample's targets.
    index = torch.arange(num_targets, dtype=torch.int64, device=offsets.device)
    sample = torch.searchsorted(ends, index, right=True)
    query_rows = offsets[sample] + index - (ends[sample] - counts[sample])
    return query_rows, query_rows + 1


@dataclass(frozen=True)
class LengthGroup:
    """All samples of one length ``L``, gathered so they form a dense block.

    ``rows`` is ``[G, L]`` int64: ``rows[g, j]`` is the jagged row of position
    ``j`` of the ``g``-th sample in the group. Gathering ``values[rows]`` gives a
    ``[G, L, ...]`` tensor with no padding, since every member has length ``L``.
    """

    length: int
    rows: torch.Tensor


def group_by_length(offsets: torch.Tensor) -> list[LengthGroup]:
    """Partition the non-empty samples of a jagged batch into equal-length groups.

    Grouping equal lengths lets one batched matmul serve several samples without
    padding; compute stays ``sum_i cost(L_i)`` rather than ``B * cost(max L)``.
    Real histories rarely share lengths, so most groups hold one sample.
    """
    lengths = lengths_from_offsets(offsets)
    starts = offsets[:-1]
    groups: list[LengthGroup] = []
    # One host sync for the distinct lengths; group sizes are data-dependent
    # anyway, so the per-group work below cannot be captured without it.
    for length in torch.unique(lengths).tolist():
        if length == 0:
            continue
        members = torch.nonzero(lengths == length, as_tuple=False).squeeze(1)
        positions = torch.arange(length, dtype=torch.int64, device=offsets.device)
        rows = starts[members].unsqueeze(1) + positions.unsqueeze(0)
        groups.append(LengthGroup(length=int(length), rows=rows))
    return groups


@dataclass(frozen=True)
class GroupedPlan:
    """A jagged batch in *group order*: its samples of one length next to each other, so each
    group of ``G`` samples of length ``L`` is one contiguous ``[G * L]`` slice of rows.

    An encoder permutes its rows into group order once (``enter``), runs every layer there, where
    a group's rows are a slice (``split``) and need no gather, and restores jagged order once at
    the end (``leave``). Per-group gathers inside each layer would cost ``O(T)`` each in backward
    (the gradient of an index is a scatter into a zero tensor of all ``T`` rows), i.e.
    ``O(T * groups)`` per step, which broke the per-sample additivity of the cost. Built once per
    forward and shared by every layer; HSTU's grouped attention and SASRec's attention both run on it.
    """

    groups: list[LengthGroup]
    """The batch's non-empty samples by length (``group_by_length``), in group order."""
    order: torch.Tensor
    """``[T]`` jagged row at each group-order position."""
    inverse: torch.Tensor
    """``[T]`` group-order position of each jagged row."""

    @classmethod
    def build(cls, offsets: torch.Tensor) -> "GroupedPlan":
        groups = group_by_length(offsets)
        if groups:
            order = torch.cat([g.rows.reshape(-1) for g in groups])
        else:
            order = torch.zeros(0, dtype=torch.int64, device=offsets.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return cls(groups=groups, order=order, inverse=inverse)

    @property
    def sizes(self) -> list[int]:
        """Rows each group occupies in group order (``G * L``)."""
        return [g.rows.numel() for g in self.groups]

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, ...]`` in jagged order -> group order."""
        return x[self.order]

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, ...]`` in group order -> jagged order."""
        return x[self.inverse]

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x`` in group order as one ``[G * L, ...]`` slice per group (``torch.split``, whose
        backward is one concatenation: ``O(T)`` for all groups together)."""
        return torch.split(x, self.sizes)


def jagged_concat_last(
    values: torch.Tensor,
    offsets: torch.Tensor,
    extra: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append one row per sample to a jagged tensor.

    ``values`` ``[T, ...]``, ``extra`` ``[B, ...]`` -> (``[T + B, ...]``, new offsets).
    Used to build the leave-one-out test history (history followed by the
    validation item) without padding.
    """
    lengths = lengths_from_offsets(offsets)
    new_offsets = offsets_from_lengths(lengths + 1)
    out = values.new_empty((values.shape[0] + extra.shape[0], *values.shape[1:]))
    appended_rows = new_offsets[1:] - 1
    keep = torch.ones(out.shape[0], dtype=torch.bool, device=values.device)
    keep[appended_rows] = False
    out[keep] = values
    out[appended_rows] = extra
    return out, new_offsets
