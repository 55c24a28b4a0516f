"""Bubble arithmetic against numbers worked out by hand.

Two steps, two ranks, times in ms:

    step 0: dense compute [3, 1], step time [4, 4], cost [3, 1]
    step 1: dense compute [2, 2], step time [4, 3], cost [2, 2]

Rank waits for the slowest compute: step 0 [0, 2], step 1 [0, 0], so 2 ms of waiting
in 2 ranks x (4 + 4) ms = 16 rank-ms (a step lasts as long as its slowest rank).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from freescale.balancing.metrics import bubble, bubble_of_totals
from freescale.training.timing import bubbles
from freescale.training.timing.bubbles import FIELD_INDEX, TIMING_FIELDS


def table(**columns: list[list[float]]) -> np.ndarray:
    out = np.zeros((2, 2, len(TIMING_FIELDS)))
    for name, values in columns.items():
        out[..., FIELD_INDEX[name]] = values
    return out


HAND = table(dense_compute_s=[[3, 1], [2, 2]], dense_compute_cpu_s=[[2, 1], [2, 2]], step_s=[[4, 4], [4, 3]],
             cost=[[3, 1], [2, 2]], sparse_forward_s=[[0.5, 0.5], [0.25, 0.25]],
             sparse_backward_s=[[0.25, 0.25], [0.25, 0.25]], allreduce_s=[[0.25, 0.25], [0.5, 0.5]],
             comm_s=[[1, 1], [1, 1]], exposed_comm_s=[[0.5, 0.25], [0.25, 0]], data_wait_s=[[0, 1], [0, 0]])


def test_per_rank_and_per_step_bubbles():
    compute = bubbles.column(HAND, "dense_compute_s")
    assert bubbles.rank_bubbles(compute).tolist() == [[0, 2], [0, 0]]
    step_time = bubbles.column(HAND, "step_s").max(axis=1)
    assert bubbles.step_bubble_fractions(compute, step_time).tolist() == [2 / 8, 0]


def test_summary_numbers():
    s = bubbles.summarize(HAND)
    assert s["bubble_fraction"] == 2 / 16
    assert s["bubble_fraction_cpu"] == 1 / 16  # CPU clock: [2, 1] -> 1 ms of waiting
    assert s["compute_bubble_fraction"] == 2 / 10  # against the slowest compute (3 + 2 ms) instead
    assert s["idle_fraction"] == 1 - 8 / 16  # 8 rank-ms of compute in 16
    assert s["exposed_comm_fraction"] == 1 / 16
    assert s["overlap_fraction"] == 1 - 1 / 4  # 1 ms exposed of 4 ms in flight
    assert s["imbalance"] == (0.5 + 0) / 2  # cost max/mean - 1 per step, averaged
    assert s["step_time_s"] == 4 and s["collective_s"] == 1 and s["data_wait_s"] == 0
    assert s["measured_steps"] == 2


def test_warm_up_steps_are_left_out():
    s = bubbles.summarize(HAND, skip_steps=1)
    assert s["bubble_fraction"] == 0 and s["imbalance"] == 0 and s["measured_steps"] == 1
    assert bubbles.summarize(HAND, skip_steps=2) == {}


def test_predicted_and_measured_bubbles_are_one_formula():
    """The balancer's bubble of loads [steps, ranks] is the measured compute bubble when the
    loads are the compute times, and the balance job's per-step table gives the same number."""
    from freescale.shards.spark_plan import bubble_of

    exact = pytest.approx(2 / 10, rel=1e-12)  # 1 - 4/5 and 2/10 round differently
    assert bubble([[3, 1], [2, 2]]) == exact and bubbles.summarize(HAND)["compute_bubble_fraction"] == exact
    assert bubble_of_totals(4, 5) == exact
    assert bubble_of(pd.DataFrame({"max_time": [3.0, 2.0], "mean_time": [2.0, 2.0]})) == exact
    assert bubble([[0.0, 0.0]]) == 0.0 and bubble_of_totals(0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="shape"):
        bubble(np.zeros((2, 0)))


def test_the_log_holds_only_the_steps_since_its_last_gather():
    log = bubbles.StepTimeLog(world_size=1, sync_every=2)
    windows = [log.record(step, bubbles.StepTiming(step_s=float(step))) for step in range(5)]
    assert windows[0] is None and windows[2] is None and windows[4] is None
    steps, rows = windows[3]
    assert steps == [2, 3] and rows.shape == (2, 1, len(TIMING_FIELDS))
    assert bubbles.column(rows, "step_s").tolist() == [[2.0], [3.0]]
    steps, rows = log.flush()
    assert steps == [4] and log.flush() is None and not hasattr(log, "_gathered")
