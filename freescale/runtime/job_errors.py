"""How every job ends: one line on stderr, printed last, and one exit status per kind of failure.

    0  EXIT_OK           the job finished
    1  EXIT_FAILED       anything else (a bug, a crash, a killed rank): the traceback is in the log
    2  EXIT_BAD_INPUT    bad input or arguments: InputError and its subclasses (ShardError,
                         InfeasibleError, ConfigError, ...), a missing or existing path, a file Spark
                         cannot read, argparse's own errors
    3  EXIT_ENVIRONMENT  this machine or a service stopped the job: a comm/process-group backend that
                         cannot run here (CUDA absent), Java missing or Spark unable to start, a Spark
                         master that does not answer, a file system scheme Spark has no jar for, a full
                         disk (freescale/runtime/spark_errors.py), MLflow tracking that failed where it stops the job

The line reads ``freescale JOB: error: MESSAGE`` and, when the log holds the details (a Python,
JVM or torchrun trace), ends with ``(details: LOG)``; see freescale/runtime/logs.py for where the log is.
``--verbose`` (FREESCALE_VERBOSE=1) prints tracebacks on the terminal instead;
FREESCALE_DEBUG=1 re-raises expected failures too.
"""
from __future__ import annotations

import os
import re
import sys
import time
import traceback
from typing import Callable

from freescale.runtime import logs
from freescale.runtime.errors import InputError
from freescale.runtime.spark_errors import environment_message
from freescale.runtime.stops import Stopped, stop_signal

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_ENVIRONMENT = 3


# Where `freescale train` asks its ranks to leave their exit status (one file per rank).
STATUS_DIR_ENV = "FREESCALE_STATUS_DIR"

# Error classes outside InputError's family, by the module that defines them. A class can only
# have been raised if its module is loaded, so only loaded modules are asked: reporting a bad
# argument never imports torch, torchrec or pyspark just to name a class.
_BAD_INPUT = (("pyspark.errors", "PySparkException"),)
_ENVIRONMENT = (("freescale.comm.errors", "BackendUnavailable"), ("mlflow.exceptions", "MlflowException"),
                ("freescale.runtime.errors", "ServiceUnavailable"))
# PySpark errors that mean Spark itself could not run here (no Java, the JVM died), not bad input.
_SPARK_ENVIRONMENT_CLASSES = ("JAVA_GATEWAY_EXITED",)
# Markers of an expected error raised inside a Spark task (a pandas UDF): the task's error text
# carries the original exception's name.
_TASK_ERROR_MARKERS = ("InfeasibleError: ", "InputError: ", "ShardError: ")


# A Spark (JVM) error that the input caused: its condition and SQLSTATE, e.g. a data file Spark
# cannot read ("[FAILED_READ_FILE.NO_HINT] ... SQLSTATE: KD001"). SQLSTATE classes KD (data
# source) and 22 (data exception) are the data's fault; anything else from the JVM is not.
_SPARK_CONDITION = re.compile(r"\[([A-Z][A-Z0-9_.]+)\] ([^\n]*)")
_SPARK_SQLSTATE = re.compile(r"SQLSTATE: ([0-9A-Z]{5})")
_JAVA_CAUSE = re.compile(r"^Caused by: (?:[\w$]+\.)*([\w$]+): ([^\n]*)$", re.M)
_INPUT_SQLSTATE_CLASSES = ("KD", "22")


def spark_input_error(exc: BaseException) -> str | None:
    """The one-line message of a JVM error (py4j's Py4JJavaError) that bad input caused, else None."""
    if type(exc).__name__ != "Py4JJavaError":
        return None
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - the JVM may be gone: then it is not an input error we can name
        return None
    condition, state = _SPARK_CONDITION.search(text), _SPARK_SQLSTATE.search(text)
    if condition is None or state is None or state.group(1)[:2] not in _INPUT_SQLSTATE_CLASSES:
        return None
    message = f"Spark: [{condition.group(1)}] {_SPARK_SQLSTATE.sub('', condition.group(2)).strip()}"
    causes = _JAVA_CAUSE.findall(text)
    if causes:
        message += f" ({causes[-1][0]}: {causes[-1][1].strip()})"
    return message


def _loaded(pairs) -> tuple[type[BaseException], ...]:
    return tuple(getattr(sys.modules[module], name) for module, name in pairs
                 if module in sys.modules and hasattr(sys.modules[module], name))


def exit_code(exc: BaseException) -> int:
    """The exit status for a job stopped by `exc`."""
    if isinstance(exc, _loaded(_ENVIRONMENT)) or environment_message(exc) is not None:
        return EXIT_ENVIRONMENT
    pyspark_error = _loaded((("pyspark.errors", "PySparkException"),))
    if pyspark_error and isinstance(exc, pyspark_error):
        condition = (exc.getCondition() if hasattr(exc, "getCondition") else None) or ""
        if condition.startswith(_SPARK_ENVIRONMENT_CLASSES):
            return EXIT_ENVIRONMENT
        if type(exc).__name__ == "PythonException":  # a task's Python error: bad input only if it says so
            return EXIT_BAD_INPUT if any(marker in str(exc) for marker in _TASK_ERROR_MARKERS) else EXIT_FAILED
    if isinstance(exc, (InputError, FileExistsError, FileNotFoundError) + _loaded(_BAD_INPUT)):
        return EXIT_BAD_INPUT
    if spark_input_error(exc) is not None:
        return EXIT_BAD_INPUT
    return EXIT_FAILED


def first_line(exc: BaseException) -> str:
    """The message's first line; for an error raised inside a Spark task, the original error's line;
    for one the machine or cluster caused (a full disk, a file system or master Spark cannot reach),
    what to do about it."""
    spark = environment_message(exc) or spark_input_error(exc)
    if spark is not None:
        return spark
    text = str(exc).strip()
    lines = text.splitlines()
    if type(exc).__name__ == "Py4JJavaError":  # "An error occurred while calling o165.x.\n: java.Error: ..."
        java = [line[2:].strip() for line in lines if line.startswith(": ")]
        if java:
            return java[0]
    for marker in _TASK_ERROR_MARKERS:
        raised = [line for line in lines if marker in line]
        if raised:
            return raised[-1].split(marker, 1)[1].strip()
    return lines[0] if lines else type(exc).__name__


def launched_rank() -> bool:
    """This process is a rank of `freescale train`, whose launcher names the log in its last line."""
    return bool(os.environ.get(STATUS_DIR_ENV))


def write_details(job: str, text: str) -> None:
    """Append `text` to the log as one block (ranks share the file with their launcher)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    block = f"----- freescale {job} (pid {os.getpid()}) {stamp}\n{text.rstrip()}\n"
    try:
        with logs.open_log(job.split(" ")[0]) as handle:
            handle.write(block)
    except OSError:  # no log: the terminal gets the trace rather than nothing
        sys.stderr.write(block)


def error_line(job: str, message: str, details: bool) -> None:
    """The job's last line. One write, newline included: ranks share the launcher's stderr,
    and print()'s separate write of the newline let two ranks' lines run together."""
    suffix = f" (details: {logs.shown(logs.log_file(job.split(' ')[0]))})" if details else ""
    sys.stdout.flush()
    sys.stderr.write(f"freescale {job}: error: {message}{suffix}\n")
    sys.stderr.flush()


def report(job: str, exc: BaseException) -> int:
    """Print `exc` as the job's one line (its trace to the log, or the terminal under --verbose); its exit status."""
    code = exit_code(exc)
    message = first_line(exc)
    if code == EXIT_FAILED:
        message = f"{type(exc).__name__}: {message}"
    trace = "".join(traceback.format_exception(exc))
    if logs.verbose():
        if code == EXIT_FAILED:
            sys.stderr.write(trace)
        error_line(job, message, details=False)
        return code
    # An expected error's message is the whole story unless the log already holds details (Spark's
    # output, the launcher's capture of the ranks); an unexpected one always leaves its traceback.
    details = code == EXIT_FAILED or launched_rank() or logs.has_details(job.split(" ")[0])
    if details:
        write_details(job, trace)
    error_line(job, message, details=details and not launched_rank())
    return code


def run_job(job: str, body: Callable[[], int | None]) -> int:
    """Run `body`; any failure becomes one line and an exit status (see the module docstring).

    FREESCALE_DEBUG=1 re-raises expected failures (unexpected ones show their traceback, as
    under --verbose). An error that surfaces after a stop signal (stop_signal) is the stop: its trace
    goes to the log and Stopped goes on, so the job ends as stopped, not failed.
    """
    try:
        return body() or EXIT_OK
    except Exception as exc:  # noqa: BLE001 - every failure ends as one line and a status
        signum = stop_signal()
        if signum is not None:
            write_details(job, "after a stop signal: " + "".join(traceback.format_exception(exc)))
            raise Stopped(signum) from exc
        if os.environ.get(logs.DEBUG_ENV) and exit_code(exc) != EXIT_FAILED:
            raise
        return report(job, exc)


def record_rank_status(status: int) -> None:
    """A rank of `freescale train` leaves its exit status for the launcher (which sees torchrun's 1)."""
    folder = os.environ.get(STATUS_DIR_ENV)
    if folder:
        try:
            with open(os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}"), "w") as handle:
                handle.write(str(status))
        except OSError:
            pass
