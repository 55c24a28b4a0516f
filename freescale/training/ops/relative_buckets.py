"""Log-spaced buckets of relative distances, defined by integer thresholds.

A distance ``d >= 0`` (positions ``i - j``, or seconds ``|t_i - t_j|``) falls in
bucket ``floor(log1p(d) * (num_buckets - 1) / log1p(max_distance))``, capped at
the last bucket. Computed in float32, that formula rounds differently on different
devices and in different kernels, and one flipped bucket changes a bias by its
whole table entry. So the formula only *derives* the thresholds once per shape:
``thresholds[b]`` is the smallest integer distance whose bucket is ``b``, and the
bucket of ``d`` is the number of thresholds ``<= d``. Every implementation counts
against the same integers (``bucket_by_thresholds``; the Triton kernel: a float guess,
then corrected against them), so they agree exactly on every device. On the CPU the
formula that derived the thresholds is used directly: the same function, the same buckets.
"""
from __future__ import annotations

import functools
import math

import torch

INT64_MAX = torch.iinfo(torch.int64).max


def _formula_bucket(distance: torch.Tensor, num_buckets: int, max_distance: float) -> torch.Tensor:
    """The float32 formula the thresholds are derived from (CPU)."""
    scale = (num_buckets - 1) / math.log1p(max_distance)
    buckets = torch.log1p(distance.clamp(min=0).to(torch.float32)) * scale
    return buckets.to(torch.int64).clamp(max=num_buckets - 1)


def bucket_scale(num_buckets: int, max_distance: float) -> float:
    """Buckets per unit of ``log1p(distance)``: kernels use it for a first guess, then the thresholds."""
    return (num_buckets - 1) / math.log1p(max_distance)


@functools.lru_cache(maxsize=32)
def _thresholds_cpu(num_buckets: int, max_distance: float) -> torch.Tensor:
    # Binary search, all buckets at once, for the smallest d with formula(d) >= b. The formula
    # is non-decreasing in d (float conversion, log1p and truncation all are), so this is exact.
    targets = torch.arange(1, num_buckets, dtype=torch.int64)
    low = torch.zeros_like(targets)
    high = torch.full_like(targets, 2 * int(math.ceil(max_distance)) + 2)
    # A bucket the formula never reaches (rounding at max_distance) starts past `high`.
    unreachable = _formula_bucket(high, num_buckets, max_distance) < targets
    while bool((low < high).any()):
        mid = (low + high) // 2
        reached = _formula_bucket(mid, num_buckets, max_distance) >= targets
        high = torch.where(reached, mid, high)
        low = torch.where(reached, low, mid + 1)
    inner = torch.where(unreachable, torch.full_like(high, INT64_MAX), high)
    return torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.full((1,), INT64_MAX, dtype=torch.int64)])


def bucket_thresholds(num_buckets: int, max_distance: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[num_buckets + 1]`` int64: ``[0, first distance of bucket 1, ..., of bucket nb-1, INT64_MAX]``.

    Non-decreasing; equal neighbours mean a bucket no integer distance reaches. Cached per
    device and never written to: a copy per call would be a host-to-device copy per layer,
    which waits for the GPU.
    """
    return _thresholds_on(int(num_buckets), float(max_distance), torch.device(device))


def last_finite_threshold(num_buckets: int, max_distance: float) -> int:
    """The smallest distance of the last bucket any integer distance reaches (0 with one bucket)."""
    thresholds = bucket_thresholds(num_buckets, max_distance)
    return int(thresholds[thresholds < INT64_MAX].max())


@functools.lru_cache(maxsize=64)
def _thresholds_on(num_buckets: int, max_distance: float, device: torch.device) -> torch.Tensor:
    return _thresholds_cpu(num_buckets, max_distance).to(device)


def log_bucket(distance: torch.Tensor, num_buckets: int, max_distance: float) -> torch.Tensor:
    """Bucket ``0..num_buckets-1`` of each distance (negative distances count as 0), int64.

    Distance 0 is bucket 0 and ``max_distance`` (or more) the last bucket; in
    between, ``log1p`` spacing keeps small distances -- the ones that carry the
    most signal -- in separate buckets.
    """
    if distance.device.type == "cpu":
        # The thresholds are derived from this very formula on this CPU, so it gives the
        # same buckets, and is 5x faster than bucketize on the L x L blocks.
        return _formula_bucket(distance, num_buckets, max_distance)
    return bucket_by_thresholds(distance, num_buckets, max_distance)


def bucket_by_thresholds(distance: torch.Tensor, num_buckets: int, max_distance: float) -> torch.Tensor:
    """``log_bucket`` by counting thresholds: the definition every device and kernel shares."""
    thresholds = bucket_thresholds(num_buckets, max_distance, distance.device)
    # bucketize(right=True) counts thresholds <= d; thresholds[0] = 0 is always counted.
    return torch.bucketize(distance.to(torch.int64).clamp(min=0), thresholds[:-1], right=True) - 1
