"""balancing runs inside Spark pandas UDFs and behind the balance job's argument parser: it must
stay light and self-contained, and name its strategies in one place."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = "{'pyspark', 'torch', 'pandas', 'pyarrow', 'ortools'}"


def heavy_modules_after(code: str) -> list[str]:
    """Top-level heavy packages loaded once `code` has run in a fresh interpreter."""
    probe = f"import sys; {code}; print(','.join(sorted({{m.split('.')[0] for m in sys.modules}} & {HEAVY})))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO)
    return [m for m in out.stdout.strip().split(",") if m]


@pytest.mark.spawns
def test_import_pulls_in_only_numpy() -> None:
    assert heavy_modules_after("from freescale import balancing") == []


@pytest.mark.spawns
def test_strategy_registry_loads_ortools_only_when_that_strategy_runs() -> None:
    # The balance job imports the registry for its --strategy choices before any Spark work.
    assert heavy_modules_after("from freescale.balancing.strategies import STRATEGIES") == []
    assert heavy_modules_after("from freescale.balancing import partition; partition([1.0, 2.0], 2, strategy='kk')") == []
    ran = "from freescale.balancing import partition; partition([1.0, 2.0, 3.0], 2, strategy='ortools', time_limit_s=0.1)"
    assert "ortools" in heavy_modules_after(ran)  # (OR-Tools itself brings pandas and pyarrow)


def test_one_list_of_strategies() -> None:
    from freescale import balancing
    from freescale.balancing.strategies import SOLVERS, STRATEGIES
    from freescale.jobs.balance import build_parser

    assert STRATEGIES == tuple(SOLVERS) and balancing.STRATEGIES is STRATEGIES
    (option,) = [a for a in build_parser()._actions if a.dest == "strategy"]
    assert tuple(option.choices) == STRATEGIES
