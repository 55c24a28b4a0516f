"""The StepTimer's names as ``torch.profiler`` ranges: a profiled 3-step training (one rank in this
process, on hand-written shards) shows each step's phases once per step, inside its step, and
computes the same losses as an unprofiled one."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.helpers import in_process_args, train_in_process, write_shards
from freescale.training.timing import step_timer
from freescale.training.timing.bubbles import StepTiming
from freescale.training.timing.step_timer import StepTimer

STEPS = 3
PASSES = ("forward", "backward")
"""StepTimer.model_pass's names; every other range is a StepTiming field."""

# The ranges each comm mode's 3 steps enter. An overlapped step waits for the next step's batch
# (the first also for its own), and the last one's wait finds none: 4 data waits.
EXPECTED = {
    "plain": {"step_s": 3, "data_wait_s": 3, "forward": 3, "backward": 3, "allreduce_s": 3, "optimizer_s": 3},
    "prioritized": {"step_s": 3, "data_wait_s": 4, "sparse_forward_s": 3, "forward": 3, "backward": 3,
                    "sparse_backward_s": 3, "allreduce_s": 3, "optimizer_s": 3},
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_shards(tmp_path_factory.mktemp("profiled") / "shards", world_size=1, num_steps=STEPS)


def train(shards: Path, mode: str, summary: Path) -> list[float]:
    """One rank's 3 steps in this process; its per-step losses."""
    assert train_in_process(*in_process_args(shards, "--training.max_steps", str(STEPS), "--comm.mode", mode,
                                             "--training.eval_max_samples", "0", "--summary-json", str(summary))) == 0
    return json.loads(summary.read_text())["losses"]


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_a_profiled_run_shows_each_steps_phases(shards, tmp_path, mode):
    unprofiled = train(shards, mode, tmp_path / "unprofiled.json")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = train(shards, mode, tmp_path / "profiled.json")
    assert profiled == unprofiled  # to the bit: the ranges change no number
    prof.export_chrome_trace(str(tmp_path / "trace.json"))

    names = {f.name for f in fields(StepTiming)} | set(PASSES)
    ranges = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("name") in names]
    assert Counter(e["name"] for e in ranges) == EXPECTED[mode]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"] == "step_s")
    assert all(end <= next_start for (_, end), (next_start, _) in zip(steps, steps[1:]))
    for e in ranges:  # every phase inside one of the steps
        assert any(start <= e["ts"] and e["ts"] + e["dur"] <= end for start, end in steps), e["name"]


def test_no_range_is_opened_without_a_profiler(monkeypatch):
    def opened(name: str):
        raise AssertionError(f"range {name} opened with no profiler running")

    monkeypatch.setattr(step_timer, "record_function", opened)
    assert not torch.autograd._profiler_enabled()
    timer = StepTimer()
    with timer.phase("data_wait_s"):
        pass
    with timer.model_pass("forward"):
        pass
    with timer.model_pass("backward"):
        pass
    timer.close_blocking()
