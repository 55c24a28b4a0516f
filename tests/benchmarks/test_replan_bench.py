"""benchmarks/replan_bench.py at toy sizes: its table comes out, one row per K'."""
from __future__ import annotations

from benchmarks import replan_bench


def test_smoke_prints_a_row_per_world_size(capsys) -> None:
    assert replan_bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 16 -> ")]
    assert [row.split("|")[1].strip() for row in rows] == ["16 -> 12", "16 -> 20"]
    assert all(int(row.split("|")[2].replace(",", "")) > 0 for row in rows)  # samples re-planned
