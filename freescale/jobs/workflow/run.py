"""`freescale pipeline --config FILE.toml`: prepare, calibrate, balance, train [, compare, export, recommend] from one
TOML, safe to rerun from cron, Airflow or any scheduler.

    freescale pipeline --config configs/demo_pipeline.toml [--fresh] [--section.key VALUE ...]

Each stage calls its job in-process, each still runnable by itself, through its typed entry
(`freescale.jobs.prepare.run`, `freescale.jobs.calibrate.run`, `freescale.jobs.balance.run`, `freescale.jobs.launch.run`, `freescale.jobs.compare.run`,
`freescale.jobs.export.run`, `freescale.jobs.recommend.run`, each with the spec built from its section).
A stage that finishes leaves a record next to its output in the working directory,
`<workdir>/<stage>.fingerprint.json`: the fingerprint of everything the stage's arguments are
built from (its config section, the shared sizes, the identity of its input files: the
size and modification time of each local file), of its upstream stages' fingerprints, and
those values themselves, so a rerun can say what changed. A rerun skips a stage whose
fingerprint matches and whose output is intact; it redoes a stage whose parameters or input
changed or whose output is damaged, and everything downstream of a stage that ran. The train
stage continues from its checkpoints when its last run stopped before finishing, and starts
over (its checkpoints removed) otherwise: never into shards that were rebuilt.

The engine (records, fingerprints, skip or run, stale downstream records) is freescale/jobs/workflow/stages.py;
the stages, one record each (how each builds its job's arguments, calls its job and checks its
output), are freescale/jobs/workflow/table.py; this module runs them. The config's sections and
keys are the dataclasses in freescale/jobs/workflow/config.py.
`<workdir>/LOCK` (host, PID) keeps a second run off the working directory. Exit status: 0
done (or nothing to do); 2 bad config (one line naming the key); 3 the working directory is
in use by another run (retry later: nothing is wrong with the config); 128 + N stopped by
signal N; otherwise the failed stage's own status.

A stop signal (SIGTERM from a scheduler, Ctrl-C) ends the running stage as its job ends on one:
its MLflow run KILLED, its staging folder removed; the stage's record says ``killed`` and the
lock is released. A run killed with no chance to clean up (kill -9) leaves its stage's MLflow
run RUNNING: every stage's run carries the working directory (``freescale.pipeline``), and the
next run of the pipeline, holding the lock, ends such runs FAILED before its stages start.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from freescale.jobs.workflow.config import WorkflowConfig, load_workflow_config
from freescale.jobs.workflow.table import build_stages, tracking_of
from freescale.runtime import locks
from freescale.runtime.json_files import write_json
from freescale.jobs.workflow.stages import LOCK, Stage, read_record, record_path, run_stages
from freescale.prepare.prepare_spec import synthetic_text  # standard library only

# ------------------------------------------------------------------------------ the run


class _ErrorLineTap:
    """sys.stderr, remembering the last ``freescale JOB: error: MESSAGE`` line a stage wrote (its
    message; ``details``: whether it named the log, which is the pipeline's own: stages run in-process)."""

    LINE = re.compile(r"^freescale [^:\n]+: error: ([^\n]*?)( \(details: [^\n]*\))?$", re.M)

    def __init__(self, stream):
        self.stream, self.last, self.details = stream, "", False

    def write(self, text: str) -> int:
        for match in self.LINE.finditer(text):
            self.last, self.details = match.group(1), bool(match.group(2))
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def run_stage(stage: Stage, work: Path) -> tuple[int, str, bool]:
    """The stage job's exit status, its error message (empty when it succeeded) and whether the log
    holds details. A stop signal ends the job as it would end it alone (its run KILLED, its staging
    removed), then the stage's record says so and the stop goes on to end the pipeline: whatever
    error the job's cleanup raised in its place, and however the job ended after it (stop_of)."""
    from freescale.runtime.job_errors import report
    from freescale.runtime.stops import Stopped, stop_of, stop_signal

    tap, saved = _ErrorLineTap(sys.stderr), sys.stderr
    sys.stderr = tap
    try:
        rc = stage.run()
    except SystemExit as exc:  # argparse inside the job
        rc = exc.code if isinstance(exc.code, int) else 2
    except BaseException as exc:
        signum = stop_of(exc)
        if signum is None:
            if not isinstance(exc, Exception):
                raise
            rc = report(stage.name, exc)  # a job that does not end in run_job: one line, its status
        else:
            _record_killed(stage, work, signum)
            if isinstance(exc, (Stopped, KeyboardInterrupt)):
                exc.stage = stage.name  # for the pipeline's last line
                raise
            raise _stop_in(stage, signum) from exc
    finally:
        sys.stderr = saved
    signum = stop_signal()
    if signum is not None:  # the job returned after the stop (with its own line, or even done)
        _record_killed(stage, work, signum)
        raise _stop_in(stage, signum)
    return rc, (tap.last if rc else ""), bool(rc) and tap.details


def _record_killed(stage: Stage, work: Path, signum: int) -> None:
    record = read_record(work, stage.name) or {}
    write_json(record_path(work, stage.name), {**record, "status": "killed", "why": f"stopped by signal {signum}"})


def _stop_in(stage: Stage, signum: int) -> BaseException:
    """The stop, naming the stage for the pipeline's last line."""
    from freescale.runtime.stops import Stopped

    stopped = Stopped(signum)
    stopped.stage = stage.name
    return stopped


def run_days(config: WorkflowConfig, fresh: bool, say) -> tuple[list[str], Any]:
    """Incremental mode (freescale/jobs/workflow/days.py): each day's stages in its own working directory,
    on top of the day before's; a day's first stage to run opens its MLflow run, after ending the runs a
    killed run of that day left RUNNING."""
    from freescale.jobs.workflow import days

    days.check_incremental(config)

    def run_day(day_config: WorkflowConfig, previous, open_day_run):
        work = Path(day_config.pipeline.workdir)

        def run_one(stage: Stage):
            if open_day_run.run is None:
                _end_orphaned_runs(day_config, str(work.resolve()))
                open_day_run()
            return run_stage(stage, work)
        return run_stages(build_stages(day_config, previous), work, fresh, run_one, say)
    return days.run_days(config, run_day, say, fresh)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale pipeline", description=__doc__.split("\n\n")[0],
                                epilog="Other --section.key VALUE arguments override the config file "
                                       "(e.g. --balance.window_steps 32, --train.overrides.training.max_steps 20).")
    p.add_argument("--config", required=True, help="pipeline TOML ([pipeline], [prepare], [calibrate], [balance], "
                                                    "[train], [compare])")
    p.add_argument("--fresh", action="store_true", help="rerun every stage, whatever the records say")
    return p


def main(argv: list[str]) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    return run(load_workflow_config(args.config, overrides), fresh=args.fresh)  # a bad key or value: one line


def run(config: WorkflowConfig, fresh: bool = False) -> int:
    """The pipeline of ``config``, holding its workdir's lock (exit 3 when another run holds it); its
    exit status. `freescale demo` calls it with the shipped config."""
    from freescale.runtime.job_errors import EXIT_ENVIRONMENT, error_line
    from freescale.runtime.stops import stop_of, stops_on_signals
    from freescale.tracking.runs import PIPELINE_ENV

    work = Path(config.pipeline.workdir)
    lock = work / LOCK
    refused = locks.acquire(lock, on_stale=lambda holder: print(
        f"freescale pipeline: note: {work}: taking over the stale lock of {holder} (that process is gone)",
        file=sys.stderr, flush=True))
    if refused is not None:
        holder = refused.holder or {}
        who = f"PID {holder.get('pid')} on {holder.get('host')}" if holder else "another run"
        error_line("pipeline", f"workdir {work} is in use by {who} (lock {lock}): wait for that run, or use "
                               "another [pipeline] workdir" + ("; if that run is gone, remove the lock"
                                                              if refused.reason == "other_host" else ""),
                   details=False)
        return EXIT_ENVIRONMENT
    saved_env = os.environ.get(PIPELINE_ENV)
    os.environ[PIPELINE_ENV] = str(work.resolve())  # every stage's run names this workdir
    try:
        # SIGTERM (a scheduler's stop) raises in the main thread, as Ctrl-C does, so the running stage,
        # the records and the lock are ended on the way out (freescale/runtime/stops.py: stops_on_signals).
        with stops_on_signals():
            try:
                _end_orphaned_runs(config, os.environ[PIPELINE_ENV])
                return run_pipeline(config, work, fresh=fresh)
            except BaseException as exc:
                if stop_of(exc) is None:
                    raise
                return _stopped_status(exc)
    finally:
        locks.release(lock)
        if saved_env is None:
            os.environ.pop(PIPELINE_ENV, None)
        else:
            os.environ[PIPELINE_ENV] = saved_env


def _end_orphaned_runs(config: WorkflowConfig, workdir: str) -> None:
    """End FAILED the MLflow runs a killed run of this workdir left RUNNING; one note line, or one
    warning when that fails (tracking never stops the pipeline)."""
    from freescale.tracking.runs import fail_orphaned_runs

    try:
        orphans = fail_orphaned_runs(tracking_of(config).resolved_uri(), workdir)
    except Exception as exc:  # noqa: BLE001 - tracking never stops the pipeline
        from freescale.tracking.runs import failure

        print(f"freescale pipeline: warning: could not end the MLflow runs a killed run left RUNNING "
              f"({failure(exc)})", file=sys.stderr, flush=True)
        return
    if orphans:
        print(f"freescale pipeline: note: {len(orphans)} MLflow run(s) of a killed run of this workdir "
              f"were still RUNNING: ended FAILED ({', '.join(orphans)})", file=sys.stderr, flush=True)


def _stopped_status(exc: BaseException) -> int:
    """The pipeline's last line and 128 + N for `exc`, which is (or surfaced after) stop signal N."""
    from freescale.runtime.job_errors import error_line
    from freescale.runtime.stops import stop_of

    signum = stop_of(exc)
    stage = getattr(exc, "stage", None)
    error_line("pipeline", f"stopped by signal {signum}" + (
        f" in stage {stage}: its MLflow run ended KILLED, its output left as it was, its record says killed"
        if stage else ""), details=False)
    return 128 + signum


def run_pipeline(config: WorkflowConfig, work: Path, fresh: bool) -> int:
    from freescale.runtime.job_errors import error_line

    started = time.perf_counter()
    lines: list[str] = []

    def say(text: str) -> None:
        lines.append(text)
        print(text, flush=True)

    if config.pipeline.incremental:
        ran, failed = run_days(config, fresh, say)
    else:
        if not config.prepare.input:  # the default: say it, so nobody takes the results for their data's
            p = config.prepare
            say(f"freescale pipeline: prepare   uses synthetic data ([prepare] has no input: {synthetic_text(p)})")
        ran, failed = run_stages(build_stages(config), work, fresh, lambda stage: run_stage(stage, work), say)
    print(f"freescale pipeline: summary of {config.pipeline.workdir}:", flush=True)
    for text in lines:
        print(text, flush=True)
    if failed is not None:
        error_line("pipeline", f"stage {failed.stage} failed (exit {failed.code}"
                               + (f": {failed.error})" if failed.error else ")"), details=failed.details)
        return failed.code
    print(f"freescale pipeline: done in {time.perf_counter() - started:.0f} s: {len(ran)} stage(s) ran; "
          f"records in {work}", flush=True)
    return 0

