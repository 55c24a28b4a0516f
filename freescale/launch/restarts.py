"""Restarts after a failure (`freescale train --max-restarts N`): torchrun starts this node's ranks
again, which resume from the newest complete checkpoint (freescale/training/checkpoint/resume.py).

Between one attempt and the next, two notes in the folder the launcher gives its ranks for their
exit statuses (freescale.runtime.job_errors.STATUS_DIR_ENV), which lives as long as torchrun: what failed
(the launcher writes it from torchrun's report of the attempt's failure), and rank 0's MLflow run,
which the next attempt continues even where no checkpoint holds it yet (a failure before the first).

Standard library only: the launcher's process reads it too.
"""
from __future__ import annotations

import os
from pathlib import Path

# torchelastic's names for a rank's attempt: the restarts so far, and the most it makes.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
FAILURE_NOTE = "last-failure"
RUN_NOTE = "mlflow-run"


def restart_count() -> int:
    """How many times torchrun has restarted this node's ranks before this attempt (0 for the first,
    and outside torchrun)."""
    try:
        return int(os.environ.get(RESTART_COUNT_ENV, "0"))
    except ValueError:
        return 0


def _note(name: str) -> Path | None:
    from freescale.runtime.job_errors import STATUS_DIR_ENV

    folder = os.environ.get(STATUS_DIR_ENV)
    return Path(folder) / name if folder else None


def write_note(name: str, text: str, folder: str | Path | None = None) -> None:
    """Leave `text` for the next attempt (in `folder`, or this rank's status folder); nothing outside
    `freescale train`. A note that cannot be written leaves the next attempt less to say, no more."""
    path = Path(folder) / name if folder is not None else _note(name)
    if path is None:
        return
    try:
        path.write_text(text)
    except OSError:
        pass


def read_note(name: str) -> str:
    """The note an earlier attempt left; empty when there is none."""
    path = _note(name)
    try:
        return path.read_text().strip() if path is not None else ""
    except OSError:
        return ""


def restart_line(resumed_from: str) -> str | None:
    """Rank 0's line for a restarted attempt (None for the first): which restart, after what failure,
    and where the training resumes (`resumed_from`: a checkpoint folder, or step 0)."""
    count = restart_count()
    if count == 0:
        return None
    most = os.environ.get(MAX_RESTARTS_ENV, "?")
    failed = read_note(FAILURE_NOTE) or "a failure"
    return f"freescale train: restart {count} of {most} after {failed}: resuming from {resumed_from}"
