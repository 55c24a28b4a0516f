"""MLflow records of the jobs: one run per job invocation, open while the job works (parameters,
statistics, artifacts), and the tags that line up the runs of one `freescale compare`."""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

from freescale.runtime.errors import one_line
from freescale.tracking.datasets import DataRef, log_datasets
from freescale.tracking.store import DISABLED, find_or_create_experiment, unreachable_reason, unwritable_store_reason


def code_version() -> str:
    """The git commit of the checkout the job runs from, or 'unknown' outside one."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# Tags every run of a comparison carries, so runs line up in MLflow whichever job made them.
STRATEGY_TAG, CONTROL_TAG, COMPARISON_TAG = "freescale.strategy", "freescale.control", "freescale.comparison"


PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a run under that run


# The run a job's run nests under when the job names none: an incremental pipeline's day run, set for
# the day's stages (in-process jobs, and the ranks they start).
PARENT_ENV = "FREESCALE_PARENT_RUN_ID"


def inherited_parent(parent_run_id: str | None) -> str | None:
    """``parent_run_id``, else the one PARENT_ENV names, else None."""
    return parent_run_id or os.environ.get(PARENT_ENV) or None


# The working directory of the `freescale pipeline` whose stage made a run: the pipeline sets
# PIPELINE_ENV for its stages (in-process jobs, and the ranks and trainings they start), and a
# later run of that pipeline finds the runs a killed one left RUNNING by it.
PIPELINE_TAG, PIPELINE_ENV = "freescale.pipeline", "FREESCALE_PIPELINE_WORKDIR"


# The output a job writes: a later run of the same job to the same output ends the run a killed one
# left RUNNING (one run per output at a time, the assumption its staging folder's removal makes).
OUTPUT_TAG = "freescale.output"


PARAMS_PER_REQUEST = 90  # under MLflow's cap of params per log_batch


NOTE_TAG = "mlflow.note.content"  # a run's description on its page (Markdown)


def run_tags(strategy: str | None = None, control: str | None = None, comparison: str | None = None) -> dict[str, str]:
    """The comparison tags of a run: its strategy, its control (``none`` when it has a strategy
    but no control) and the comparison it belongs to; absent values are left out. Under
    `freescale pipeline`, also the pipeline's working directory."""
    tags = {PIPELINE_TAG: os.environ[PIPELINE_ENV]} if os.environ.get(PIPELINE_ENV) else {}
    if strategy:
        tags[STRATEGY_TAG] = strategy
        tags[CONTROL_TAG] = control or "none"
    if comparison:
        tags[COMPARISON_TAG] = comparison
    return tags


def ended_status(exc: BaseException | None) -> str:
    """How a run ends: FINISHED, KILLED (Ctrl-C, a stop signal, or any error once the job received
    one: freescale/runtime/stops.py, stop_of) or FAILED."""
    from freescale.runtime.stops import stop_of

    if exc is None:
        return "FINISHED"
    return "KILLED" if stop_of(exc) is not None else "FAILED"


class JobRun:
    """One job's MLflow run, opened when its work starts and ended when it ends.

    Every call is guarded: the first tracking error is one warning line and the rest of the
    job runs untracked (``run_id`` stays, ``active`` turns False). A disabled run does nothing.
    """

    def __init__(self, job: str, tracking_uri: str):
        self.job, self.uri = job, tracking_uri
        self.client = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None

    @property
    def active(self) -> bool:
        return self.client is not None

    def start(self, experiment: str, run_name: str, tags: Mapping[str, str], parent_run_id: str | None) -> None:
        if self.uri == DISABLED:
            return

        def create():
            from mlflow.tracking import MlflowClient
            from mlflow.tracking.context.registry import resolve_tags  # the user/source tags mlflow.start_run sets

            logging.getLogger("mlflow").setLevel(logging.WARNING)
            # The client API, not mlflow's fluent one: no process-wide active run, no stdout.
            client = MlflowClient(self.uri)
            experiment_id = find_or_create_experiment(client, experiment)
            all_tags = {"freescale.job": self.job, "freescale.code_version": code_version(), **run_tags(), **tags}
            if inherited_parent(parent_run_id):
                all_tags[PARENT_TAG] = inherited_parent(parent_run_id)
            run = client.create_run(experiment_id, run_name=run_name, tags=resolve_tags(all_tags))
            self.client, self.run_id, self.experiment_id = client, run.info.run_id, experiment_id

        self._guarded("opening the run", create, always=True)

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [(k, _param_value(v)) for k, v in params.items()]

        def send():
            from mlflow.entities import Param

            for first in range(0, len(items), PARAMS_PER_REQUEST):
                self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in
                                                           items[first:first + PARAMS_PER_REQUEST]])
        self._guarded("logging params", send)

    def log_metrics(self, metrics: Mapping[str, float | None]) -> None:
        """Finite values only: a missing or NaN statistic is left out, not recorded as one."""
        def send():
            import math
            import time

            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            values = [Metric(k, float(v), now, 0) for k, v in metrics.items()
                      if v is not None and math.isfinite(float(v))]
            for first in range(0, len(values), 1000):  # MLflow's cap of metrics per log_batch
                self.client.log_batch(self.run_id, metrics=values[first:first + 1000])
        self._guarded("logging metrics", send)

    def set_tags(self, tags: Mapping[str, str], run_id: str | None = None) -> None:
        """Tags on this run, or on ``run_id`` (a run this job started, e.g. a nested training)."""
        self._guarded("setting tags", lambda: [self.client.set_tag(run_id or self.run_id, k, str(v))
                                               for k, v in tags.items()])

    def log_text(self, text: str, name: str) -> None:
        self._guarded(f"logging {name}", lambda: self.client.log_text(self.run_id, text, name))

    def log_inputs(self, refs: Mapping[str, DataRef]) -> None:
        """The datasets the run read or wrote, by context (training, input, output, ...)."""
        self._guarded("logging its datasets", lambda: log_datasets(self.client, self.run_id, refs))

    def log_artifact(self, path: str | Path) -> None:
        self._guarded(f"logging {Path(path).name}", lambda: self.client.log_artifact(self.run_id, str(path)))

    def end_orphans(self, output: str) -> list[str]:
        """End FAILED the RUNNING runs of this job and ``output`` (OUTPUT_TAG) other than this one: a
        kill -9 left them. One note line naming them; ``[]`` when none (or tracking is off)."""
        ended: list[str] = []

        def end_them():
            from mlflow.entities import ViewType

            for run in self.client.search_runs([self.experiment_id], "attributes.status = 'RUNNING' and "
                                               f"tags.`freescale.job` = '{self.job}'",
                                               run_view_type=ViewType.ALL, max_results=10_000):
                if run.info.run_id != self.run_id and run.data.tags.get(OUTPUT_TAG) == output:
                    self.client.set_tag(run.info.run_id, "freescale.ended_by",
                                        f"a later {self.job} of its output: the run that made it was killed "
                                        "before it could end it")
                    self.client.set_terminated(run.info.run_id, "FAILED")
                    ended.append(run.info.run_id)
        self._guarded("ending the runs a killed job left RUNNING", end_them)
        if ended:
            sys.stderr.write(f"freescale {self.job}: note: {len(ended)} MLflow run(s) of a killed {self.job} of "
                             f"{output} were still RUNNING: ended FAILED ({', '.join(ended)})\n")
            sys.stderr.flush()
        return ended

    def end(self, status: str) -> None:
        self._guarded(f"ending the run {status}", lambda: self.client.set_terminated(self.run_id, status))
        self.client = None

    def _guarded(self, what: str, action, always: bool = False) -> None:
        if not (always or self.active):
            return
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - tracking must never fail the job
            self.client = None
            sys.stderr.write(f"freescale {self.job}: warning: MLflow at {self.uri} failed {what} ({failure(exc)}); "
                             "the job continues untracked\n")
            sys.stderr.flush()


@contextlib.contextmanager
def job_run(job: str, *, tracking_uri: str, experiment: str, params: Mapping[str, Any] | None = None,
            tags: Mapping[str, str] | None = None, run_name: str | None = None,
            parent_run_id: str | None = None, output: str | None = None) -> Iterator[JobRun]:
    """The job's MLflow run for the length of the ``with`` block: opened on entry (after the
    job's argument checks), ended FINISHED when the block completes, KILLED on Ctrl-C or a stop
    signal, FAILED on any other exception (which still propagates). Tracking never fails the
    job: see JobRun. ``tracking_uri`` DISABLED gives a run that records nothing. With ``output``
    (the folder the job writes), the runs of this job and output a kill -9 left RUNNING end FAILED."""
    run = JobRun(job, tracking_uri)
    key = output_key(output) if output else None
    run.start(experiment, run_name or job, {**(tags or {}), **({OUTPUT_TAG: key} if key else {})}, parent_run_id)
    if key:
        run.end_orphans(key)
    if params:
        run.log_params(params)
    try:
        yield run
    except BaseException as exc:
        run.end(ended_status(exc))
        raise
    run.end("FINISHED")


def output_key(output: str) -> str:
    """How OUTPUT_TAG names an output: a local one by its absolute path (however it was spelled),
    any other by its URI."""
    from freescale.runtime.paths import local_path

    local = local_path(output)
    return str(Path(local).resolve()) if local is not None else output.rstrip("/")


def failure(exc: BaseException) -> str:
    """A tracking error as warnings name it: its type and the first line of its message."""
    return f"{type(exc).__name__}: {one_line(exc)}"


def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


def fail_orphaned_runs(uri: str, workdir: str) -> list[str]:
    """End FAILED the runs of `freescale pipeline` stages in ``workdir`` (PIPELINE_TAG) that are
    still RUNNING: what a pipeline killed without a chance to end them (kill -9) left. Only for
    the holder of the workdir's lock, whose stages are the only ones that could run there. Returns
    ``job run_id`` of each. A store that cannot be used, or one that does not exist yet, is left
    alone (nothing to end; nothing created)."""
    from urllib.parse import urlsplit

    if uri == DISABLED or unreachable_reason(uri) is not None or unwritable_store_reason(uri) is not None:
        return []
    if urlsplit(uri).scheme == "sqlite" and not Path(uri[len("sqlite:///"):]).is_file():
        return []
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    ended = []
    for first in range(0, len(experiments), 100):  # MLflow's cap of experiments per search
        for run in client.search_runs(experiments[first:first + 100], "attributes.status = 'RUNNING'",
                                      run_view_type=ViewType.ALL, max_results=10_000):
            if run.data.tags.get(PIPELINE_TAG) == workdir:
                client.set_tag(run.info.run_id, "freescale.ended_by", "a later run of its pipeline: the run that "
                                                                      "made it was killed before it could end it")
                client.set_terminated(run.info.run_id, "FAILED")
                ended.append(f"{run.data.tags.get('freescale.job', 'run')} {run.info.run_id}")
    return ended
