"""All-or-nothing job outputs: write under a temporary sibling, then rename into place.

A job that fails half-way leaves nothing at the output path, so a scheduler can
rerun it; a finished output is never replaced unless the caller asked for it.
As with Spark's output committers, what a killed run leaves (``<output>.tmp-<hex>``,
or ``<output>.old-<hex>`` from a crash mid-swap) is removed by the next run of the
job for that output (:func:`remove_stale_siblings`), and an output that would
overwrite or sit inside one of the job's inputs is refused before any work
(:func:`check_no_overlap`).

Light module: nothing here imports pyspark, so the checks run before Spark starts.
"""
from __future__ import annotations

import os
import re
import uuid
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from freescale.runtime.errors import InputError
from freescale.runtime.paths import local_path, overlap

if TYPE_CHECKING:
    from freescale.runtime.hadoop_fs import HadoopFS

_TAG_HEX = 12
# The names atomic_output gives its temporary siblings: <name>.tmp-<tag> and <name>.old-<tag>.
_SIBLING = r"\.(?:tmp|old)-[0-9a-f]{%d}" % _TAG_HEX
_STAGED = re.compile(r"(.+?)\.tmp-[0-9a-f]{%d}(?:/|$)" % _TAG_HEX)


def check_no_overlap(output: str, inputs: dict[str, str | None]) -> None:
    """Refuse an output that is, is inside, or contains an input (``{flag: path}``; None
    skipped), --overwrite or not: replacing the output would delete or corrupt the input."""
    for flag, path in inputs.items():
        if path is None:
            continue
        relation = overlap(output, path)
        if relation is not None:
            raise InputError(f"--output {output} {relation} {flag} {path}: a job never writes over "
                             "its own input; choose another output")


def check_output_free(fs: HadoopFS, output: str, overwrite: bool) -> None:
    """Fail before any work when the output exists and replacing it was not asked for."""
    if fs.exists(output) and not overwrite:
        raise InputError(_already_exists(output))


def check_local_output_free(output: str, overwrite: bool) -> None:
    """:func:`check_output_free` for a local output, before Spark starts (seconds sooner); a
    remote one is checked once Spark runs."""
    local = local_path(output)
    if local is not None and os.path.lexists(local) and not overwrite:
        raise InputError(_already_exists(output))


def _already_exists(output: str) -> str:
    return f"output {output} already exists (pass --overwrite to replace it)"


def stale_siblings(fs: HadoopFS, output: str) -> list[str]:
    """``<output>.tmp-<tag>`` and ``<output>.old-<tag>`` folders next to ``output``: what an
    interrupted :func:`atomic_output` leaves. Nothing else matches."""
    output = output.rstrip("/")
    parent, _, name = output.rpartition("/")
    if not name or not parent or not fs.exists(parent):
        return []
    pattern = re.compile(re.escape(name) + _SIBLING)
    return [d for d in fs.list_dirs(parent) if pattern.fullmatch(d.rstrip("/").rpartition("/")[2])]


def staged_output(path: str) -> str | None:
    """The output whose staging folder (``<output>.tmp-<tag>``) holds ``path``; None when none does.
    Error messages name the output the user asked for, not the staging folder a task was writing."""
    match = _STAGED.match(path)
    return match.group(1) if match else None


def remove_stale_siblings(fs: HadoopFS, output: str) -> int:
    """Delete the temporary folders an interrupted run left next to ``output``; how many.

    Like Spark's committers, this assumes one run per output at a time: a second run
    started while the first is still writing would remove the first one's staging folder.
    """
    stale = stale_siblings(fs, output)
    for path in stale:
        fs.delete(path)
    return len(stale)


def stale_note(removed: int) -> str:
    """The final log line's clause for :func:`remove_stale_siblings`' count ('' for none)."""
    if not removed:
        return ""
    return f"; removed {removed} stale temporary folder{'s' if removed != 1 else ''} of an interrupted run"


@contextmanager
def atomic_output(fs: HadoopFS, output: str, overwrite: bool) -> Iterator[str]:
    """Yield a temporary directory; on success it becomes `output`, on error it is removed.

    The block's Spark jobs form one job group, so that a stop can cancel them, and the jobs the
    interrupted action has yet to start, before the staging folder is removed."""
    from freescale.runtime.stops import stop_of

    check_output_free(fs, output, overwrite)
    output = output.rstrip("/")
    tag = uuid.uuid4().hex[:_TAG_HEX]
    staging = f"{output}.tmp-{tag}"
    group = f"freescale-output-{tag}"
    _set_job_group(group, f"writing {output}")
    try:
        yield staging
    except BaseException as exc:
        if stop_of(exc) is not None:  # a stop signal interrupted the driver only: the JVM may go on writing
            _cancel_spark_jobs(group)
        _remove_staging(fs, staging)
        raise
    finally:
        _set_job_group(None)
    # Swap: the old output is moved aside first so a crash between the two renames
    # leaves either the old or the new output findable, never a mix.
    retired = f"{output}.old-{tag}"
    if fs.exists(output):
        fs.rename(output, retired)
    fs.rename(staging, output)
    fs.delete(retired)


# How long a stopped job waits for its cancelled Spark tasks to end before removing their staging
# folder (a task still running would write into it again).
CANCEL_WAIT_S = 20.0


def _set_job_group(group: str | None, description: str = "") -> None:
    """Put this thread's next Spark jobs in job group `group` (None: in none). A process without
    Spark (or whose JVM is gone) has nothing to group."""
    from pyspark import SparkContext

    context = SparkContext._active_spark_context
    if context is None:
        return
    try:
        if group is None:
            context._jsc.clearJobGroup()
        else:
            context.setJobGroup(group, description)
    except Exception:  # noqa: BLE001 - the JVM may be gone (a signal to the process group)
        pass


def _cancel_spark_jobs(group: str) -> None:
    """Cancel job group `group`'s running jobs and those it has yet to start (Spark's
    cancelJobGroupAndFutureJobs: an interrupted write may still be planning its next job, which a
    cancel of the running ones would miss), then every running job, and wait (CANCEL_WAIT_S at
    most) until none runs and no executor runs a task: a cancelled job ends before its tasks do,
    and a task still writing would create the staging folder again after its removal (seen once
    in 6 stops of a prepare on a loaded machine)."""
    import time

    from pyspark import SparkContext

    context = SparkContext._active_spark_context
    if context is None:
        return
    try:
        context._jsc.sc().cancelJobGroupAndFutureJobs(group)
        context.cancelAllJobs()
        deadline = time.monotonic() + CANCEL_WAIT_S
        tracker = context._jsc.sc().statusTracker()
        while (context.statusTracker().getActiveJobsIds()
               or any(info.numRunningTasks() for info in tracker.getExecutorInfos())) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the JVM may be gone too (a signal to the process group)
        pass


def _remove_staging(fs: HadoopFS, staging: str) -> None:
    """Remove the staging folder through Hadoop, or, when the JVM is gone (stopped with its
    process group), from the local file system when it is local. A remote one that cannot be
    removed is one warning: the job's own error (or stop) is what ends it, and the next run of the
    job removes the folder (remove_stale_siblings)."""
    import shutil
    import sys

    from freescale.runtime.errors import one_line

    try:
        fs.delete(staging)
    except Exception as exc:  # noqa: BLE001 - py4j's errors when the JVM died
        local = local_path(staging)
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)
            return
        print(f"freescale: warning: could not remove the staging folder {staging} ({one_line(exc)}); "
              "the next run for this output removes it", file=sys.stderr, flush=True)
