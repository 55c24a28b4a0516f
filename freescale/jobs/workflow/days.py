"""Incremental mode of `freescale pipeline` (``[pipeline] incremental = true``): daily training over a
folder of day partitions, each day on top of the one before.

    <input>/2026-12-01/  (or day=2026-12-01/, or a file per day)   a day's new logs
    <workdir>/days/<day>/                                           that day's pipeline working directory

Each day is the pipeline's stages in its own working directory, as a plain run has them, with the day
before as their starting point: prepare reads only the day's logs on top of the previous day's
prepared output (``prepare --previous``: items keep their ids, returning users continue their
sequences, only the users the day touched are written), balance plans those samples, train starts from
the previous day's newest checkpoint (``--init-from``), export registers the model ([export] register),
and promote moves the alias when the new version is not worse (freescale/jobs/workflow/promote.py).
A day that was promoted is final: later runs keep it as it is, whatever the config says now (a setting
changed today applies from today on; ``--fresh`` redoes every day). A day that did not finish runs
its stages as any pipeline run does, skipping the current ones; the previous day's prepare and train
fingerprints are part of its own.

Every day that runs is one MLflow parent run (``day <name>``, with the day's logs as its dataset
input); the runs of its stages, the training's included, nest under it. Days are listed in name
order: name them so that it is time order (ISO dates).
"""
from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from freescale.jobs.workflow.config import WorkflowConfig
from freescale.runtime.errors import InputError

DAYS = "days"
DAY_PREFIX = "day="


@dataclass(frozen=True)
class Day:
    name: str
    path: Path


def day_partitions(folder: str) -> list[Day]:
    """The day partitions of ``folder``: its entries in name order (hidden and ``_`` ones left out); a
    file's day is its name without suffix, ``day=`` prefixes dropped."""
    root = Path(folder)
    if not folder or not root.is_dir():
        raise InputError(f"[prepare] input {folder or '(none)'}: incremental mode needs a local folder of day "
                         "partitions (a subfolder or file per day)")
    entries = sorted(p for p in root.iterdir() if not p.name.startswith((".", "_")))
    days = [Day((p.stem if p.is_file() else p.name).removeprefix(DAY_PREFIX), p) for p in entries]
    if not days:
        raise InputError(f"[prepare] input {root}: no day partitions in it")
    seen: dict[str, Path] = {}
    for day in days:
        if day.name in seen:
            raise InputError(f"[prepare] input {root}: {seen[day.name].name} and {day.path.name} are both day "
                             f"{day.name}")
        seen[day.name] = day.path
    return days


def day_config(config: WorkflowConfig, day: Day) -> WorkflowConfig:
    """The pipeline config of one day: its own working directory and input, exported."""
    found = copy.deepcopy(config)
    found.pipeline.workdir = str(Path(config.pipeline.workdir) / DAYS / day.name)
    found.prepare.input = str(day.path)
    found.export.enabled = True
    return found


def check_incremental(config: WorkflowConfig) -> None:
    """What incremental mode needs of the config, before any day runs (one line naming the key)."""
    if not config.export.register:
        raise InputError("[pipeline] incremental = true needs [export] register = NAME: each day's model is "
                         "registered, and [promote] alias points at the one to serve")
    if config.compare.enabled:
        raise InputError("[pipeline] incremental = true: [compare] is not run per day; set [compare] enabled = false")
    day_partitions(config.prepare.input)


def run_days(config: WorkflowConfig, run_day: Callable, say: Callable[[str], None],
             fresh: bool = False) -> tuple[list[str], object]:
    """Each day in order, ``run_day(day_config, previous_workdir, opener)`` running its stages (``opener``:
    called before the day's first stage runs, it opens the day's MLflow run); stops at the first day that
    fails. A day that was promoted is final (``--fresh`` redoes every day). Returns the ``day/stage`` names
    that ran and the failure (None: none)."""
    from freescale.jobs.workflow.stages import read_record
    from freescale.jobs.workflow.table import Workdir

    ran_all: list[str] = []
    previous = None
    for day in day_partitions(config.prepare.input):
        cfg = day_config(config, day)
        work = Path(cfg.pipeline.workdir)
        if not fresh and (read_record(work, "promote") or {}).get("status") == "done":
            # Yesterday's model is what was served: a config changed today applies from today on.
            say(f"freescale pipeline: day {day.name} done: kept as it is ({work / 'promotion.json'})")
            previous = Workdir(work)
            continue
        say(f"freescale pipeline: day {day.name} ({day.path})")
        with day_run(cfg, day) as opener:
            ran, failed = run_day(cfg, previous, opener)
            opener.failed = failed is not None
        ran_all += [f"{day.name}/{name}" for name in ran]
        if failed is not None:
            return ran_all, failed
        previous = Workdir(Path(cfg.pipeline.workdir))
    return ran_all, None


class DayRun:
    """The day's MLflow parent run, opened when its first stage is about to run (a day with nothing to
    do opens none)."""

    def __init__(self, config: WorkflowConfig, day: Day):
        self.config, self.day = config, day
        self.run = None
        self.failed = False

    def __call__(self) -> None:
        if self.run is not None:
            return
        from freescale.jobs.workflow.table import tracking_of
        from freescale.tracking.datasets import DataRef
        from freescale.tracking.runs import PARENT_ENV, JobRun

        tracking = tracking_of(self.config)
        run = JobRun("pipeline", tracking.reachable_uri("pipeline"))
        run.start(tracking.experiment, f"day {self.day.name}", {"freescale.day": self.day.name}, None)
        run.log_inputs({"day": DataRef.logs({"kind": "file", "uri": str(self.day.path.resolve()),
                                             "day": self.day.name})})
        self.run = run
        if run.run_id:
            os.environ[PARENT_ENV] = run.run_id


@contextmanager
def day_run(config: WorkflowConfig, day: Day) -> Iterator[DayRun]:
    """The day's stages run with PIPELINE_ENV naming its working directory; its parent run (if one was
    opened) ends FINISHED, FAILED or KILLED with them."""
    from freescale.tracking.runs import PARENT_ENV, PIPELINE_ENV, ended_status

    saved = {name: os.environ.get(name) for name in (PIPELINE_ENV, PARENT_ENV)}
    os.environ[PIPELINE_ENV] = str(Path(config.pipeline.workdir).resolve())
    opener = DayRun(config, day)
    try:
        yield opener
    except BaseException as exc:
        if opener.run is not None:
            opener.run.end(ended_status(exc))
        raise
    else:
        if opener.run is not None:
            opener.run.end("FAILED" if opener.failed else "FINISHED")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
