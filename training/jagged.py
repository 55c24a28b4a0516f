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


def last_positions(offsets: torch.Tensor) -> torch.Tensor:
    """Row index of each sample's last position (samples must be non-empty)."""
    return offsets[1:] - 1


def next_item_positions(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that predict and rows that are predicted in next-item training.

    For a sample of length ``L``, positions ``0..L-2`` are queries and positions
    ``1..L-1`` their targets; samples with ``L < 2`` contribute nothing.
    Returns ``(query_rows, target_rows)``, both int64 ``[T - B']`` where ``B'``
    counts non-empty samples.
    """
    lengths = lengths_from_offsets(offsets)
    total = int(offsets[-1])
    # A row is a query unless it is the last row of its sample.
    is_query = torch.ones(total, dtype=torch.bool, device=offsets.device)
    nonempty_last = last_positions(offsets)[lengths > 0]
    is_query[nonempty_last] = False
    query_rows = torch.nonzero(is_query, as_tuple=False).squeeze(1)
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


def group_order(groups: list[LengthGroup], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)``: the jagged row at each group-order position (groups back to back),
    and the group-order position of each jagged row."""
    if groups:
        order = torch.cat([g.rows.reshape(-1) for g in groups])
    else:
        order = torch.zeros(0, dtype=torch.int64, device=device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order, inverse


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
