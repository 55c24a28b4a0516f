"""Result types and the error raised when constraints cannot be met."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from freescale.runtime.errors import InputError

LeftoverPolicy = Literal["drop", "keep"]
"""The samples of a last, partial global batch: ``drop`` leaves them out (counted and reported),
``keep`` makes them a short last step."""
LEFTOVER_POLICIES: tuple[str, ...] = get_args(LeftoverPolicy)


class InfeasibleError(InputError):
    """The constraints (token cap, equal counts) admit no assignment, or the strategy found none.

    The message is one line naming the violated constraint and the numbers involved.
    """


@dataclass(frozen=True)
class Partition:
    """Assignment of the samples of one global batch to ranks.

    Times are in cost units divided by rank capacity, with capacities normalised to mean 1,
    so with equal capacities ``makespan == loads.max()``.
    """

    rank: np.ndarray  # int32 [N], rank of every sample, in input order
    loads: np.ndarray  # float64 [K], sum of costs per rank
    counts: np.ndarray  # int64 [K]
    tokens: np.ndarray | None  # int64 [K], sum of lengths per rank (None without lengths)
    lower_bound: float  # max(total/sum(cap), max_cost/max(cap))
    makespan: float  # max over ranks of loads/cap
    gap: float  # makespan/lower_bound - 1 (0.0 when lower_bound == 0)
    strategy: str
    solve_time_s: float


@dataclass(frozen=True)
class Plan:
    """Assignment of the samples of a window of global batches to (step, rank)."""

    step: np.ndarray  # int32 [N], step within the plan, 0..num_steps-1
    rank: np.ndarray  # int32 [N]
    loads: np.ndarray  # float64 [num_steps, K]
    num_steps: int
    moved: int  # samples whose step differs from their original step i // (K*B)
    bubble: float  # 1 - (total/sum(cap)) / sum_s max_k loads[s,k]/cap[k]
    lower_bound_bubble: float  # same, with each step's makespan replaced by its lower bound
    strategy: str
    solve_time_s: float
