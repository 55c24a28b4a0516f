"""The fault sweep's judge and table of cases (tests/e2e/fault_sweep.py), without running a case: the
sweep itself takes about 16 minutes (`make fault-sweep`)."""
from __future__ import annotations

import signal
from pathlib import Path

from tests.e2e.fault_sweep import CASES, Case, Outcome, Sweep, judge


def _case(expect: str, output=None) -> Case:
    return Case("a case", expect, run=lambda s: Outcome(0, [], 0.0), output=lambda s: output)


def test_every_case_has_a_unique_name_and_a_known_target():
    names = [case.name for case in CASES]
    assert len(names) == len(set(names)) and len(names) > 40
    assert {case.expect for case in CASES} <= {"ok", "fail", "stopped"}


def test_a_failure_meets_its_target_with_exit_2_or_3_and_one_error_line(tmp_path):
    sweep = Sweep(tmp_path)
    line = ["freescale balance: error: --input x does not exist"]
    assert judge(sweep, _case("fail"), Outcome(2, line, 1.0), intact=True) == ""
    assert judge(sweep, _case("fail"), Outcome(1, line, 1.0), intact=True) == "exit 1"
    assert judge(sweep, _case("fail"), Outcome(2, ["Traceback", *line], 1.0), intact=True) == "2 stderr lines"
    assert judge(sweep, _case("fail"), Outcome(2, line, 1.0), intact=False) == "input changed"
    (tmp_path / "out").mkdir()
    assert judge(sweep, _case("fail", tmp_path / "out"), Outcome(3, line, 1.0), intact=True) == "left out"


def test_a_stop_meets_its_target_with_128_plus_sigterm():
    sweep = Sweep(Path("/nonexistent"))
    line = ["freescale pipeline: error: stopped by SIGTERM"]
    assert judge(sweep, _case("stopped"), Outcome(128 + signal.SIGTERM, line, 1.0), intact=True) == ""
    assert judge(sweep, _case("stopped"), Outcome(2, line, 1.0), intact=True) == "exit 2"
