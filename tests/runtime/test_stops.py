"""A stop signal that lands inside a Spark action is reported as the stop, whatever the cleanup on its
way out then meets (freescale/runtime/stops.py: stops_on_signals, stop_of; freescale/runtime/session.py:
drop_gateway_connection, checkpoints_removed). The pipeline's side is tests/jobs/test_workflow.py's."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from freescale.runtime.stops import Stopped, stop_of, stop_signal, stops_on_signals


class BrokenContext:
    """A SparkContext whose JVM answers garbage, as one did after a stop interrupted a call: every
    JVM call fails."""

    def __getattr__(self, name: str):
        raise KeyError("c")


@pytest.fixture
def broken_context(monkeypatch):
    from pyspark import SparkContext

    monkeypatch.setattr(SparkContext, "_active_spark_context", BrokenContext())


def test_checkpoint_removal_never_replaces_a_stop(broken_context, monkeypatch, capsys):
    """A job that wrote reliable checkpoints is stopped and the JVM calls that remove them fail: the
    stop goes on, and the checkpoints left are one warning naming their folder."""
    from freescale.runtime import session

    monkeypatch.setattr(session, "_checkpoint_folders", {"hdfs:///tmp/checkpoints/uuid-1"})
    with pytest.raises(Stopped):
        with session.checkpoints_removed("prepare"):
            raise Stopped(signal.SIGTERM)
    [warning] = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith("freescale prepare: warning: could not remove its checkpoints at "
                              "hdfs:///tmp/checkpoints/uuid-1: ")
    assert not session._checkpoint_folders


def test_a_job_without_reliable_checkpoints_asks_the_jvm_nothing_on_its_way_out(broken_context, capsys):
    """Every local run: no checkpoint folder was written, so a broken JVM has nothing to break."""
    from freescale.runtime import session

    with pytest.raises(Stopped):
        with session.checkpoints_removed("prepare"):
            raise Stopped(signal.SIGTERM)
    assert capsys.readouterr().err == ""


def test_the_stop_is_remembered_whichever_error_surfaces():
    """Inside stops_on_signals, SIGTERM raises Stopped once and is remembered until the block ends:
    a KeyError raised in its place still stands for it; outside, nothing is a stop."""
    with stops_on_signals():
        with pytest.raises(Stopped):
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(5)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: ignored, the cleanup goes on
        assert stop_of(KeyError("c")) == signal.SIGTERM == stop_signal()
    assert stop_signal() is None and stop_of(KeyError("c")) is None
    assert stop_of(KeyboardInterrupt()) == signal.SIGINT


# A Spark action that takes SLEEP_MS in the JVM (Thread.sleep in a task): long enough for the signal to
# land inside it, short enough that the old failure shows in seconds rather than hanging.
SLEEP_MS = 4000


def test_a_stop_inside_a_spark_action_leaves_the_jvm_answering(spark):
    """SIGTERM while the main thread waits for a Spark action's answer. The cleanup's JVM calls, made
    while the stop propagates, get their own answers; before, the first waited for the action to end
    and read its answer, and each later call read the answer of the call before it (None for the
    application id here; KeyError: 'c' in prepare's checkpoint removal)."""
    context = spark.sparkContext
    application = context.applicationId
    answers = []
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    with stops_on_signals():
        timer.start()
        with pytest.raises(Stopped):
            try:
                spark.range(1, numPartitions=1).selectExpr(
                    f"reflect('java.lang.Thread', 'sleep', cast({SLEEP_MS} as bigint))").collect()
            finally:  # as a job's cleanup runs: with the stop on its way out
                context.cancelAllJobs()
                answers += [context._jsc.sc().applicationId(), context.getCheckpointDir()]
    timer.join()
    assert answers == [application, None]
    assert spark.range(5).count() == 5


# A job's process that starts Spark inside stops_on_signals, as the pipeline's stages do.
STARTS_SPARK = """
import sys
from freescale.runtime.stops import Stopped, stops_on_signals
from freescale.runtime.session import build_spark_session

with stops_on_signals():
    try:
        print("starting", flush=True)
        build_spark_session("local[1]", "stopped-while-starting")
    except Stopped:
        sys.exit(143)
"""


@pytest.mark.spawns
def test_a_stop_while_spark_starts_leaves_no_jvm_behind(tmp_path):
    """SIGTERM while PySpark waits for the JVM it started: the JVM used to outlive the job, holding
    its stdout and stderr open (the fault sweep waited on them for ever). Now the job exits at once
    and leaves no process behind."""
    import subprocess
    import sys
    import time
    import uuid

    from tests import helpers

    marker = uuid.uuid4().hex
    env = {**os.environ, "FREESCALE_TEST_STOP": marker, "FREESCALE_LOG_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", STARTS_SPARK], cwd=helpers.REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "starting\n"
        time.sleep(0.3)  # the JVM's start takes seconds: the signal lands inside it
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)  # returns once every holder of the pipes is gone
    finally:
        for pid in helpers.processes_with("FREESCALE_TEST_STOP", marker):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 143
    assert helpers.processes_with("FREESCALE_TEST_STOP", marker) == []
