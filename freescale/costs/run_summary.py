"""The run summary, the file `freescale train --summary-json` writes (rank 0, freescale/jobs/train.py), as
freescale/shards/schema.py is the shards' format. compare reads it per training, simulate
(freescale/balancing/time_model.py) fits its time model on its timings, and the benchmarks read its summary.

    {"summary": {metric: value},           loss, step_time_s, bubble_fraction, hr_at_10, ...
     "mlflow_run_id": str | null,
     "losses": [...], "steps": [...],      per logged step
     "comm": {...}, "comm_issue_order": [...],
     "cost_model": {...},                  the shards' cost model: the unit of the timings' cost column
     "timings": {"fields": [...], "file": "NAME.timings.parquet"}}

The per-step, per-rank timing table is a Parquet file beside the summary (``timings.file``, relative
to the summary's folder; freescale/costs/run_timings.py); a summary may instead carry the table
itself (``timings.steps_ranks_fields``, ``[steps, ranks, fields]``: summaries written before the
file, and small hand-made ones). ``timing_table`` reads either.

Standard library only but ``timing_table`` (NumPy, and pyarrow for the file).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freescale.runtime.errors import InputError

if TYPE_CHECKING:
    from freescale.costs.run_timings import TableColumns, TimingColumns

WHAT = "run summary (freescale train --summary-json)"


def timings_beside(path: str | Path) -> Path:
    """Where the timing file of the summary at ``path`` goes: ``run.json`` -> ``run.timings.parquet``."""
    return Path(path).with_suffix(".timings.parquet")


def write_run_summary(path: str | Path, *, summary: dict[str, float], run_id: str | None, losses: list,
                      steps: list, comm: Any, comm_issue_order: Any, cost_model: Any, fields: list[str],
                      timings_file: Path | None) -> None:
    """The summary at ``path``; ``timings_file`` (None: no step was timed) is named relative to its folder."""
    Path(path).write_text(json.dumps(
        {"summary": summary, "mlflow_run_id": run_id, "losses": losses, "steps": steps,
         "comm": comm, "comm_issue_order": comm_issue_order, "cost_model": cost_model,
         "timings": {"fields": list(fields),
                     "file": None if timings_file is None else _relative(timings_file, Path(path).parent)}},
        indent=1))


def _relative(file: Path, folder: Path) -> str:
    try:
        return str(file.resolve().relative_to(folder.resolve()))
    except ValueError:
        return str(file.resolve())


def read_run_summary(path: str | Path) -> dict[str, Any]:
    """A run summary, refused in one line naming the file when it is not one."""
    from freescale.runtime.json_files import read_json

    data = read_json(path, WHAT)
    if not isinstance(data, dict) or not isinstance(data.get("summary"), dict):
        raise InputError(f"{path}: not a {WHAT}: no 'summary' object")
    return data


def timing_table(data: dict[str, Any], path: str | Path) -> "TableColumns | TimingColumns":
    """The per-step, per-rank timings of the summary ``data`` read from ``path``, by field name
    (``column(name)``: ``[steps, ranks]``): its table, or its timing file. A summary with neither is
    refused in one line."""
    import numpy as np

    from freescale.costs.run_timings import TableColumns, TimingColumns

    try:
        section = data["timings"]
        fields = list(section["fields"])
        if "steps_ranks_fields" in section:
            return TableColumns(fields, section["steps_ranks_fields"])
        if not section.get("file"):  # no step was timed
            return TableColumns(fields, np.zeros((0, 0, len(fields))))
        return TimingColumns(Path(path).parent / section["file"])
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise InputError(f"{path}: its timings cannot be read ({type(exc).__name__}: {exc})") from None
