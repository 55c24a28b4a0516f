"""`flops_kk`: the online FLOP balancer of NVIDIA recsys-examples, as a baseline strategy.

Written from its published description, no code taken: per global batch, every sample's
FLOPs (the layer's projections, linear in L, plus the attention's L^2 term; no per-sample
constant) are gathered and Karmarkar-Karp splits the batch into ranks of equal sample count.
No windows: each global batch is balanced alone, as an online shuffler sees it.

FreeScale's own strategies differ in two ways this baseline exists to measure: they balance the
cost model fitted to measured time (which has a per-sample constant and the real ratio of the
L^2 to the L term), and they move samples between the steps of a window.

The FLOP count of one HSTU layer of width d is about 4*d*L^2 (Q K^T and A V) plus 10*d^2*L
(the U, V, Q, K projections and the output projection); only ratios between samples matter,
so dividing by 4d gives L^2 + 2.5*d*L (freescale/costs/cost_model.py's analytic default without its
constant).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from freescale.balancing.inputs import Problem
from freescale.balancing.karmarkar_karp import kk_ranks


def flop_costs(lengths: np.ndarray, width: int) -> np.ndarray:
    """A sample's FLOPs up to a common factor: L^2 + 2.5*d*L, no constant term."""
    x = np.asarray(lengths, dtype=np.float64)
    return x * x + 2.5 * width * x


def flops_kk_ranks(p: Problem) -> np.ndarray:
    """Ranks from Karmarkar-Karp on the FLOP costs with equal counts; ``p.costs`` (the cost model's)
    are not read, so the plan's loads show what FLOP balancing leaves on the real cost."""
    if p.lengths is None:
        raise ValueError("strategy 'flops_kk' needs lengths: it balances the FLOPs of each history length")
    if p.token_cap is not None:
        raise ValueError("strategy 'flops_kk' takes no token_cap: the online FLOP balancer it reproduces has none")
    flops = dataclasses.replace(p, costs=flop_costs(p.lengths, p.flop_width), equal_counts=True,
                                count_lo=p.n // p.world_size, count_hi=-(-p.n // p.world_size))
    return kk_ranks(flops)
