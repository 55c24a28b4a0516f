"""The Triton attention kernel's limits on its bucket tables and its backward's variants, importable
without triton or torch.

The kernel (``freescale.training.ops.hstu_attention``) imports triton when it is imported; the config
check that runs before any rank starts (``freescale.training.model.attention_kernel``) must not wait for that,
nor for torch (1.5 s), so the limits live here and the kernel takes them from here. The entry
(``freescale.training.ops.attention``) names the backward's variants without importing triton, so they live
here too.

Both limits are on the last finite threshold of a bucket table (``freescale.training.ops.relative_buckets``):
the smallest distance of the last bucket, which is ``max_distance`` up to float32 rounding.
"""
from __future__ import annotations

from typing import Literal

POSITION_TABLE_LIMIT = 2**20
"""Longest distance the position table spells out (4 MiB); histories are far shorter."""
INT32_MAX = 2**31 - 1
"""The kernels hold time thresholds and clamped gaps in 32 bits: every finite threshold must be below it."""

# The last finite threshold is within this fraction of max_distance (plus one, for the
# integer above it): measured at most 1e-5 for 2..10^4 buckets and distances up to 1e15.
ROUNDING = 1e-4


def position_table_too_long(num_buckets: int, max_position: float) -> bool:
    """Whether the position table (every distance up to the last threshold) passes ``POSITION_TABLE_LIMIT``."""
    return _last_threshold_past(num_buckets, max_position, POSITION_TABLE_LIMIT)


def time_gaps_too_wide(num_buckets: int, max_time_gap: float) -> bool:
    """Whether a time threshold reaches 2^31 s, beyond the kernels' 32-bit gaps."""
    return _last_threshold_past(num_buckets, max_time_gap, INT32_MAX - 1)


def _last_threshold_past(num_buckets: int, max_distance: float, fits: int) -> bool:
    """Whether the last finite threshold of these buckets exceeds ``fits``.

    Far from ``fits`` the answer follows from ``max_distance`` alone; within float32 rounding of
    it, from the thresholds themselves (torch, imported only then)."""
    if num_buckets < 2:
        return False  # one bucket: no threshold but 0
    if max_distance * (1 + ROUNDING) + 2 <= fits:
        return False
    if max_distance * (1 - ROUNDING) - 2 > fits:
        return True
    from freescale.training.ops.relative_buckets import last_finite_threshold

    return last_finite_threshold(num_buckets, max_distance) > fits


Backward = Literal["two_phase", "atomic_dq"]
"""How the backward gets ``dQ`` and the bias gradients. ``two_phase`` (the default): a second pass per
program over its tile as queries, recomputing the scores. ``atomic_dq``: one pass, every gradient from
the same score tile, ``dQ`` by relaxed fp32 atomic adds (FlashAttention-2's trade: half the score and
bias work for ``BLOCK x d`` atomics per tile pair). Which is faster is the GPU's to say
(``benchmarks/hstu_gpu_bench.py``, section d); both are tested against the reference."""
