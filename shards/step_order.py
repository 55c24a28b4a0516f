"""PLACEHOLDER until the epochs branch merges: identity order (epoch 0's)."""
from __future__ import annotations

import numpy as np


def epoch_order(num_steps: int, window_steps: int, seed: int, epoch: int) -> np.ndarray:
    return np.arange(num_steps)
