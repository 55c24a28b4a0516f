"""Jagged HSTU attention in PyTorch: the definition the Triton kernel (``freescale.training.ops.hstu_attention``)
is tested against, and the model's ``grouped`` attention (CPU).

For every sample ``s`` (rows ``offsets[s]:offsets[s+1]``), head ``h`` and query position ``i``::

    out[i] = sum_{j <= i} SiLU(q_i . k_j + pos_w[pb(i - j), h] + time_w[tb(|t_i - t_j|), h]) / n * v_j

with ``pb``/``tb`` the log buckets of ``freescale.training.ops.relative_buckets`` and ``n`` the sample's
length (or ``BiasSpec.normalizer``). The samples of one length are gathered into one dense block
(``freescale.training.ops.jagged.GroupedPlan``), so a batch costs ``sum_i (a L_i^2 + b L_i + c)`` with no padding;
each group's ``L x L`` attention runs in causal row blocks. Every group costs a few dozen small ops
per layer: noise next to the math on a CPU, milliseconds of launches on a GPU (hence the kernel).

``reference_hstu_attention`` takes and returns jagged order, as the kernel does. The encoder
instead builds a ``GroupedAttention`` once per forward and runs every layer in its group order:
the buckets are built once for all layers, and the batch is permuted once, not per layer.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freescale.training.config import AttentionActivation
from freescale.training.ops.jagged import GroupedPlan, LengthGroup
from freescale.training.ops.relative_buckets import log_bucket


@dataclass(frozen=True)
class BiasSpec:
    """How relative positions and time gaps map to bias-table rows (``HSTUConfig``'s buckets),
    and what the attention weights are divided by."""

    num_position_buckets: int
    max_position: float
    num_time_buckets: int
    max_time_gap: float
    normalizer: int
    """Divisor of the attention weights; 0 = each sample's own length."""
    activation: AttentionActivation = "silu"
    """``"silu"``: weights ``SiLU(s) / n``; ``"softmax"``: ``softmax_j(q.k / sqrt(dq) + biases)``
    over the causal keys, ``normalizer`` unused (``HSTUConfig.attention_activation``; the
    reference only, the Triton kernel refuses it)."""

    def __post_init__(self) -> None:
        if self.activation not in typing.get_args(AttentionActivation):
            raise ValueError(f"activation must be one of {typing.get_args(AttentionActivation)}, "
                             f"not {self.activation!r}")


@dataclass(frozen=True)
class AttentionBlock:
    """Query rows ``start:stop`` of a group against key rows ``0:stop``.

    Splitting a long sample's ``L x L`` attention into row blocks keeps each
    block's ``[G, H, rows, stop]`` intermediates cache-sized and skips the key
    columns above the diagonal, which the causal mask zeroes. Unblocked, the
    ``L = 512`` matrices spilled out of L2 and made the step super-quadratic;
    blocking took a 512-long forward+backward from 26 ms to 15 ms on CPU.
    Bucket tensors are built once per forward and shared by all layers.
    """

    start: int
    stop: int
    position_buckets: torch.Tensor
    """``[rows, stop]`` bucket of ``i - j``."""
    time_buckets: torch.Tensor
    """``[G, rows, stop]`` bucket of ``|t_i - t_j|``."""
    causal_weight: torch.Tensor
    """``[rows, stop]``: ``1 / n`` on and below the diagonal, 0 above -- mask and normaliser in one multiply."""


@dataclass(frozen=True)
class AttentionGroup:
    """Samples of one length, gathered dense, and their attention blocks."""

    rows: torch.Tensor
    """``[G, L]`` jagged row of each position."""
    blocks: list[AttentionBlock]


@dataclass(frozen=True)
class GroupedAttention:
    """A batch in group order (``freescale.training.ops.jagged.GroupedPlan``: each group a contiguous slice) and
    each group's attention blocks; built once per forward and shared by every layer."""

    grouped: GroupedPlan
    groups: list[AttentionGroup]
    """One per ``grouped.groups`` entry, in the same order."""
    activation: AttentionActivation
    """``BiasSpec.activation``."""

    @classmethod
    def build(cls, offsets: torch.Tensor, timestamps: torch.Tensor, spec: BiasSpec,
              block: int | None = None) -> "GroupedAttention":
        """``block``: query rows per attention block (``HSTUConfig.attention_block_size``); None = a
        sample's whole length in one block."""
        grouped = GroupedPlan.build(offsets)
        return cls(grouped=grouped, groups=[_attention_group(g, timestamps, spec, block) for g in grouped.groups],
                   activation=spec.activation)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return self.grouped.enter(x)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return self.grouped.leave(x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_weight: torch.Tensor,
               time_weight: torch.Tensor) -> torch.Tensor:
        """``A V`` for every sample over its own positions only; ``q``, ``k``, ``v`` and the result
        ``[T, H * d]`` in group order; the bias tables ``[buckets, H]``."""
        if not self.groups:
            return v.new_zeros(0, v.shape[1])
        pieces = zip(self.groups, self.grouped.split(q), self.grouped.split(k), self.grouped.split(v))
        return torch.cat([_group_attention(group, qg, kg, vg, position_weight, time_weight, self.activation)
                          for group, qg, kg, vg in pieces])


def reference_hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_weight: torch.Tensor, time_weight: torch.Tensor, spec: BiasSpec, block: int | None = None,
) -> torch.Tensor:
    """``A V`` of every sample over its own positions, ``[T, H * dv]`` in jagged order; the arguments
    are ``jagged_hstu_attention``'s, ``block`` being ``GroupedAttention.build``'s. Computes in the
    dtypes torch's ops pick (autocast included): scores and biases in fp32, the weights meet ``v``
    in ``v``'s dtype, as in the kernel."""
    plan = GroupedAttention.build(offsets, timestamps, spec, block)
    out = plan.attend(plan.enter(q), plan.enter(k), plan.enter(v), position_weight, time_weight)
    return plan.leave(out)


def _group_attention(group: AttentionGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     position_weight: torch.Tensor, time_weight: torch.Tensor, activation: AttentionActivation) -> torch.Tensor:
    """Attention of one group; ``q``, ``k``, ``v`` are its ``[G * L, ...]`` rows."""
    num_samples, length = group.rows.shape
    heads = position_weight.shape[1]

    def per_head(t: torch.Tensor) -> torch.Tensor:
        return t.view(num_samples, length, heads, -1).transpose(1, 2)  # [G, H, L, width]

    qg, kg, vg = per_head(q), per_head(k), per_head(v)
    if activation == "softmax":
        qg = qg * qg.shape[-1] ** -0.5
    blocks = []
    for block in group.blocks:
        keys, values = kg[:, :, : block.stop], vg[:, :, : block.stop]
        scores = qg[:, :, block.start : block.stop] @ keys.transpose(-1, -2) + _block_bias(
            position_weight, time_weight, block)
        if activation == "softmax":  # every row keeps its diagonal, so none is all -inf
            weights = torch.softmax(scores.masked_fill(block.causal_weight == 0, float("-inf")), dim=-1)
        else:
            # Multiplying by the mask (not adding -inf) because SiLU is not a softmax:
            # masked entries must contribute exactly 0, and SiLU(-inf) is NaN.
            weights = F.silu(scores) * block.causal_weight
        # Scores are fp32 (the bias is); the weights meet V in V's dtype, as in the Triton kernel,
        # so bf16 q, k, v work with autocast (a no-op there) and without it.
        blocks.append(weights.to(values.dtype) @ values)  # [G, H, rows, linear_dim]
    out = torch.cat(blocks, dim=2).transpose(1, 2)  # [G, L, H, linear_dim]
    return out.reshape(num_samples * length, -1)


def _block_bias(position_weight: torch.Tensor, time_weight: torch.Tensor, block: AttentionBlock) -> torch.Tensor:
    """``[G, H, rows, stop]`` bias for one attention block."""
    position = _lookup(position_weight, block.position_buckets).permute(2, 0, 1)  # [H, rows, stop]
    time = _lookup(time_weight, block.time_buckets).permute(0, 3, 1, 2)  # [G, H, rows, stop]
    return time + position.unsqueeze(0)


def _lookup(table: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
    """``table[buckets]`` via ``index_select``.

    Same values as ``nn.Embedding``, but the backward is an ``index_add``
    instead of ``embedding_dense_backward``, which sorts its ``L^2`` indices and
    was 60% of the step time at ``L = 512`` on CPU (6x slower).
    """
    return table.index_select(0, buckets.reshape(-1)).view(*buckets.shape, table.shape[1])


def _attention_group(group: LengthGroup, timestamps: torch.Tensor, spec: BiasSpec, block: int | None) -> AttentionGroup:
    length = group.length
    block = block or length
    device = group.rows.device
    positions = torch.arange(length, device=device)
    times = timestamps[group.rows].to(torch.int64)
    n = spec.normalizer or length
    blocks = []
    for start in range(0, length, block):
        stop = min(start + block, length)
        relative = positions[start:stop].unsqueeze(1) - positions[:stop].unsqueeze(0)  # i - j
        gaps = (times[:, start:stop].unsqueeze(2) - times[:, :stop].unsqueeze(1)).abs()
        causal_weight = (relative >= 0).to(torch.float32) / n
        blocks.append(
            AttentionBlock(
                start=start,
                stop=stop,
                position_buckets=log_bucket(relative, spec.num_position_buckets, spec.max_position),
                time_buckets=log_bucket(gaps, spec.num_time_buckets, spec.max_time_gap),
                causal_weight=causal_weight,
            )
        )
    return AttentionGroup(rows=group.rows, blocks=blocks)
