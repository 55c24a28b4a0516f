"""HSTU encoder (Zhai et al., "Actions Speak Louder than Words", ICML 2024) over jagged batches.

The encoder takes all positions of a batch concatenated (``values`` ``[T, D]``,
``offsets`` ``[B+1]``) and never pads a batch to its longest member: the
linear parts run on ``[T, D]``, and attention runs on each sample's own
positions only, by one of two kernels (``HSTUConfig.attention_kernel``):

* ``grouped`` (CPU, and the reference): PyTorch ops per group of equal-length
  samples (``freescale.training.ops.hstu_attention_reference``), in causal row blocks. Every
  group costs a few dozen small ops per layer, which on a CPU is noise next to the math.
* ``triton`` (CUDA): one jagged kernel per layer and direction
  (``freescale.training.ops.hstu_attention``), with both biases computed inside it. On a GPU
  the grouped ops' launches would cost milliseconds per distinct length in a batch.

Both are ``freescale.training.ops.attention.hstu_attention``'s kernels (``reference`` is ``grouped``); the
plans below hold what a forward shares between its layers.

Either way step time is ``sum_i (a*L_i^2 + b*L_i + c)`` -- the cost model the
offline balancer uses -- and ``benchmarks/jagged_cost_bench.py`` measures that it is on CPU
(``benchmarks/hstu_gpu_bench.py`` on a GPU).

One HSTU layer, for one sample of length ``n``::

    U, V, Q, K = split(SiLU(Linear(LayerNorm(X))))
    A          = SiLU(Q K^T + rab_pos + rab_time) * causal_mask / n
    Y          = X + Linear(Dropout(LayerNorm(A V) * U))

``model.hstu.attention_activation = "softmax"`` replaces ``SiLU(.) / n`` by a Transformer's
``softmax(Q K^T / sqrt(d) + rab_pos + rab_time)`` over the causal keys (the paper's ablation; the
grouped kernel only). ``model.hstu.feed_forward_dim`` > 0 adds SASRec's point-wise feed-forward block after it,
``Y + Dropout(FFN(LayerNorm(Y)))``: not the paper's layer (which drops the FFN by design), an
option measured against it (issue 27).

``rab_pos`` and ``rab_time`` are learned per-head biases indexed by the
log-bucketed relative position ``i - j`` and time gap ``|t_i - t_j|``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from freescale.training.model.attention_kernel import attention_kernel_for
from freescale.training.config import AttentionKernelName, HSTUConfig, keyed_by
from freescale.training.model.encoders import Encoder, feed_forward_network
from freescale.training.ops.jagged import check_jagged, jagged_positions
from freescale.training.ops.attention import BiasSpec, hstu_attention
from freescale.training.ops.hstu_attention_reference import GroupedAttention
from freescale.training.ops.relative_buckets import log_bucket  # noqa: F401 -- tests/training/test_model.py takes it from here


class AttentionPlan(Protocol):
    """What a kernel needs of a batch, built once per forward and shared by every layer.

    ``enter`` puts the encoder's input rows in the order the kernel works in and
    ``leave`` restores jagged order; ``attend`` is one layer's ``A V``.
    """

    def enter(self, x: torch.Tensor) -> torch.Tensor: ...

    def leave(self, x: torch.Tensor) -> torch.Tensor: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: "RelativeAttentionBias") -> torch.Tensor: ...


def bias_spec(config: HSTUConfig) -> BiasSpec:
    """The attention's buckets and normaliser, as both kernels take them."""
    return BiasSpec(
        num_position_buckets=config.num_position_buckets, max_position=config.max_seq_len,
        num_time_buckets=config.num_time_buckets, max_time_gap=config.max_time_gap_seconds,
        normalizer=config.max_seq_len if config.attention_normalization == "max_seq_len" else 0,
        activation=config.attention_activation,
    )


@dataclass(frozen=True)
class GroupedAttentionPlan:
    """The ``grouped`` kernel's plan: the reference attention's ``GroupedAttention``
    (``freescale.training.ops.hstu_attention_reference``; the batch in group order, every layer runs there)."""

    attention: GroupedAttention

    @classmethod
    def build(cls, offsets: torch.Tensor, timestamps: torch.Tensor, config: HSTUConfig) -> "GroupedAttentionPlan":
        return cls(GroupedAttention.build(offsets, timestamps, bias_spec(config), config.attention_block_size))

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention.enter(x)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention.leave(x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: "RelativeAttentionBias") -> torch.Tensor:
        """``A V`` for every sample over its own positions only; ``[T, H * linear_dim]``, group order."""
        return self.attention.attend(q, k, v, bias.position_bias.weight, bias.time_bias.weight)


@dataclass(frozen=True)
class JaggedPlan:
    """The batch as the ``triton`` kernel takes it: jagged order throughout, nothing gathered."""

    spec: BiasSpec
    offsets: torch.Tensor
    timestamps: torch.Tensor

    @classmethod
    def build(cls, offsets: torch.Tensor, timestamps: torch.Tensor, config: HSTUConfig) -> "JaggedPlan":
        return cls(spec=bias_spec(config), offsets=offsets, timestamps=timestamps)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               bias: "RelativeAttentionBias") -> torch.Tensor:
        return hstu_attention(q, k, v, self.offsets, self.timestamps, bias.position_bias.weight,
                              bias.time_bias.weight, self.spec, kernel="triton")


PLANS = keyed_by(AttentionKernelName, {"grouped": GroupedAttentionPlan, "triton": JaggedPlan})


class RelativeAttentionBias(nn.Module):
    """Learned per-head bias tables, indexed by bucketed relative position and time gap; the
    kernels look them up (``freescale.training.ops``)."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.position_bias = nn.Embedding(config.num_position_buckets, config.num_heads)
        self.time_bias = nn.Embedding(config.num_time_buckets, config.num_heads)
        nn.init.normal_(self.position_bias.weight, std=0.02)
        nn.init.normal_(self.time_bias.weight, std=0.02)


class HSTULayer(nn.Module):
    """One HSTU layer: pointwise SiLU attention gated by U, with a residual."""

    def __init__(self, config: HSTUConfig, width: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.attention_dim = config.attention_dim
        self.linear_dim = config.linear_dim
        value_width = config.num_heads * config.linear_dim
        qk_width = config.num_heads * config.attention_dim
        self.input_norm = nn.LayerNorm(width, elementwise_affine=config.norm_affine)
        # One projection for U, V, Q, K: a single GEMM over [T, D] instead of four.
        self.uvqk = nn.Linear(width, 2 * value_width + 2 * qk_width)
        self.relative_bias = RelativeAttentionBias(config)
        self.attention_norm = nn.LayerNorm(value_width, elementwise_affine=config.norm_affine)
        self.dropout = nn.Dropout(config.dropout)
        self.output = nn.Linear(value_width, width)
        if config.init == "reference":
            # Drawn after nn.Linear's own, so the default ("torch") draws the same numbers as before.
            nn.init.normal_(self.uvqk.weight, std=0.02)
            nn.init.zeros_(self.uvqk.bias)
            nn.init.xavier_uniform_(self.output.weight)
            nn.init.zeros_(self.output.bias)
        # Made last and only when asked: the default layer draws the same numbers as before it existed.
        self.feed_forward: nn.Sequential | None = None
        if config.feed_forward_dim:
            self.feed_forward_norm = nn.LayerNorm(width, elementwise_affine=config.norm_affine)
            self.feed_forward = feed_forward_network(width, config.feed_forward_dim, config.dropout)

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
        x = x + self.output(self.dropout(gated))
        if self.feed_forward is None:
            return x
        return x + self.dropout(self.feed_forward(self.feed_forward_norm(x)))


class HSTUEncoder(Encoder):
    """Stack of HSTU layers over a jagged batch; outputs are L2-normalised per position.

    Call as ``encoder(values, offsets, timestamps)`` with ``values`` ``[T, width]``
    (input embeddings of all positions, samples concatenated), ``offsets``
    ``[B+1]`` int64 and ``timestamps`` ``[T]`` (seconds). Position ``t`` of a
    sample only sees positions ``<= t`` of the same sample (``freescale.training.model.encoders``).
    """

    def __init__(self, config: HSTUConfig, width: int, position_init_std: float = 0.02) -> None:
        super().__init__()
        self.config = config
        self.input_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(HSTULayer(config, width) for _ in range(config.num_layers))
        # Both off by default: no parameters made, no random numbers drawn (the default model is unchanged).
        self.position_embedding: nn.Embedding | None = None
        if config.position_embeddings:
            self.position_embedding = nn.Embedding(config.position_embeddings, width)
            nn.init.normal_(self.position_embedding.weight, std=position_init_std)
        self.output_norm: nn.LayerNorm | None = nn.LayerNorm(width) if config.output_norm else None

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def kernel(self, device: torch.device | str) -> AttentionKernelName:
        """The attention kernel this encoder runs on ``device``; one line where triton would run and
        cannot (``freescale.training.model.attention_kernel``)."""
        return attention_kernel_for(self.config, torch.device(device).type)

    def not_capturable(self, device: torch.device | str) -> str | None:
        """The triton kernel's plan reads nothing on the host (its grid comes from the shapes); the grouped one does."""
        if self.kernel(device) == "triton":
            return None
        return "its grouped attention kernel reads the batch's lengths on the host (the triton kernel does not)"

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        check_jagged(values, offsets, timestamps)
        plan = PLANS[self.kernel(values.device)].build(offsets, timestamps, self.config)
        if self.position_embedding is not None:
            values = values + self.position_embedding(jagged_positions(offsets, self.config.position_embeddings,
                                                                        values.shape[0]))
        x = plan.enter(self.input_dropout(values))
        for layer in self.layers:
            x = layer(x, plan)
        x = plan.leave(x)
        if self.output_norm is not None:
            x = self.output_norm(x)
        # Retrieval scores are cosine similarities against L2-normalised items.
        return F.normalize(x, dim=-1)
