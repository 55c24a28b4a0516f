"""The comm layer's named choices, as types the trainer's config checks when it loads.

No torch here: ``freescale.training.config`` imports it, and jobs read configs without loading torch.
"""
from __future__ import annotations

from typing import Literal

BackendName = Literal["auto", "gloo", "nccl", "copy_engine"]
"""``auto``: nccl with CUDA, else gloo. ``copy_engine``: CUDA copy engines move the bytes (SM-free)."""
