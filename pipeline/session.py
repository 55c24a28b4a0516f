"""SparkSession construction shared by the jobs and the tests."""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

from pyspark.sql import SparkSession

from pipeline import logs


def under_spark_submit() -> bool:
    """spark-submit launches the Python driver with a gateway already listening."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Point this process's file descriptor 2 at `path` while the block runs.

    The JVM that PySpark starts inherits descriptor 2, and so do the Python workers the
    JVM starts: everything they ever print (log4j's console appender, the JVM's own
    warnings, task stack traces, worker tracebacks) lands in `path`. Python's own stderr
    is put back afterwards.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def build_spark_session(master: str | None = None, app_name: str = "freescale") -> SparkSession:
    """Get or create a session.

    Under spark-submit the launcher's --master and --conf win; otherwise `master`
    defaults to local[*] with a small shuffle width suited to one machine.

    A JVM started here writes its output (WARN and above, stack traces of failed tasks)
    to the job's log file (pipeline/logs.py), so a failing job's terminal shows its one
    line only; with --verbose (FREESCALE_VERBOSE=1) the output stays on the terminal at
    ERROR level, as before. Under spark-submit the JVM already runs: its log4j settings
    decide.
    """
    # Python workers must run the driver's interpreter (pandas UDFs need pyarrow there).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master or not under_spark_submit():
        builder = (builder.master(master or "local[*]")
                   .config("spark.sql.shuffle.partitions", "8")
                   .config("spark.ui.enabled", "false"))
    builder = (builder
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.ui.showConsoleProgress", "false"))
    from pyspark import SparkContext

    starts_jvm = SparkContext._gateway is None and not under_spark_submit()
    to_log = starts_jvm and not logs.verbose()
    with _stderr_to(logs.log_file(app_name)) if to_log else contextlib.nullcontext():
        session = builder.getOrCreate()
    if to_log:
        session.sparkContext.setLogLevel("WARN")
    elif starts_jvm or under_spark_submit():
        session.sparkContext.setLogLevel("ERROR")
    return session
