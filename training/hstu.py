"""HSTU encoder (Zhai et al., "Actions Speak Louder than Words", ICML 2024) over jagged batches.

The encoder takes all positions of a batch concatenated (``values`` ``[T, D]``,
``offsets`` ``[B+1]``) and never pads a batch to its longest member: the
linear parts run on ``[T, D]`` and attention runs per group of equal-length
samples (see ``training.jagged``), in causal row blocks. Step time is therefore
``sum_i (a*L_i^2 + b*L_i + c)`` -- the cost model the offline balancer uses --
and ``tests/test_jagged_cost.py`` measures that it is.

One HSTU layer, for one sample of length ``n``::

    U, V, Q, K = split(SiLU(Linear(LayerNorm(X))))
    A          = SiLU(Q K^T + rab_pos + rab_time) * causal_mask / n
    Y          = X + Linear(Dropout(LayerNorm(A V) * U))

``rab_pos`` and ``rab_time`` are learned per-head biases indexed by the
log-bucketed relative position ``i - j`` and time gap ``|t_i - t_j|``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training.config import HSTUConfig
from training.jagged import LengthGroup, group_by_length

def log_bucket(distance: torch.Tensor, num_buckets: int, max_distance: float) -> torch.Tensor:
    """Map non-negative distances to ``0..num_buckets-1`` on a log scale.

    Distance 0 is bucket 0 and ``max_distance`` (or more) the last bucket; in
    between ``log1p`` spacing keeps small distances -- the ones that carry the
    most signal -- in separate buckets.
    """
    scale = (num_buckets - 1) / math.log1p(max_distance)
    buckets = torch.log1p(distance.clamp(min=0).to(torch.float32)) * scale
    return buckets.to(torch.int64).clamp(max=num_buckets - 1)


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
class AttentionPlan:
    """How a jagged batch splits into attention groups, built once per forward.

    The encoder permutes the batch's rows into *group order* once
    (``values[order]``), runs every layer in that order -- so each group is a
    contiguous slice and per-group views need no gathers -- and restores
    jagged order once at the end (``x[inverse]``). Per-group gathers inside
    each layer would cost ``O(T)`` each in backward (the gradient of an index
    is a scatter into a zero tensor of all ``T`` rows), i.e. ``O(T * groups)``
    per step, which broke the per-sample additivity of the cost.
    """

    groups: list[AttentionGroup]
    order: torch.Tensor
    """``[T]`` jagged row at each group-order position."""
    inverse: torch.Tensor
    """``[T]`` group-order position of each jagged row."""
    group_rows: list[int]
    """Rows each group occupies in group order (``G * L``)."""

    @classmethod
    def build(cls, offsets: torch.Tensor, timestamps: torch.Tensor, config: HSTUConfig) -> "AttentionPlan":
        groups = [_attention_group(g, timestamps, config) for g in group_by_length(offsets)]
        if groups:
            order = torch.cat([g.rows.reshape(-1) for g in groups])
        else:
            order = torch.zeros(0, dtype=torch.int64, device=offsets.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return cls(groups=groups, order=order, inverse=inverse, group_rows=[g.rows.numel() for g in groups])


def _attention_group(group: LengthGroup, timestamps: torch.Tensor, config: HSTUConfig) -> AttentionGroup:
    length = group.length
    device = group.rows.device
    positions = torch.arange(length, device=device)
    times = timestamps[group.rows].to(torch.int64)
    n = length if config.attention_normalization == "sample_length" else config.max_seq_len
    blocks = []
    for start in range(0, length, config.attention_block_size):
        stop = min(start + config.attention_block_size, length)
        relative = positions[start:stop].unsqueeze(1) - positions[:stop].unsqueeze(0)  # i - j
        gaps = (times[:, start:stop].unsqueeze(2) - times[:, :stop].unsqueeze(1)).abs()
        causal_weight = (relative >= 0).to(torch.float32) / n
        blocks.append(
            AttentionBlock(
                start=start,
                stop=stop,
                position_buckets=log_bucket(relative, config.num_position_buckets, config.max_seq_len),
                time_buckets=log_bucket(gaps, config.num_time_buckets, config.max_time_gap_seconds),
                causal_weight=causal_weight,
            )
        )
    return AttentionGroup(rows=group.rows, blocks=blocks)


class RelativeAttentionBias(nn.Module):
    """Learned per-head bias from bucketed relative position and time gap."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.position_bias = nn.Embedding(config.num_position_buckets, config.num_heads)
        self.time_bias = nn.Embedding(config.num_time_buckets, config.num_heads)
        nn.init.normal_(self.position_bias.weight, std=0.02)
        nn.init.normal_(self.time_bias.weight, std=0.02)

    def forward(self, block: AttentionBlock) -> torch.Tensor:
        """``[G, H, rows, stop]`` bias for one attention block."""
        position = _lookup(self.position_bias.weight, block.position_buckets).permute(2, 0, 1)  # [H, rows, stop]
        time = _lookup(self.time_bias.weight, block.time_buckets).permute(0, 3, 1, 2)  # [G, H, rows, stop]
        return time + position.unsqueeze(0)


def _lookup(table: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
    """``table[buckets]`` via ``index_select``.

    Same values as ``nn.Embedding``, but the backward is an ``index_add``
    instead of ``embedding_dense_backward``, which sorts its ``L^2`` indices and
    was 60% of the step time at ``L = 512`` on CPU (6x slower).
    """
    return table.index_select(0, buckets.reshape(-1)).view(*buckets.shape, table.shape[1])


class HSTULayer(nn.Module):
    """One HSTU layer: pointwise SiLU attention gated by U, with a residual."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.attention_dim = config.attention_dim
        self.linear_dim = config.linear_dim
        value_width = config.num_heads * config.linear_dim
        qk_width = config.num_heads * config.attention_dim
        self.input_norm = nn.LayerNorm(config.embedding_dim)
        # One projection for U, V, Q, K: a single GEMM over [T, D] instead of four.
        self.uvqk = nn.Linear(config.embedding_dim, 2 * value_width + 2 * qk_width)
        self.relative_bias = RelativeAttentionBias(config)
        self.attention_norm = nn.LayerNorm(value_width)
        self.dropout = nn.Dropout(config.dropout)
        self.output = nn.Linear(value_width, config.embedding_dim)

    def forward(self, x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """``x`` ``[T, D]`` in the plan's group order -> ``[T, D]``, same order."""
        value_width = self.num_heads * self.linear_dim
        qk_width = self.num_heads * self.attention_dim
        u, v, q, k = torch.split(
            F.silu(self.uvqk(self.input_norm(x))),
            [value_width, value_width, qk_width, qk_width],
            dim=-1,
        )
        attended = self._jagged_attention(q, k, v, plan)
        gated = self.attention_norm(attended) * u
        return x + self.output(self.dropout(gated))

    def _jagged_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """``A V`` for every sample over its own positions only; ``[T, H * linear_dim]``."""
        if not plan.groups:
            return v.new_zeros(0, self.num_heads * self.linear_dim)
        # torch.split's backward is one concatenation, O(T) for all groups together.
        pieces = zip(
            plan.groups,
            torch.split(q, plan.group_rows),
            torch.split(k, plan.group_rows),
            torch.split(v, plan.group_rows),
        )
        return torch.cat([self._group_attention(group, qg, kg, vg) for group, qg, kg, vg in pieces])

    def _group_attention(
        self, group: AttentionGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Attention of one group; ``q``, ``k``, ``v`` are its ``[G * L, ...]`` rows."""
        num_samples, length = group.rows.shape
        heads = self.num_heads

        def per_head(t: torch.Tensor, width: int) -> torch.Tensor:
            return t.view(num_samples, length, heads, width).transpose(1, 2)  # [G, H, L, width]

        qg = per_head(q, self.attention_dim)
        kg = per_head(k, self.attention_dim)
        vg = per_head(v, self.linear_dim)
        blocks = []
        for block in group.blocks:
            keys, values = kg[:, :, : block.stop], vg[:, :, : block.stop]
            scores = qg[:, :, block.start : block.stop] @ keys.transpose(-1, -2) + self.relative_bias(block)
            # Multiplying by the mask (not adding -inf) because SiLU is not a softmax:
            # masked entries must contribute exactly 0, and SiLU(-inf) is NaN.
            weights = F.silu(scores) * block.causal_weight
            blocks.append(weights @ values)  # [G, H, rows, linear_dim]
        out = torch.cat(blocks, dim=2).transpose(1, 2)  # [G, L, H, linear_dim]
        return out.reshape(num_samples * length, heads * self.linear_dim)


class HSTUEncoder(nn.Module):
    """Stack of HSTU layers over a jagged batch; outputs are L2-normalised per position.

    Call as ``encoder(values, offsets, timestamps)`` with ``values`` ``[T, D]``
    (input embeddings of all positions, samples concatenated), ``offsets``
    ``[B+1]`` int64 and ``timestamps`` ``[T]`` (seconds). Position ``t`` of a
    sample only sees positions ``<= t`` of the same sample.
    """

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        self.input_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.num_layers))

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        if values.shape[0] != int(offsets[-1]) or timestamps.shape[0] != values.shape[0]:
            raise ValueError(
                f"jagged shapes disagree: values {tuple(values.shape)}, timestamps "
                f"{tuple(timestamps.shape)}, offsets end at {int(offsets[-1])}"
            )
        plan = AttentionPlan.build(offsets, timestamps, self.config)
        x = self.input_dropout(values)[plan.order]
        for layer in self.layers:
            x = layer(x, plan)
        # Retrieval scores are cosine similarities against L2-normalised items.
        return F.normalize(x[plan.inverse], dim=-1)
