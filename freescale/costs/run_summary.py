"""The run summary, the file `freescale train --summary-json` writes (rank 0, freescale/jobs/train.py), as
freescale/shards/schema.py is the shards' format. compare reads it per training, simulate
(freescale/balancing/time_model.py) fits its time model on its timings, and the benchmarks read its summary.

    {"summary": {metric: value},           loss, step_time_s, bubble_fraction, hr_at_10, ...
     "mlflow_run_id": str | null,
     "losses": [...], "steps": [...],      per logged step
     "comm": {...}, "comm_issue_order": [...],
     "cost_model": {...},                  the shards' cost model: the unit of the timings' cost column
     "timings": {"fields": [...], "steps_ranks_fields": [[[...]]]}}

Standard library only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from freescale.runtime.errors import InputError

WHAT = "run summary (freescale train --summary-json)"


def write_run_summary(path: str | Path, *, summary: dict[str, float], run_id: str | None, losses: list,
                      steps: list, comm: Any, comm_issue_order: Any, cost_model: Any, fields: list[str],
                      timings: list) -> None:
    Path(path).write_text(json.dumps(
        {"summary": summary, "mlflow_run_id": run_id, "losses": losses, "steps": steps,
         "comm": comm, "comm_issue_order": comm_issue_order, "cost_model": cost_model,
         "timings": {"fields": list(fields), "steps_ranks_fields": timings}}, indent=1))


def read_run_summary(path: str | Path) -> dict[str, Any]:
    """A run summary, refused in one line naming the file when it is not one."""
    from freescale.runtime.json_files import read_json

    data = read_json(path, WHAT)
    if not isinstance(data, dict) or not isinstance(data.get("summary"), dict):
        raise InputError(f"{path}: not a {WHAT}: no 'summary' object")
    return data


def timings(data: dict[str, Any]) -> tuple[list[str], list]:
    """The per-step, per-rank timings: their field names and the [steps, ranks, fields] table."""
    return list(data["timings"]["fields"]), data["timings"]["steps_ranks_fields"]
