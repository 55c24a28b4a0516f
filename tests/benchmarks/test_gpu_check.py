"""benchmarks/gpu_check.sh: its parts' time budgets fit one device command (600 s at most)."""
from __future__ import annotations

import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def test_the_parts_budgets_fit_one_device_command():
    budgets = [int(seconds) for seconds in re.findall(r"^\s*timeout (\d+) ", SCRIPT.read_text(), flags=re.M)]
    assert len(budgets) == 5  # the graphs' tests, calibrate, virtual ranks, the kernel bench, the GPU tests
    assert sum(budgets) <= 600 - 10  # the rest: nvidia-smi and the version line
