"""Strategy flops_kk, the online FLOP balancer of NVIDIA recsys-examples as a baseline: Karmarkar-Karp on
L^2 + 2.5*d*L per global batch, equal counts, no windows, no token cap."""
from __future__ import annotations

import numpy as np
import pytest

from freescale.balancing import partition, plan
from freescale.balancing.flops_kk import flop_costs
from freescale.balancing.simulate import lognormal_lengths
from freescale.costs.cost_model import CostModel


def heavy_lengths(n: int, seed: int = 0) -> np.ndarray:
    return lognormal_lengths(5.0, 1.0, n, seed, 1, 4096)


def test_it_balances_flops_not_the_cost_model():
    lengths = heavy_lengths(512)
    a = partition(np.ones(512), 8, strategy="flops_kk", lengths=lengths)
    b = partition(np.random.default_rng(1).random(512), 8, strategy="flops_kk", lengths=lengths)
    assert np.array_equal(a.rank, b.rank)  # the costs given are only used to report loads
    flops = partition(flop_costs(lengths, 64), 8, strategy="flops_kk", lengths=lengths)
    assert np.array_equal(a.rank, flops.rank)
    assert flops.gap < 0.05  # on its own objective it is a good partition (1.4% above the bound here)
    assert list(a.counts) == [64] * 8  # equal counts without being asked


def test_the_width_sets_the_ratio_of_the_linear_to_the_quadratic_term():
    assert flop_costs(np.array([100]), 64)[0] == 100 * 100 + 2.5 * 64 * 100
    lengths = heavy_lengths(256, seed=3)
    narrow = partition(np.ones(256), 4, strategy="flops_kk", lengths=lengths, flop_width=8)
    wide = partition(np.ones(256), 4, strategy="flops_kk", lengths=lengths, flop_width=4096)
    assert not np.array_equal(narrow.rank, wide.rank)


def test_kk_on_the_calibrated_cost_beats_it_when_samples_have_a_constant():
    """What the baseline misses: a per-sample constant (78% of a 50-long sample on the H200) and windows."""
    k, b, steps = 16, 32, 8
    lengths = heavy_lengths(k * b * steps, seed=5)
    costs = CostModel(kind="quadratic", a=1.0, b=160.0, c=40_000.0).predict(lengths)
    bubbles = {
        "contiguous": plan(costs, k, b, strategy="contiguous", lengths=lengths).bubble,
        "flops_kk": plan(costs, k, b, strategy="flops_kk", lengths=lengths).bubble,
        "kk": plan(costs, k, b, strategy="kk", lengths=lengths).bubble,
        "kk, window": plan(costs, k, b, strategy="kk", lengths=lengths, window_steps=steps).bubble,
    }
    assert bubbles["flops_kk"] < bubbles["contiguous"]
    assert bubbles["kk"] < bubbles["flops_kk"]
    assert bubbles["kk, window"] < bubbles["kk"]


@pytest.mark.parametrize("kwargs, message", [
    ({"window_steps": 4}, "window_steps must be 1, got 4"),
    ({"token_cap": 10_000}, "takes no token_cap"),
    ({"lengths": None}, "needs lengths"),
    ({"flop_width": 0}, "flop_width must be an integer >= 1"),
])
def test_what_it_refuses(kwargs, message):
    lengths = heavy_lengths(64)
    args = {"lengths": lengths, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan(np.ones(64), 2, 16, strategy="flops_kk", **args)


def test_simulate_runs_it_with_one_step_windows(capsys, fresh_log):
    from freescale.jobs import simulate

    assert simulate.main(["--lengths", "lognormal:4.5,1.0", "--strategy", "flops_kk", "--world-sizes", "4",
                          "--steps", "2", "--tracking-uri", "none"]) == 0
    assert "| 4 | balanced |" in capsys.readouterr().out
    assert simulate.main(["--lengths", "lognormal:4.5,1.0", "--strategy", "flops_kk", "--window-steps", "2",
                          "--tracking-uri", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["freescale simulate: error: strategy flops_kk balances each global batch alone: "
                   "--window-steps must be 1, got 2"]
