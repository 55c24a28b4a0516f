"""Epochs on 2 ranks (tests/scenarios.py ``epochs_run``): every epoch trains the plan's steps, each step
whole on the ranks its plan gave it, in a new order after the first; a checkpoint taken mid-epoch
resumes the same order; the checkpoint folder keeps the last ``keep_last`` checkpoints."""
from __future__ import annotations

import numpy as np
import pytest

from freescale.shards.step_order import epoch_order
from tests.scenarios import EPOCH_STEPS

pytestmark = pytest.mark.slow


def per_step(log: dict, field: str = "cost") -> np.ndarray:
    """[steps, ranks] of a timings field: by default the plan's cost of what each rank trained at each
    step of the run."""
    fields = log["timings"]["fields"]
    return np.asarray(log["timings"]["steps_ranks_fields"])[:, :, fields.index(field)]


def test_the_second_epoch_trains_the_first_ones_steps_in_another_order(epochs_run):
    log = epochs_run.log
    assert log["steps"] == list(range(2 * EPOCH_STEPS))
    costs, samples = per_step(log), per_step(log, "samples")
    first, second = costs[:EPOCH_STEPS], costs[EPOCH_STEPS:]
    # the first epoch is the plan's order: the short last step (2 + 1 samples) is last; every sample
    # is trained once per epoch
    assert samples[EPOCH_STEPS - 1].tolist() == [2, 1] and (samples[:EPOCH_STEPS - 1].sum(axis=1) == 8).all()
    assert samples[EPOCH_STEPS:].sum() == samples[:EPOCH_STEPS].sum() == 7 * 8 + 3
    # the second is the seeded permutation of whole steps: each position holds one plan step's costs on
    # every rank
    order = epoch_order(EPOCH_STEPS, 1, 0, 1)  # training.seed 0, the default
    np.testing.assert_array_equal(second, first[order])
    changed = np.mean(np.any(second != first, axis=1))
    assert changed >= 0.5, changed
    assert second.sum() == pytest.approx(first.sum(), rel=0.05)
    # every step keeps its balance: the mean max/mean rank cost does not grow
    def imbalance(block: np.ndarray) -> float:
        return float(np.mean(block.max(axis=1) / block.mean(axis=1)))
    assert imbalance(second) <= imbalance(first) + 1e-9


def test_a_checkpoint_mid_epoch_resumes_the_same_order(epochs_run):
    resumed, log = epochs_run.resumed, epochs_run.log
    assert resumed["steps"] == list(range(12, 2 * EPOCH_STEPS))
    np.testing.assert_array_equal(per_step(resumed), per_step(log)[12:])
    assert resumed["losses"] == log["losses"][12:]  # to the bit


def test_the_folder_keeps_the_last_two_checkpoints(epochs_run):
    # saved at steps 4, 8, 12 and 16 (the end) with keep_last 2
    assert sorted(p.name for p in epochs_run.folder.iterdir() if p.name != "LOCK") == ["step_12", "step_16"]
    assert all((epochs_run.folder / name / "COMPLETE").exists() for name in ("step_12", "step_16"))
