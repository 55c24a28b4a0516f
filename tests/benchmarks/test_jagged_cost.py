"""The analysis behind benchmarks/jagged_cost_bench.py, fed with timings built here: it must accept
a jagged encoder whose step time is the sum of per-sample costs a*L^2 + b*L + c, and reject one
that pads every batch to its longest member. The measurement itself is the benchmark's (it flaked
as a test on loaded CI machines)."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def bench():
    from benchmarks import jagged_cost_bench

    return jagged_cost_bench


A, B, C, D = 2e-8, 3e-6, 4e-5, 1e-3  # per L^2, per token, per sample, per step (seconds)


def _jagged(lengths: list[int]) -> float:
    x = np.asarray(lengths, dtype=np.float64)
    return float((A * x * x + B * x + C).sum()) + D


def _padded(lengths: list[int]) -> float:
    return _jagged([max(lengths)] * len(lengths))


def _timings(bench, cost) -> dict[str, float]:
    batches = {**bench.CALIBRATION, "mix_short": bench.MIX_SHORT, "mix_long": bench.MIX_LONG}
    return {name: cost(lengths) for name, lengths in batches.items()}


def test_nonnegative_least_squares_recovers_exact_coefficients(bench):
    rng = np.random.default_rng(0)
    features = rng.uniform(0.5, 2.0, size=(12, 4))
    coef = np.array([0.5, 0.0, 2.0, 0.25])
    np.testing.assert_allclose(bench.nonnegative_least_squares(features, features @ coef), coef, atol=1e-9)
    # a negative unconstrained optimum is clipped to the best non-negative support
    assert (bench.nonnegative_least_squares(features, -(features @ coef)) >= 0).all()


def test_per_sample_costs_pass_the_analysis(bench):
    report, failures = bench.analyse(_timings(bench, _jagged))
    assert failures == [], report
    assert f"a={A:.3e}" in report  # the fit recovers the quadratic term exactly


def test_a_padding_encoder_fails_the_analysis(bench):
    report, failures = bench.analyse(_timings(bench, _padded))
    assert failures, report
