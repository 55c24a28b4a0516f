"""Spark errors that the machine or the cluster caused, not the input: each becomes one line saying
what to do, and exit 3 (freescale/runtime/job_errors.py).

    a full disk                  "No space left on device" anywhere in the error (a task writing the
                                 output, the driver, a Python worker)
    a file system Spark lacks    s3a:// without hadoop-aws (ClassNotFoundException: S3AFileSystem),
                                 or any scheme Hadoop has no FileSystem for
    a stopped SparkContext       the cluster manager gave the application up (a master that stopped
                                 answering, executors that never came); not on local Spark

A master that does not answer at all is caught before Spark starts (freescale.runtime.spark_master.check_master).
Standard library only: the texts are those of py4j's Py4JJavaError (the JVM's exception and its
"Caused by:" chain) and of Python's own errors.
"""
from __future__ import annotations

import errno
import os
import re
import sys
from pathlib import Path

from freescale.runtime.atomic_output import staged_output
from freescale.runtime.paths import local_path

NO_SPACE = "No space left on device"
# Spark's TASK_WRITE_FAILED names the file a task was writing: "... writing rows to file:/out.tmp-ab/x.parquet."
_WRITING_TO = re.compile(r"writing rows to (\S+?)\.?(?:\s|$)")
_MISSING_CLASS = re.compile(r"ClassNotFoundException: Class ([\w.$]+) not found")
_NO_SCHEME = re.compile(r"No FileSystem for scheme \"?([\w+.-]+)\"?")
# Hadoop file systems that Spark's own jars leave out: scheme -> (its FileSystem class, the Maven
# package that provides it). Both packages are released with Hadoop: the version must be Spark's Hadoop's.
HADOOP_FILE_SYSTEMS = {
    "s3a": ("org.apache.hadoop.fs.s3a.S3AFileSystem", "org.apache.hadoop:hadoop-aws"),
    "abfs": ("org.apache.hadoop.fs.azurebfs.AzureBlobFileSystem", "org.apache.hadoop:hadoop-azure"),
    "abfss": ("org.apache.hadoop.fs.azurebfs.SecureAzureBlobFileSystem", "org.apache.hadoop:hadoop-azure"),
}
_STOPPED_CONTEXT = ("Cannot call methods on a stopped SparkContext", "SparkContext was shut down")
_HADOOP_JAR = re.compile(r"^hadoop-(?:client-api|common)-(\d[\w.-]*)\.jar$")


def environment_message(exc: BaseException) -> str | None:
    """The one line for an error the machine or the cluster caused; None for any other error."""
    text = error_text(exc)
    return disk_full(exc, text) or missing_file_system(text) or stopped_context(text)


def error_text(exc: BaseException) -> str:
    """``str(exc)``; for a py4j error that asks the JVM, and a JVM that is gone gives no text ("")."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - the JVM died with the job: nothing to classify
        return ""


def disk_full(exc: BaseException, text: str) -> str | None:
    """The disk the job writes to is full: the line names where it was writing (the job's output, not
    its staging folder), when the error says."""
    if not (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) and NO_SPACE not in text:
        return None
    written = getattr(exc, "filename", None)
    if written is None:
        match = _WRITING_TO.search(text)
        written = match.group(1) if match else None
    if written is None:
        return f"the disk is full ({NO_SPACE})"
    written = staged_output(str(written)) or str(written)
    return f"the disk is full: no space left on the device under {local_path(written) or written}"


def missing_file_system(text: str) -> str | None:
    """A path whose scheme this Spark has no Hadoop FileSystem for: the scheme, the package that
    provides it and how to add it."""
    scheme = _scheme_of_missing_class(text)
    if scheme is None:
        match = _NO_SCHEME.search(text)
        scheme = match.group(1) if match else None
    if scheme is None:
        return None
    if scheme not in HADOOP_FILE_SYSTEMS:
        return (f"Spark has no Hadoop file system for {scheme}:// paths: add the package that provides it "
                "with spark-submit --packages GROUP:ARTIFACT:VERSION (or its jar with --jars)")
    hadoop = spark_hadoop_version()
    package = f"{HADOOP_FILE_SYSTEMS[scheme][1]}:{hadoop or 'VERSION'}"
    version_note = f"Spark's Hadoop is {hadoop}" if hadoop else "VERSION: the Hadoop version Spark ships"
    return (f"Spark has no Hadoop file system for {scheme}:// paths: it comes with {package}; run the job with "
            f"spark-submit --packages {package} ({version_note})")


def _scheme_of_missing_class(text: str) -> str | None:
    match = _MISSING_CLASS.search(text)
    if match is None:
        return None
    return next((scheme for scheme, (cls, _) in HADOOP_FILE_SYSTEMS.items() if cls == match.group(1)), None)


def spark_hadoop_version() -> str | None:
    """The Hadoop version of the Spark this process runs (its jars' names), None when not found."""
    for folder in _spark_jar_folders():
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in sorted(names):
            match = _HADOOP_JAR.match(name)
            if match:
                return match.group(1)
    return None


def _spark_jar_folders() -> list[Path]:
    """$SPARK_HOME/jars (spark-submit sets SPARK_HOME), then the pip-installed pyspark's jars."""
    folders = [Path(os.environ["SPARK_HOME"]) / "jars"] if os.environ.get("SPARK_HOME") else []
    pyspark = sys.modules.get("pyspark")
    if pyspark is not None and getattr(pyspark, "__file__", None):
        folders.append(Path(pyspark.__file__).parent / "jars")
    return folders


def stopped_context(text: str) -> str | None:
    """The cluster manager gave the application up (a master that stopped answering, no executors):
    every later call fails with a stopped SparkContext. The line names the master; the log says why.
    On local Spark there is no cluster manager: a stopped context there is the driver's own failure
    (exit 1, its message as it is)."""
    master = spark_master_in_use()
    if not master or master.startswith("local") or not any(marker in text for marker in _STOPPED_CONTEXT):
        return None
    return (f"Spark stopped under the job (master {master}): the cluster manager ended the application; "
            "its reason is in the log")


def spark_master_in_use() -> str | None:
    """The master of this process's SparkContext, from PySpark's own copy (no JVM call: the JVM may be
    gone); None without one."""
    pyspark = sys.modules.get("pyspark")
    context = getattr(getattr(pyspark, "SparkContext", None), "_active_spark_context", None)
    return getattr(context, "master", None)
