"""HSTU encoder (Zhai et al., "Actions Speak Louder than Words", ICML 2024) over jagged batches.

The encoder takes all positions of a batch concatenated (``values`` ``[T, D]``,
``offsets`` ``[B+1]``) and never pads a batch to its longest member: the
linear parts run on ``[T, D]``, and attention runs on each sample's own
positions only, by one of two kernels (``HSTUConfig.attention_kernel``):

* ``grouped`` (CPU, and the reference): PyTorch ops per group of equal-length
  samples (see ``training.jagged``), in causal row blocks. Every group costs a
  few dozen small ops per layer, which on a CPU is noise next to the math.
* ``triton`` (CUDA): one jagged kernel per layer and direction
  (``training.ops.hstu_attention``), with both biases computed inside it. On a GPU
  the grouped ops' launches would cost milliseconds per distinct length in a batch.

Either way step time is ``sum_i (a*L_i^2 + b*L_i + c)`` -- the cost model the
offline balancer uses -- and ``benchmarks/jagged_cost_bench.py`` measures that it is on CPU
(``benchmarks/hstu_gpu_bench.py`` on a GPU).

One HSTU layer, for one sample of length ``n``::

    U, V, Q, K = split(SiLU(Linear(LayerNorm(X))))
    A          = SiLU(Q K^T + rab_pos + rab_time) * causal_mask / n
    Y          = X + Linear(Dropout(LayerNorm(A V) * U))

``rab_pos`` and ``rab_time`` are learned per-head biases indexed by the
log-bucketed relative position ``i - j`` and time gap ``|t_i - t_j|``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from training.attention_kernel import attention_kernel_for
from training.config import AttentionKernelName, HSTUConfig, keyed_by
from training.encoders import Encoder
from training.jagged import GroupedPlan, LengthGroup, check_jagged
from training.ops.relative_buckets import log_bucket


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


class AttentionPlan(Protocol):
    """What a kernel needs of a batch, built once per forward and shared by every layer.

    ``enter`` puts the encoder's input rows in the order the kernel works in and
    ``leave`` restores jagged order; ``attend`` is one layer's ``A V``.
    """

    def enter(self, x: torch.Tensor) -> torch.Tensor: ...

    def leave(self, x: torch.Tensor) -> torch.Tensor: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: "RelativeAttentionBias") -> torch.Tensor: ...


@dataclass(frozen=True)
class GroupedAttentionPlan:
    """The ``grouped`` kernel's plan: the batch in group order (``training.jagged.GroupedPlan``:
    every layer runs there, each group a contiguous slice) and each group's attention blocks."""

    config: HSTUConfig
    grouped: GroupedPlan
    groups: list[AttentionGroup]
    """One per ``grouped.groups`` entry, in the same order."""

    @classmethod
    def build(cls, offsets: torch.Tensor, timestamps: torch.Tensor, config: HSTUConfig) -> "GroupedAttentionPlan":
        grouped = GroupedPlan.build(offsets)
        return cls(config=config, grouped=grouped,
                   groups=[_attention_group(g, timestamps, config) for g in grouped.groups])

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return self.grouped.enter(x)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return self.grouped.leave(x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: "RelativeAttentionBias") -> torch.Tensor:
        """``A V`` for every sample over its own positions only; ``[T, H * linear_dim]``."""
        if not self.groups:
            return v.new_zeros(0, self.config.num_heads * self.config.linear_dim)
        pieces = zip(self.groups, self.grouped.split(q), self.grouped.split(k), self.grouped.split(v))
        return torch.cat([self._group_attention(group, qg, kg, vg, bias) for group, qg, kg, vg in pieces])

    def _group_attention(self, group: AttentionGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         bias: "RelativeAttentionBias") -> torch.Tensor:
        """Attention of one group; ``q``, ``k``, ``v`` are its ``[G * L, ...]`` rows."""
        num_samples, length = group.rows.shape
        heads = self.config.num_heads

        def per_head(t: torch.Tensor) -> torch.Tensor:
            return t.view(num_samples, length, heads, -1).transpose(1, 2)  # [G, H, L, width]

        qg, kg, vg = per_head(q), per_head(k), per_head(v)
        blocks = []
        for block in group.blocks:
            keys, values = kg[:, :, : block.stop], vg[:, :, : block.stop]
            scores = qg[:, :, block.start : block.stop] @ keys.transpose(-1, -2) + bias(block)
            # Multiplying by the mask (not adding -inf) because SiLU is not a softmax:
            # masked entries must contribute exactly 0, and SiLU(-inf) is NaN.
            weights = F.silu(scores) * block.causal_weight
            # Scores are fp32 (the bias is); the weights meet V in V's dtype, as in the Triton kernel,
            # so bf16 q, k, v work with autocast (a no-op there) and without it.
            blocks.append(weights.to(values.dtype) @ values)  # [G, H, rows, linear_dim]
        out = torch.cat(blocks, dim=2).transpose(1, 2)  # [G, L, H, linear_dim]
        return out.reshape(num_samples * length, -1)


@dataclass(frozen=True)
class JaggedPlan:
    """The batch as the ``triton`` kernel takes it: jagged order throughout, nothing gathered."""

    config: HSTUConfig
    offsets: torch.Tensor
    timestamps: torch.Tensor

    @classmethod
    def build(cls, offsets: torch.Tensor, timestamps: torch.Tensor, config: HSTUConfig) -> "JaggedPlan":
        return cls(config=config, offsets=offsets, timestamps=timestamps)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: "RelativeAttentionBias") -> torch.Tensor:
        ops = _triton_ops()
        config = self.config
        spec = ops.BiasSpec(
            num_position_buckets=config.num_position_buckets, max_position=config.max_seq_len,
            num_time_buckets=config.num_time_buckets, max_time_gap=config.max_time_gap_seconds,
            normalizer=config.max_seq_len if config.attention_normalization == "max_seq_len" else 0,
        )
        return ops.jagged_hstu_attention(q, k, v, self.offsets, self.timestamps, bias.position_bias.weight,
                                         bias.time_bias.weight, spec)


PLANS = keyed_by(AttentionKernelName, {"grouped": GroupedAttentionPlan, "triton": JaggedPlan})


@functools.cache
def _triton_ops():
    """``training.ops.hstu_attention``, imported on first use: importing triton takes seconds."""
    from training.ops import hstu_attention

    return hstu_attention


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

    def __init__(self, config: HSTUConfig, width: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.attention_dim = config.attention_dim
        self.linear_dim = config.linear_dim
        value_width = config.num_heads * config.linear_dim
        qk_width = config.num_heads * config.attention_dim
        self.input_norm = nn.LayerNorm(width)
        # One projection for U, V, Q, K: a single GEMM over [T, D] instead of four.
        self.uvqk = nn.Linear(width, 2 * value_width + 2 * qk_width)
        self.relative_bias = RelativeAttentionBias(config)
        self.attention_norm = nn.LayerNorm(value_width)
        self.dropout = nn.Dropout(config.dropout)
        self.output = nn.Linear(value_width, width)

    def forward(self, x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """``x`` ``[T, D]`` in the plan's order -> ``[T, D]``, same order."""
        value_width = self.num_heads * self.linear_dim
        qk_width = self.num_heads * self.attention_dim
        u, v, q, k = torch.split(
            F.silu(self.uvqk(self.input_norm(x))),
            [value_width, value_width, qk_width, qk_width],
            dim=-1,
        )
        attended = plan.attend(q, k, v, self.relative_bias)
        gated = self.attention_norm(attended) * u
        return x + self.output(self.dropout(gated))


class HSTUEncoder(Encoder):
    """Stack of HSTU layers over a jagged batch; outputs are L2-normalised per position.

    Call as ``encoder(values, offsets, timestamps)`` with ``values`` ``[T, width]``
    (input embeddings of all positions, samples concatenated), ``offsets``
    ``[B+1]`` int64 and ``timestamps`` ``[T]`` (seconds). Position ``t`` of a
    sample only sees positions ``<= t`` of the same sample (``training.encoders``).
    """

    def __init__(self, config: HSTUConfig, width: int) -> None:
        super().__init__()
        self.config = config
        self.input_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(HSTULayer(config, width) for _ in range(config.num_layers))

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def kernel(self, device: torch.device | str) -> AttentionKernelName:
        """The attention kernel this encoder runs on ``device``; one line where triton would run and
        cannot (``training.attention_kernel``)."""
        return attention_kernel_for(self.config, torch.device(device).type)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        check_jagged(values, offsets, timestamps)
        plan = PLANS[self.kernel(values.device)].build(offsets, timestamps, self.config)
        x = plan.enter(self.input_dropout(values))
        for layer in self.layers:
            x = layer(x, plan)
        # Retrieval scores are cosine similarities against L2-normalised items.
        return F.normalize(plan.leave(x), dim=-1)
