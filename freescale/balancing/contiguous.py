"""The baseline every data-parallel loader uses: consecutive blocks of samples per rank."""
from __future__ import annotations

import numpy as np


def contiguous_ranks(n: int, world_size: int) -> np.ndarray:
    """Rank of each sample when rank k takes the k-th consecutive block.

    The first ``n % world_size`` ranks take ceil(n/K) samples, the rest floor(n/K). Costs are ignored.
    """
    q, r = divmod(n, world_size)
    sizes = np.full(world_size, q, dtype=np.int64)
    sizes[:r] += 1
    return np.repeat(np.arange(world_size, dtype=np.int32), sizes)
