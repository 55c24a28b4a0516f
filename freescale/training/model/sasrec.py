"""SASRec encoder (Kang & McAuley, "Self-Attentive Sequential Recommendation", ICDM 2018) over jagged batches.

The baseline every sequential-recommendation paper reports, in the same trainer as HSTU:
same item tables, user features, losses, comm modes, checkpoints and evaluation; only
the encoder differs (``model.encoder = "sasrec"``). Same call as ``HSTUEncoder``:
``encoder(values [T, D], offsets [B+1], timestamps [T]) -> [T, D]``, L2-normalised,
position ``t`` of a sample seeing positions ``<= t`` of that sample only. Timestamps
are accepted and unused: SASRec knows order, not time.

From the paper (section III), for one sample of length ``n`` with inputs ``E``
(the model's item rows, scaled by ``sqrt(D)``, plus ratings and user features when
the model has them)::

    X    = Dropout(E + P)                                    P: learned absolute positions
    X    = X + Dropout(SA(LayerNorm(X)))                     causal softmax self-attention
    X    = X + Dropout(FFN(LayerNorm(X)))                    FFN(x) = ReLU(x W1 + b1) W2 + b2
    out  = L2normalize(LayerNorm(X))

``SA`` is ``softmax(Q K^T / sqrt(d)) V`` over positions ``j <= i`` with ``Q, K, V``
linear maps of its input, split into ``num_heads`` heads and projected back (the
reference implementation's multi-head attention; with one head the output
projection is one more linear map), with dropout on the attention weights. The
final LayerNorm is the reference code's; the L2 normalisation is this model's: every
score (training logits and evaluation ranking) is a cosine similarity against
L2-normalised item rows, whichever the encoder.

Never padded: the linear parts (projections, norms, the feed-forward network) run on
the ``[T, D]`` rows, and attention per group of equal-length samples (``freescale.training.ops.jagged.GroupedPlan``,
as HSTU's ``grouped`` kernel), so a batch costs ``sum_i (a L_i^2 + b L_i + c)``,
the balancer's cost model, and a sample's outputs never depend on its batch-mates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freescale.training.config import SASRecConfig
from freescale.training.model.encoders import Encoder, feed_forward_network
from freescale.training.ops.jagged import GroupedPlan, check_jagged, jagged_positions


def causal_attention(plan: GroupedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
                     dropout: float) -> torch.Tensor:
    """Causal softmax attention of every sample over its own positions, one batched call per group
    of equal-length samples; ``q``, ``k``, ``v`` ``[T, D]`` in the plan's group order, out ``[T, D]``, same order."""
    if not plan.groups:
        return v.new_zeros(0, v.shape[1])
    out = []
    for group, qg, kg, vg in zip(plan.groups, plan.split(q), plan.split(k), plan.split(v)):
        samples, length = group.rows.shape
        heads = [t.view(samples, length, num_heads, -1).transpose(1, 2) for t in (qg, kg, vg)]  # [G, H, L, D/H]
        # Scaled by 1/sqrt(D / H); the causal mask leaves every row at least its diagonal.
        attended = F.scaled_dot_product_attention(*heads, dropout_p=dropout, is_causal=True)
        out.append(attended.transpose(1, 2).reshape(samples * length, -1))
    return torch.cat(out)


class SASRecBlock(nn.Module):
    """One self-attention block: causal multi-head softmax attention, then the point-wise
    feed-forward network, each as ``x + Dropout(g(LayerNorm(x)))``."""

    def __init__(self, width: int, config: SASRecConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.attention_dropout = config.dropout
        hidden = config.feed_forward_dim or width
        self.attention_norm = nn.LayerNorm(width)
        # Q, K and V in one GEMM over the [T, D] rows.
        self.qkv = nn.Linear(width, 3 * width)
        self.attention_output = nn.Linear(width, width)
        self.feed_forward_norm = nn.LayerNorm(width)
        self.feed_forward = feed_forward_network(width, hidden, config.dropout)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, plan: GroupedPlan) -> torch.Tensor:
        """``x`` ``[T, D]`` in the plan's group order -> ``[T, D]``, same order."""
        q, k, v = self.qkv(self.attention_norm(x)).chunk(3, dim=-1)
        dropout = self.attention_dropout if self.training else 0.0
        attended = causal_attention(plan, q, k, v, self.num_heads, dropout)
        x = x + self.dropout(self.attention_output(attended))
        return x + self.dropout(self.feed_forward(self.feed_forward_norm(x)))


class SASRecEncoder(Encoder):
    """Stack of SASRec blocks over a jagged batch; outputs are L2-normalised per position.

    Call as ``encoder(values, offsets, timestamps)`` with ``values`` ``[T, width]`` (the
    input embeddings of all positions, samples concatenated), ``offsets`` ``[B+1]`` int64
    and ``timestamps`` ``[T]`` (unused). Position ``t`` of a sample only sees positions
    ``<= t`` of the same sample (``freescale.training.model.encoders``). Attention runs per group of
    equal-length samples on CPU and CUDA alike (the contract's default ``kernel``, ``"grouped"``).
    """

    def __init__(self, config: SASRecConfig, width: int, position_init_std: float = 0.02) -> None:
        super().__init__()
        if width % config.num_heads:
            raise ValueError(f"sasrec.num_heads {config.num_heads} must divide the model width {width}")
        self.config = config
        self.position_embedding = nn.Embedding(config.max_seq_len, width)
        # The model passes its inputs' spread, so positions neither swamp item identity nor vanish.
        nn.init.normal_(self.position_embedding.weight, std=position_init_std)
        self.input_dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(SASRecBlock(width, config) for _ in range(config.num_layers))
        self.output_norm = nn.LayerNorm(width)

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        check_jagged(values, offsets, timestamps)
        positions = jagged_positions(offsets, self.config.max_seq_len, values.shape[0])
        x = self.input_dropout(values + self.position_embedding(positions))
        plan = GroupedPlan.build(offsets)
        x = plan.enter(x)
        for block in self.blocks:
            x = block(x, plan)
        # Retrieval scores are cosine similarities against L2-normalised items.
        return F.normalize(self.output_norm(plan.leave(x)), dim=-1)
