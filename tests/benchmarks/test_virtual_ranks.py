"""benchmarks/virtual_ranks.py (issue 48's virtual ranks) rehearsed on CPU at toy sizes: the chain
both devices run -- `freescale calibrate` writes the cost model, the bench plans contiguous,
flops_kk, kk and the mirror control with it and times every rank's batch -- with nothing the GPU
machine lacks loaded."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.virtual_ranks import CONFIGS, PLANS, SMOKE  # standard library only at import
from tests.helpers import spawns

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
@spawns
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, str, list]:
    work = tmp_path_factory.mktemp("virtual_ranks")
    cost_model, output, rows = work / "cost_model.json", work / "virtual_ranks.md", work / "rows.json"
    calibrated = subprocess.run([sys.executable, "-m", "freescale.jobs.cli", "calibrate", "--output", str(cost_model),
                                 "--lengths", "4,8,16,24", "--repeats", "3", "--warmup", "1", "--held-out-batches", "0",
                                 "--device", "cpu", "--tracking-uri", "none", "--config", str(CONFIGS["cpu"]),
                                 *SMOKE.overrides], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert calibrated.returncode == 0, calibrated.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "benchmarks.virtual_ranks", "--smoke", "--cost-model",
                          str(cost_model), "--output", str(output), "--json", str(rows)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    return run, output.read_text() if output.exists() else "", json.loads(rows.read_text()) if rows.exists() else []


@pytest.mark.extended  # docs/testing.md
def test_smoke_run_plans_four_ways_and_prints_the_targets(smoke) -> None:
    run, written, _ = smoke
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
    # per case: removed share, kk vs control, kk vs flops_kk, and simulate's step time for each plan
    assert "## Targets (issue 48)" in written and written.count("n/a (smoke)") == 4 * (3 + len(PLANS))


@pytest.mark.extended  # docs/testing.md
def test_json_rows_name_every_plan_at_every_k(smoke) -> None:
    _, _, rows = smoke
    assert sorted({(r["ranks"], r["plan"]) for r in rows}) == sorted((k, p) for k in SMOKE.ranks for p in PLANS)
    assert len(rows) == 2 * len(SMOKE.ranks) * len(PLANS)
    for r in rows:
        assert 0.0 <= r["bubble_measured"] < 1.0 and r["step_s_measured"] > 0 and r["step_s_predicted"] > 0
        times = r["rank_s_measured"]  # every rank of every step timed; a step takes its slowest
        assert len(times) == SMOKE.steps[r["ranks"]] and all(len(step) == r["ranks"] for step in times)
        assert r["step_s_measured"] == pytest.approx(sum(map(max, times)) / len(times))
    # the control's ranks all computed one batch: simulate predicts it from that batch's cost and the noise alone
    control = [r for r in rows if r["plan"] == "control"]
    assert all(r["bubble_predicted"] <= max(c["bubble_predicted"] for c in rows if c["plan"] == "contiguous")
               for r in control)


def test_steps_is_checked_and_overrides_the_sizes_steps() -> None:
    from benchmarks.virtual_ranks import parse_args

    assert parse_args(["--device", "cpu", "--steps", "4"]).steps == 4
    assert parse_args(["--device", "cpu"]).steps is None
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--steps", "0"])
