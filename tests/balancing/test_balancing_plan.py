"""Tests for balancing.plan (window of steps) and the bubble helper."""
from __future__ import annotations

import numpy as np
import pytest

from freescale.balancing import InfeasibleError, Plan, bubble, plan


def heavy_tailed(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(4.2, 0.9, n)), 20, 1024).astype(np.int64)
    return lengths**2 + 160.0 * lengths + 1000.0, lengths


def check_plan(pl: Plan, n: int, k: int, b: int) -> None:
    g = k * b
    original = np.arange(n) // g
    assert pl.num_steps == -(-n // g)
    assert pl.step.dtype == np.int32 and pl.rank.dtype == np.int32
    assert pl.step.shape == (n,) and pl.rank.shape == (n,)
    # Every step keeps its sample count, so every sample appears exactly once per (step, rank) cell.
    np.testing.assert_array_equal(np.bincount(pl.step, minlength=pl.num_steps), np.bincount(original))
    assert pl.rank.min() >= 0 and pl.rank.max() < k
    assert pl.moved == int((pl.step != original).sum())
    assert pl.loads.shape == (pl.num_steps, k)


@pytest.mark.parametrize("strategy", ["contiguous", "lpt", "kk", "ortools"])
def test_plan_keeps_counts_and_reports_moves(strategy: str) -> None:
    k, b, w = 4, 8, 6
    n = k * b * w - 5  # last step partial
    costs, lengths = heavy_tailed(n, seed=1)
    pl = plan(costs, k, b, window_steps=w, strategy=strategy, lengths=lengths, time_limit_s=0.1)
    check_plan(pl, n, k, b)
    # Loads are the per-(step, rank) cost sums of the assignment.
    expected = np.zeros((pl.num_steps, k))
    np.add.at(expected, (pl.step, pl.rank), costs)
    np.testing.assert_allclose(pl.loads, expected)
    assert pl.strategy == strategy and 0 < pl.solve_time_s < 60  # timed, and not a stale or default value
    assert 0.0 <= pl.lower_bound_bubble <= pl.bubble + 1e-12


def test_window_of_one_moves_nothing() -> None:
    k, b = 8, 4
    costs, _ = heavy_tailed(k * b * 5, seed=2)
    pl = plan(costs, k, b, window_steps=1)
    assert pl.moved == 0
    np.testing.assert_array_equal(pl.step, np.arange(costs.size) // (k * b))


def test_window_lowers_the_bubble_on_heavy_tails() -> None:
    k, b, w = 64, 16, 16
    costs, lengths = heavy_tailed(k * b * w, seed=3)
    per_step = plan(costs, k, b, window_steps=1, lengths=lengths)
    window = plan(costs, k, b, window_steps=w, lengths=lengths)
    check_plan(window, costs.size, k, b)
    assert per_step.bubble > 0.2  # single samples above a rank's share of their step
    assert window.bubble < 0.02
    assert window.bubble < per_step.bubble
    assert 0 < window.moved < costs.size // 4


def test_window_with_equal_counts_keeps_the_bubble_low() -> None:
    k, b, w = 64, 16, 16
    costs, _ = heavy_tailed(k * b * w, seed=8)
    pl = plan(costs, k, b, window_steps=w, equal_counts=True)
    counts = np.zeros((pl.num_steps, k), dtype=int)
    np.add.at(counts, (pl.step, pl.rank), 1)
    assert (counts == b).all()
    assert pl.bubble < 0.02


def test_windows_are_planned_independently_when_n_exceeds_one_window() -> None:
    k, b, w = 8, 4, 3
    costs, _ = heavy_tailed(k * b * 7 + 3, seed=4)
    pl = plan(costs, k, b, window_steps=w)
    check_plan(pl, costs.size, k, b)
    window_of = np.arange(costs.size) // (k * b) // w
    np.testing.assert_array_equal(pl.step // w, window_of)  # no sample leaves its window


def test_bubble_definitions_with_capacities() -> None:
    k, b = 4, 8
    costs, _ = heavy_tailed(k * b * 3, seed=5)
    cap = np.array([1.2, 1.0, 1.0, 0.8])
    pl = plan(costs, k, b, window_steps=3, capacities=cap)
    capn = cap / cap.mean()
    spans = (pl.loads / capn).max(axis=1)
    assert pl.bubble == pytest.approx(1 - (costs.sum() / k) / spans.sum())
    assert pl.lower_bound_bubble <= pl.bubble + 1e-12


def test_plan_is_deterministic() -> None:
    k, b = 16, 8
    costs, lengths = heavy_tailed(k * b * 8, seed=6)
    for strategy in ("kk", "ortools"):
        a = plan(costs, k, b, window_steps=8, strategy=strategy, lengths=lengths, seed=3, time_limit_s=0.1)
        c = plan(costs, k, b, window_steps=8, strategy=strategy, lengths=lengths, seed=3, time_limit_s=0.1)
        np.testing.assert_array_equal(a.step, c.step)
        np.testing.assert_array_equal(a.rank, c.rank)


def test_plan_respects_token_cap_and_equal_counts() -> None:
    k, b, w = 8, 16, 4
    costs, lengths = heavy_tailed(k * b * w, seed=7)
    cap = int(np.ceil(max(np.bincount(np.arange(costs.size) // (k * b), weights=lengths)) / k * 1.3))
    pl = plan(costs, k, b, window_steps=w, lengths=lengths, token_cap=cap, equal_counts=True)
    check_plan(pl, costs.size, k, b)
    tokens = np.zeros((pl.num_steps, k))
    np.add.at(tokens, (pl.step, pl.rank), lengths)
    assert tokens.max() <= cap
    counts = np.zeros((pl.num_steps, k), dtype=int)
    np.add.at(counts, (pl.step, pl.rank), 1)
    assert counts.min() == b and counts.max() == b
    with pytest.raises(InfeasibleError, match="token_cap=100"):
        plan(costs, k, b, lengths=lengths, token_cap=100)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (([1.0, -2.0], 2, 1), {}, r"costs\[1\] = -2.0 is negative"),
        (([1.0, float("nan")], 2, 1), {}, r"costs\[1\] = nan is not finite"),
        (([1.0], 0, 1), {}, "world_size must be an integer >= 1"),
        (([1.0], 2, 0), {}, "local_batch_size must be an integer >= 1"),
        (([1.0], 2, 1), {"window_steps": 0}, "window_steps must be an integer >= 1"),
        (([1.0], 2, 1), {"token_cap": 10}, "token_cap requires lengths"),
        (([], 2, 1), {}, "costs is empty"),
        (([1.0], 2, 1), {"strategy": "best"}, "strategy must be one of"),
    ],
)
def test_plan_bad_inputs(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan(*args, **kwargs)


def test_bubble_helper() -> None:
    assert bubble(np.array([[1.0, 1.0], [2.0, 2.0]])) == 0.0
    # Step 0 waits 1 of 4 rank-units, step 1 waits 0: 1 - (1.5 + 1) / (2 + 1) = 1/6.
    assert bubble(np.array([[1.0, 2.0], [1.0, 1.0]])) == pytest.approx(1 / 6)
    assert bubble(np.array([3.0, 1.0])) == pytest.approx(1 - 2 / 3)
    assert bubble(np.zeros((2, 3))) == 0.0


def test_plan_options_and_keywords_are_the_same_request() -> None:
    """One ``PlanOptions`` or its names as keywords: the same plan; keywords replace the object's fields."""
    from freescale.balancing import PlanOptions, partition

    costs, lengths = heavy_tailed(4 * 8 * 6, seed=5)
    asked = PlanOptions(window_steps=3, equal_counts=True, token_cap=40_000, seed=4, capacities=[1.0, 0.8, 1.0, 1.2])
    by_object = plan(costs, 4, 8, asked, lengths=lengths)
    by_keywords = plan(costs, 4, 8, window_steps=3, equal_counts=True, token_cap=40_000, seed=4,
                       capacities=[1.0, 0.8, 1.0, 1.2], lengths=lengths)
    overridden = plan(costs, 4, 8, PlanOptions(window_steps=1, seed=9), lengths=lengths, window_steps=3,
                      equal_counts=True, token_cap=40_000, seed=4, capacities=[1.0, 0.8, 1.0, 1.2])
    assert by_object.moved > 0  # the window was used, so the options reached the planner
    for other in (by_keywords, overridden):
        np.testing.assert_array_equal(by_object.step, other.step)
        np.testing.assert_array_equal(by_object.rank, other.rank)
    with pytest.raises(TypeError, match="window"):
        plan(costs, 4, 8, window=3)
    with pytest.raises(ValueError, match="window_steps must be 1"):
        partition(costs, 4, asked, lengths=lengths)
