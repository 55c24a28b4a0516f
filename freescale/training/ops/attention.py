"""HSTU attention's one entry (as generative-recommenders' ``hstu_mha(kernel=...)``): the Triton kernel
or its PyTorch reference, the same arguments and the same numbers (within TF32 rounding).

``triton``: ``freescale.training.ops.hstu_attention.jagged_hstu_attention``, one launch per layer and direction
(CUDA, or the Triton interpreter under ``TRITON_INTERPRET=1``). Imported on first use: importing
triton takes seconds, and the CPU path never needs it.

``reference``: ``freescale.training.ops.hstu_attention_reference.reference_hstu_attention``, PyTorch ops per
group of equal-length samples; the model's ``grouped`` kernel (``model.hstu.attention_kernel``).

Tests and benchmarks compare the two through this function. The encoder (``freescale.training.model.hstu``) builds
its kernel's plan once per forward instead: the triton plan calls this entry, the grouped one
keeps the reference's ``GroupedAttention`` for every layer (buckets built once, the batch permuted once).
"""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Literal, get_args

import torch

from freescale.training.ops.hstu_attention_reference import BiasSpec, reference_hstu_attention
from freescale.training.ops.kernel_limits import Backward

__all__ = ["Backward", "BiasSpec", "Kernel", "hstu_attention"]

Kernel = Literal["triton", "reference"]



def hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_weight: torch.Tensor, time_weight: torch.Tensor, spec: BiasSpec, kernel: Kernel = "triton",
    block: int | None = None, precise: bool = False, backward: Backward = "two_phase",
) -> torch.Tensor:
    """``A V`` of every sample over its own positions, ``[T, H * dv]`` in jagged order.

    ``q``, ``k`` ``[T, H * dq]`` and ``v`` ``[T, H * dv]`` (column views of one projection are fine);
    ``offsets`` ``[B+1]`` int64; ``timestamps`` ``[T]`` seconds; the bias tables ``[buckets, H]``.
    ``block``: query rows per block -- the kernel's tile (None: autotuned) or the reference's row
    block (None: a whole sample). ``precise`` (triton only): full fp32 dots instead of TF32. The
    reference's matmuls are torch's, so their TF32 follows ``torch.backends.cuda.matmul.allow_tf32``,
    which its caller sets around forward and backward; here it could only reach the forward, so
    ``precise`` with the reference is refused rather than half kept. ``backward`` (triton only): the
    backward kernel's variant, ``freescale.training.ops.hstu_attention.Backward``.
    """
    if kernel == "triton":
        return _triton().jagged_hstu_attention(q, k, v, offsets, timestamps, position_weight, time_weight, spec,
                                               block=block, precise=precise, backward=backward)
    if kernel == "reference":
        if precise:
            raise ValueError("precise=True is the triton kernel's; the reference's matmuls follow "
                             "torch.backends.cuda.matmul.allow_tf32, set it around forward and backward")
        if backward != "two_phase":
            raise ValueError(f"backward={backward!r} is a triton kernel variant; the reference has one backward")
        return reference_hstu_attention(q, k, v, offsets, timestamps, position_weight, time_weight, spec,
                                        block=block)
    raise ValueError(f"kernel must be one of {get_args(Kernel)}, not {kernel!r}")


@functools.cache
def _triton() -> ModuleType:
    """``freescale.training.ops.hstu_attention``, imported on first use."""
    from freescale.training.ops import hstu_attention as triton_kernel

    return triton_kernel
