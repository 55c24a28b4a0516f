"""SparkSession construction shared by the jobs and the tests."""
from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from pyspark.sql import DataFrame, SparkSession

from freescale.runtime import logs
from freescale.runtime.errors import one_line
from freescale.runtime.spark_master import check_master


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


# The level Spark logs at under spark-submit, from the SparkContext's start (spark.log.level, Spark's
# own setting), unless the launcher sets one (--conf spark.log.level=INFO) or --verbose asks for
# Spark's defaults: the same quiet as a JVM started here, whose output goes to the job's log; here
# the terminal is spark-submit's, so only errors reach it.
SPARK_SUBMIT_LOG_LEVEL = "ERROR"


def build_spark_session(master: str | None = None, app_name: str = "freescale") -> SparkSession:
    """Get or create a session.

    Under spark-submit the launcher's --master and --conf win; otherwise `master`
    defaults to local[*] with a small shuffle width suited to one machine. A standalone
    master that takes no connection fails here in seconds (check_master).

    A JVM started here writes its output (WARN and above, stack traces of failed tasks)
    to the job's log file (freescale/runtime/logs.py), less the start-up warnings of
    ``LOG4J2_PROPERTIES``, so a failing job's terminal shows its one line only; with --verbose
    (FREESCALE_VERBOSE=1) the output stays on the terminal at ERROR level, as before. Under
    spark-submit the JVM already runs and its output is spark-submit's: Spark logs at
    SPARK_SUBMIT_LOG_LEVEL from the SparkContext's start, unless the launcher set spark.log.level
    or --verbose keeps Spark's defaults.
    """
    # Python workers must run the driver's interpreter (pandas UDFs need pyarrow there).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    check_master(master or launcher_master())
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
    elif under_spark_submit() and not logs.verbose() and launcher_conf("spark.log.level") is None:
        builder = builder.config("spark.log.level", SPARK_SUBMIT_LOG_LEVEL)
    with _stderr_to(logs.log_file(app_name)) if to_log else contextlib.nullcontext(), \
            _jvm_ended_if_start_fails(starts_jvm):
        session = builder.getOrCreate()
    if to_log:
        session.sparkContext.setLogLevel("WARN")
    elif starts_jvm:
        session.sparkContext.setLogLevel("ERROR")
    return session


@contextlib.contextmanager
def _jvm_ended_if_start_fails(starts_jvm: bool) -> Iterator[None]:
    """End the JVM this block started when the block fails before PySpark connected to it.

    PySpark starts the JVM, then waits for it to write its port to a temporary folder that it
    removes on the way out; a stop signal raised in that wait removes the folder before the JVM
    writes there, and the JVM, whose main thread then dies, never exits: it outlives the job and
    keeps its stdout and stderr open (a scheduler waiting for them waits forever). A JVM PySpark
    did connect to ends by itself when this process does (it reads our end of a pipe).
    """
    from pyspark import SparkContext

    before = _children() if starts_jvm else set()
    try:
        yield
    except BaseException:
        if starts_jvm and SparkContext._gateway is None:
            for pid in _children() - before:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
        raise


def _children() -> set[int]:
    """The processes this one started and that still run (Linux's /proc; none found elsewhere)."""
    me, found = str(os.getpid()), set()
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            with contextlib.suppress(OSError, IndexError):
                if entry.isdigit() and Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    found.add(int(entry))
    return found


def launcher_conf(key: str) -> str | None:
    """A setting spark-submit gave the driver (--master, --conf, spark-defaults.conf); None outside
    spark-submit or when unset. Asks the launcher's JVM, which is running already."""
    if not under_spark_submit():
        return None
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to the launcher's gateway: SparkConf() then reads its settings
    return SparkConf().get(key, None)


def launcher_master() -> str | None:
    return launcher_conf("spark.master")


def drop_gateway_connection() -> None:
    """Close this thread's connection to the JVM; the next call opens a new one.

    For a stop signal's handler (freescale/runtime/stops.py): the signal may land while the main thread
    waits for the answer to a JVM call (a Spark action), and the exception it raises there leaves
    that answer unread on the connection, which py4j keeps for the thread (PySpark's pinned-thread
    mode): every later call on it would read the answer of the call before it (None for an object,
    KeyError: 'c'), so the cleanup after the stop (cancelling Spark's jobs, removing staging and
    checkpoints) would fail or lie. Closing costs nothing when no call was interrupted. py4j's
    other mode, a pool of connections, never takes an interrupted one back: nothing to do there.
    """
    from pyspark import SparkContext

    client = getattr(SparkContext._gateway, "_gateway_client", None)
    thread_connection = getattr(client, "get_thread_connection", None)
    connection = thread_connection() if thread_connection is not None else None
    if connection is not None:
        connection.close()


def checkpoint(frame: DataFrame) -> DataFrame:
    """`frame` computed now and kept for the rest of the job: read several times, computed once.

    With a checkpoint directory (``spark.checkpoint.dir``, or ``SparkContext.setCheckpointDir``)
    the rows are written there (``checkpoint``): a reliable copy that outlives the executor that
    computed it, so a job survives a lost worker. Without one they stay in the executors' block
    stores (``localCheckpoint``): faster, but a lost executor's blocks cannot be recomputed and
    the job fails (CHECKPOINT_RDD_BLOCK_ID_NOT_FOUND). Local runs have no checkpoint directory.
    """
    folder = frame.sparkSession.sparkContext.getCheckpointDir()
    if folder is not None:
        _checkpoint_folders.add(folder)
        return frame.checkpoint(eager=True)
    return frame.localCheckpoint(eager=True)


# The folders ``checkpoint`` wrote reliable checkpoints to, until ``checkpoints_removed`` removes them.
_checkpoint_folders: set[str] = set()


@contextlib.contextmanager
def checkpoints_removed(job: str) -> Iterator[None]:
    """Remove the job's reliable checkpoints when it ends, done, failed or stopped.

    ``checkpoint`` writes them under ``<spark.checkpoint.dir>/<uuid of this SparkContext>/``; Spark
    never deletes them, and nothing reads them once the job has ended (a rerun starts over).
    A job killed outright (kill -9) leaves them. Only folders ``checkpoint`` wrote to are removed,
    so a job that wrote none (every local run) asks the JVM nothing on its way out. Failing to
    remove them is one warning, never the job's failure, nor in place of its own error or stop.
    """
    try:
        yield
    finally:
        for folder in sorted(_checkpoint_folders):
            _remove_checkpoints(job, folder)
        _checkpoint_folders.clear()


def _remove_checkpoints(job: str, folder: str) -> None:
    from pyspark import SparkContext

    try:
        context = SparkContext._active_spark_context
        path = context._jvm.org.apache.hadoop.fs.Path(folder)
        path.getFileSystem(context._jsc.hadoopConfiguration()).delete(path, True)
    except Exception as exc:  # noqa: BLE001 - the job's own outcome stands
        print(f"freescale {job}: warning: could not remove its checkpoints at {folder}: {one_line(exc)}",
              file=sys.stderr)
