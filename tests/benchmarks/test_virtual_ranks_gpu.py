"""benchmarks/virtual_ranks_gpu.py (issue 24's virtual ranks) rehearsed on CPU: the chain the GPU
machine runs -- `freescale calibrate` writes the cost model, the bench plans contiguous, flops_kk and
kk with it and times every rank's batch -- at toy sizes, with nothing the GPU machine lacks loaded."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.virtual_ranks_gpu import DEFAULT_CONFIG, SMOKE  # standard library only at import
from tests.helpers import spawns

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
@spawns
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    work = tmp_path_factory.mktemp("virtual_ranks")
    cost_model, output = work / "cost_model.json", work / "virtual_ranks.md"
    calibrated = subprocess.run([sys.executable, "-m", "freescale.jobs.cli", "calibrate", "--output", str(cost_model),
                                 "--lengths", "4,8,16,24", "--repeats", "3", "--warmup", "1", "--held-out-batches", "0",
                                 "--device", "cpu", "--tracking-uri", "none", "--config", str(DEFAULT_CONFIG),
                                 *SMOKE.overrides], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert calibrated.returncode == 0, calibrated.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "benchmarks.virtual_ranks_gpu", "--smoke", "--cost-model",
                          str(cost_model), "--output", str(output)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    return run, output.read_text() if output.exists() else ""


def test_smoke_run_plans_three_ways_and_prints_the_targets(smoke) -> None:
    run, written = smoke
    assert run.returncode == 0, run.stderr[-2000:]  # 1 when a module the GPU machine lacks was loaded
    assert written.strip() == run.stdout.strip()
    assert "SMOKE RUN on CPU" in written and "- cost model: freescale calibrate (" in written
    table = [line for line in written.splitlines() if line.startswith("| log-normal") or
             line.startswith("| MovieLens-100K")]
    # two length sets x K = 2, 4: each case printed when it finishes (a run cut short keeps it), then together
    assert len(table) == 8
    finished, together = written.split("## Measured")
    assert sum(line in finished for line in table[4:]) == 4 and written.index("- log-normal") < len(finished)
    assert all("nan" not in line for line in table)  # simulate predicted every plan from the seconds model
    assert "## Targets (issue 24)" in written and written.count("n/a (smoke)") == 12
