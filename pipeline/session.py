"""SparkSession construction shared by the jobs and the tests."""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from pyspark.sql import DataFrame, SparkSession

from pipeline import logs
from pipeline.errors import one_line


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


# The driver JVM's log4j2 settings when a job starts it without --verbose: Spark's defaults at
# WARN, less the warnings every local run prints and no one acts on (the host name resolving to
# loopback, no native Hadoop library, our deliberate one-partition windows over small tables).
# Any other WARN still reaches the job's log; --verbose keeps Spark's own defaults.
LOG4J2_PROPERTIES = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
appender.console.filter.known.type = RegexFilter
appender.console.filter.known.regex = (?s).*(resolves to a loopback address|Set SPARK_LOCAL_IP if you need\
|Unable to load native-hadoop library|No Partition Defined for Window operation).*
appender.console.filter.known.onMatch = DENY
appender.console.filter.known.onMismatch = NEUTRAL
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = warn
logger.jetty2.name = org.sparkproject.jetty.util.component.AbstractLifeCycle
logger.jetty2.level = error
logger.parquet.name = org.apache.parquet.CorruptStatistics
logger.parquet.level = error
"""


def log4j2_config_file() -> Path:
    """``LOG4J2_PROPERTIES`` in a file named by its content (written once, atomically)."""
    digest = hashlib.sha256(LOG4J2_PROPERTIES.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"freescale-log4j2-{digest}.properties"
    if not path.exists():
        scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        scratch.write_text(LOG4J2_PROPERTIES)
        os.replace(scratch, path)
    return path


def build_spark_session(master: str | None = None, app_name: str = "freescale") -> SparkSession:
    """Get or create a session.

    Under spark-submit the launcher's --master and --conf win; otherwise `master`
    defaults to local[*] with a small shuffle width suited to one machine.

    A JVM started here writes its output (WARN and above, stack traces of failed tasks)
    to the job's log file (pipeline/logs.py), less the start-up warnings of
    ``LOG4J2_PROPERTIES``, so a failing job's terminal shows its one line only; with --verbose (FREESCALE_VERBOSE=1) the output stays on the terminal at
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
    if to_log:  # set before the JVM starts, so its start-up lines obey it too
        builder = builder.config("spark.driver.extraJavaOptions",
                                 f"-Dlog4j2.configurationFile={log4j2_config_file().as_uri()}")
    with _stderr_to(logs.log_file(app_name)) if to_log else contextlib.nullcontext():
        session = builder.getOrCreate()
    if to_log:
        session.sparkContext.setLogLevel("WARN")
    elif starts_jvm or under_spark_submit():
        session.sparkContext.setLogLevel("ERROR")
    return session


def checkpoint(frame: DataFrame) -> DataFrame:
    """`frame` computed now and kept for the rest of the job: read several times, computed once.

    With a checkpoint directory (``spark.checkpoint.dir``, or ``SparkContext.setCheckpointDir``)
    the rows are written there (``checkpoint``): a reliable copy that outlives the executor that
    computed it, so a job survives a lost worker. Without one they stay in the executors' block
    stores (``localCheckpoint``): faster, but a lost executor's blocks cannot be recomputed and
    the job fails (CHECKPOINT_RDD_BLOCK_ID_NOT_FOUND). Local runs have no checkpoint directory.
    """
    if frame.sparkSession.sparkContext.getCheckpointDir() is not None:
        return frame.checkpoint(eager=True)
    return frame.localCheckpoint(eager=True)


@contextlib.contextmanager
def checkpoints_removed(job: str) -> Iterator[None]:
    """Remove the job's reliable checkpoints when it ends, done or failed.

    ``checkpoint`` writes them under ``<spark.checkpoint.dir>/<uuid of this SparkContext>/``; Spark
    never deletes them, and nothing reads them once the job has ended (a rerun starts over).
    A job killed outright (kill -9) leaves them. Failing to remove them is one warning, never the
    job's failure.
    """
    try:
        yield
    finally:
        from pyspark import SparkContext

        context = SparkContext._active_spark_context
        folder = context.getCheckpointDir() if context is not None else None
        if folder:
            try:
                path = context._jvm.org.apache.hadoop.fs.Path(folder)
                path.getFileSystem(context._jsc.hadoopConfiguration()).delete(path, True)
            except Exception as exc:  # noqa: BLE001 - the job's own outcome stands
                print(f"freescale {job}: warning: could not remove its checkpoints at {folder}: {one_line(exc)}",
                      file=sys.stderr)
