"""The frame every Spark job (prepare, balance, recommend) runs in: the job brings its work, the frame the rest.

The frame: the command line (``--help`` from the job's docstring, its spec's options, the tracking
ones), the job's light checks before anything heavy loads, the tracking URI's one check, the job's
MLflow run (its parameters: the spec but ``overwrite``), the Spark session, the output's checks
(``SparkJobRun.start_spark``: it may not exist unless --overwrite; stale temporary siblings go), the
atomic output (``SparkJobRun.staging``), the reliable checkpoints' removal, and the one-line errors
with their exit codes (``freescale.runtime.job_errors.run_job``) under the progress line. The job's
work (:attr:`SparkJob.work`) reads, transforms, writes into the staging folder, records on the run
and returns its last line, which the frame prints once the run has ended.

Light module: nothing here imports pyspark or mlflow at import time.
"""
from __future__ import annotations

import argparse
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, TypeVar

from freescale.runtime import options
from freescale.runtime.job_errors import run_job
from freescale.tracking.store import Tracking, add_tracking_arguments  # no mlflow import until a run opens

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from freescale.runtime.hadoop_fs import HadoopFS
    from freescale.tracking.runs import JobRun

Spec = TypeVar("Spec")


def check_output(output: str, overwrite: bool, inputs: Mapping[str, str | None]) -> None:
    """The output's checks that need no Spark: it is not, is not inside and does not contain one of
    ``inputs`` (``{flag: path}``), and, when local, it does not exist unless ``overwrite``."""
    from freescale.runtime.atomic_output import check_local_output_free, check_no_overlap

    check_no_overlap(output, dict(inputs))
    check_local_output_free(output, overwrite)


class SparkJobRun:
    """What the frame hands a job's work: its spec, tracking and MLflow run, and (once
    :meth:`start_spark` ran) its Spark session, file system and qualified output."""

    def __init__(self, job: str, spec: Any, tracking: Tracking, run: JobRun):
        self.job, self.spec, self.tracking, self.run = job, spec, tracking, run
        self.spark: SparkSession | None = None
        self.fs: HadoopFS | None = None
        self.output_uri = ""
        self.started = 0.0
        self.stale_removed = 0

    def start_spark(self) -> tuple[SparkSession, HadoopFS]:
        """Start the clock and Spark; qualify the output, refuse an existing one (unless --overwrite),
        remove what an interrupted run of this job left beside it."""
        from freescale.runtime.atomic_output import check_output_free, remove_stale_siblings
        from freescale.runtime.hadoop_fs import HadoopFS
        from freescale.runtime.session import build_spark_session

        self.started = time.perf_counter()
        self.spark = build_spark_session(self.spec.master, f"freescale-{self.job}")
        self.fs = HadoopFS(self.spark)
        self.output_uri = self.fs.qualify(self.spec.output)
        check_output_free(self.fs, self.output_uri, self.spec.overwrite)
        self.stale_removed = remove_stale_siblings(self.fs, self.output_uri)
        return self.spark, self.fs

    def staging(self) -> AbstractContextManager[str]:
        """The folder to write the output into: it becomes the output when the block ends, and is
        removed when the block fails."""
        from freescale.runtime.atomic_output import atomic_output

        return atomic_output(self.fs, self.output_uri, self.spec.overwrite)

    def seconds(self) -> float:
        """Seconds since :meth:`start_spark` started the clock."""
        return time.perf_counter() - self.started


def _no_check(spec: Any) -> None:
    pass


@dataclass(frozen=True)
class SparkJob(Generic[Spec]):
    """One Spark job as the frame runs it: `freescale NAME`, ``python -m freescale.jobs.NAME`` and
    ``spark-submit freescale/jobs/NAME.py`` call :meth:`main`; `freescale compare` and `freescale
    pipeline` call :meth:`run` in-process."""

    name: str
    """The command, the errors' and warnings' ``freescale NAME:``, the run's job and default name."""
    spec: type[Spec]
    """Its options' dataclass (``freescale.runtime.options``): ``output``, ``overwrite``, ``master`` among them."""
    doc: str
    """The job module's docstring: --help's description is its first paragraph."""
    work: Callable[[Spec, SparkJobRun], str]
    """The job's own work inside its run: start Spark (``start_spark``), read, write into ``staging()``,
    record on ``run``; its last line (the frame adds the stale-folder note and prints it)."""
    check: Callable[[Spec], None] = _no_check
    """What can be checked before anything heavy loads (a bad argument is its one line, exit 2)."""
    tags: Callable[[Spec, Tracking], Mapping[str, str]] | None = None
    """The run's tags beyond the frame's."""
    run_name: Callable[[Spec], str] | None = None
    """The run's name (default: the job's)."""
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    """Command-line arguments beyond the spec's and the tracking ones."""
    spec_of_args: Callable[[argparse.Namespace], Spec] | None = None
    """The spec of the parsed command line (default: the spec's options from its values)."""

    def build_parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"freescale {self.name}", description=self.doc.split("\n\n")[0])
        options.add_arguments(p, self.spec, "cli")
        add_tracking_arguments(p)
        if self.arguments is not None:
            self.arguments(p)
        return p

    def execute(self, spec: Spec, tracking: Tracking) -> int:
        """The job on ``spec``, its last line printed once its run ended; errors propagate."""
        # Arguments first: a bad one is reported before Spark (or anything heavy) loads.
        self.check(spec)

        from freescale.runtime.atomic_output import stale_note
        from freescale.runtime.session import checkpoints_removed
        from freescale.tracking.runs import job_run
        uri = tracking.reachable_uri(self.name)  # unreachable: one warning, untracked

        # The run spans the job's work: opened before Spark starts, FAILED if the job fails.
        params = {k: v for k, v in asdict(spec).items() if k != "overwrite"}
        with job_run(self.name, tracking_uri=uri, experiment=tracking.experiment, params=params,
                     tags=self.tags(spec, tracking) if self.tags else None,
                     run_name=self.run_name(spec) if self.run_name else None, output=spec.output) as run, \
                checkpoints_removed(self.name):  # inside the run: removed before it ends, failed or not
            job = SparkJobRun(self.name, spec, tracking, run)
            line = self.work(spec, job)
        print(line + stale_note(job.stale_removed))
        return 0

    def run(self, spec_of: Callable[[], Spec], tracking: Tracking) -> int:
        """The job on the spec ``spec_of()`` builds (inside the job's error handling: a bad value is its
        one line); its exit status."""
        from freescale.runtime.progress import spark_progress  # stdlib only; pyspark loads when a stage runs

        with spark_progress(self.name):  # one line with the running stage and its fraction done
            return run_job(self.name, lambda: self.execute(spec_of(), tracking))

    def main(self, argv: list[str] | None = None) -> int:
        args = self.build_parser().parse_args(argv)
        if self.spec_of_args is not None:
            return self.run(lambda: self.spec_of_args(args), Tracking.of(args))
        return self.run(lambda: options.from_values(self.spec, vars(args)), Tracking.of(args))
