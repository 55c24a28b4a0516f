"""``training.precision`` -> the autocast the encoder runs under, for the trainer, calibrate and the GPU bench.

Only torch and the config: ``benchmarks/hstu_gpu_bench.py`` imports this on a machine without torchrec.
"""
from __future__ import annotations

import torch

from freescale.training.config import Precision, keyed_by

# training.precision -> the encoder's autocast dtype; None: no autocast, fp32 throughout.
AUTOCAST_DTYPES = keyed_by(Precision, {"fp32": None, "bf16": torch.bfloat16})


def encoder_autocast(precision: Precision, device: torch.device | str) -> torch.autocast:
    """The context the encoder's forward runs in on ``device`` (its type: ``cpu``, ``cuda``).

    ``"fp32"`` turns autocast off rather than leaving the caller's on: the key, not a caller's
    context, decides the encoder's arithmetic. Parameters are never cast: autocast computes in
    bf16 from fp32 weights, and their gradients come back fp32.
    """
    dtype = AUTOCAST_DTYPES[precision]
    device_type = torch.device(device).type
    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)
