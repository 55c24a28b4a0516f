"""Cluster and storage errors are one line saying what to do, and exit 3 (freescale/runtime/spark_errors.py,
freescale/runtime/session.py: check_master). The Java texts are those of real runs (py4j's Py4JJavaError:
the JVM's exception and its "Caused by:" chain), cut to the lines that matter."""
from __future__ import annotations

import errno
import socket
import time

import pytest

from freescale.runtime import job_errors
from freescale.runtime.job_errors import EXIT_ENVIRONMENT
from freescale.runtime.spark_errors import spark_hadoop_version

# `freescale balance --output` on a 2 MiB tmpfs (mount -t tmpfs -o size=2M tmpfs DIR), Spark 4.3.
FULL_DISK = """An error occurred while calling o625.parquet.
: org.apache.spark.SparkException: [TASK_WRITE_FAILED] Task failed while writing rows to \
file:/data/full/shards.tmp-1c36b3dfaacb/_temporary/0/_temporary/attempt_202612050559399008836428500880390_0067_m_000001_51\
/rank=0/part-00001-584cd81f-edee-4ac6-986a-60b76af17be6.c000.snappy.parquet. SQLSTATE: 58030
\tat org.apache.spark.sql.errors.QueryExecutionErrors$.taskFailedWhileWritingRowsError(QueryExecutionErrors.scala:823)
Caused by: org.apache.hadoop.fs.FSError: java.io.IOException: No space left on device
\tat org.apache.hadoop.fs.RawLocalFileSystem$LocalFSFileOutputStream.write(RawLocalFileSystem.java:549)
Caused by: java.io.IOException: No space left on device
\tat java.base/java.io.FileOutputStream.writeBytes(Native Method)
"""
# `freescale balance --input s3a://bucket/prep` with pyspark's own jars (no hadoop-aws).
NO_S3A = """An error occurred while calling o40.getFileSystem.
: java.lang.RuntimeException: java.lang.ClassNotFoundException: Class org.apache.hadoop.fs.s3a.S3AFileSystem not found
\tat org.apache.hadoop.conf.Configuration.getClass(Configuration.java:2724)
Caused by: java.lang.ClassNotFoundException: Class org.apache.hadoop.fs.s3a.S3AFileSystem not found
\tat org.apache.hadoop.conf.Configuration.getClassByName(Configuration.java:2628)
"""
# spark-submit --master spark://127.0.0.1:1 freescale/jobs/prepare.py, after Spark's minute of registration tries.
STOPPED = """An error occurred while calling None.org.apache.spark.sql.classic.SparkSession.
: java.lang.IllegalStateException: Cannot call methods on a stopped SparkContext.
"""


class Py4JJavaError(Exception):
    """py4j's, as its text reads (the real one asks the JVM for it)."""


def test_a_full_disk_names_the_output_not_its_staging_folder():
    error = Py4JJavaError(FULL_DISK)
    assert job_errors.exit_code(error) == EXIT_ENVIRONMENT
    assert job_errors.first_line(error) == "the disk is full: no space left on the device under /data/full/shards"
    local = OSError(errno.ENOSPC, "No space left on device", "/data/full/shards.tmp-1c36b3dfaacb/manifest.json")
    assert job_errors.exit_code(local) == EXIT_ENVIRONMENT
    assert job_errors.first_line(local) == "the disk is full: no space left on the device under /data/full/shards"


def test_s3a_without_hadoop_aws_names_the_package_and_the_flag():
    import pyspark  # noqa: F401 - the version comes from its jars

    hadoop = spark_hadoop_version()
    assert hadoop and hadoop[0].isdigit()
    error = Py4JJavaError(NO_S3A)
    assert job_errors.exit_code(error) == EXIT_ENVIRONMENT
    assert job_errors.first_line(error) == (
        f"Spark has no Hadoop file system for s3a:// paths: it comes with org.apache.hadoop:hadoop-aws:{hadoop}; "
        f"run the job with spark-submit --packages org.apache.hadoop:hadoop-aws:{hadoop} (Spark's Hadoop is {hadoop})")


def test_a_scheme_hadoop_does_not_know_names_the_scheme_and_the_flag():
    error = Py4JJavaError('An error occurred while calling o40.getFileSystem.\n: org.apache.hadoop.fs.'
                          'UnsupportedFileSystemException: No FileSystem for scheme "gs"\n')
    assert job_errors.exit_code(error) == EXIT_ENVIRONMENT
    line = job_errors.first_line(error)
    assert "gs://" in line and "spark-submit --packages" in line


def test_a_stopped_context_is_the_cluster_s_doing_not_local_spark_s(monkeypatch):
    from pyspark import SparkContext

    class Context:
        master = "spark://master:7077"

    monkeypatch.setattr(SparkContext, "_active_spark_context", Context())
    error = Py4JJavaError(STOPPED)
    assert job_errors.exit_code(error) == EXIT_ENVIRONMENT
    assert job_errors.first_line(error).startswith("Spark stopped under the job (master spark://master:7077)")
    Context.master = "local[2]"
    assert job_errors.exit_code(error) == job_errors.EXIT_FAILED


def _closed_port() -> int:
    """A local port nothing listens on (bound, then let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_master_that_takes_no_connection_fails_in_a_second_naming_it():
    from freescale.runtime.errors import ServiceUnavailable
    from freescale.runtime.spark_master import check_master

    master = f"spark://127.0.0.1:{_closed_port()}"
    started = time.perf_counter()
    with pytest.raises(ServiceUnavailable, match=f"Spark master {master} does not answer"):
        check_master(master)
    assert time.perf_counter() - started < 1
    with socket.socket() as listening:  # a standby pair: one answering is enough
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_master(f"spark://127.0.0.1:{_closed_port()},127.0.0.1:{listening.getsockname()[1]}")
    for other in ("local[2]", "yarn", "k8s://https://127.0.0.1:1", None):
        check_master(other)


def test_prepare_on_a_master_that_takes_no_connection_is_one_line_and_exit_3(tmp_path, capsys):
    """Before Spark or MLflow starts: a second, not Spark's minute of registration tries and 184 lines."""
    from freescale.jobs import prepare

    master = f"spark://127.0.0.1:{_closed_port()}"
    started = time.perf_counter()
    rc = prepare.main(["--output", str(tmp_path / "out"), "--synthetic-users", "10", "--master", master,
                       "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"])
    assert time.perf_counter() - started < 1
    assert rc == EXIT_ENVIRONMENT
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"freescale prepare: error: Spark master {master} does not answer")
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()  # no run opened


def test_balance_on_s3a_without_hadoop_aws_is_one_line_and_exit_3(spark, tmp_path, capsys):
    from freescale.jobs import balance

    rc = balance.main(["--input", "s3a://bucket/prep", "--output", str(tmp_path / "shards"), "--world-size", "2",
                       "--local-batch-size", "4", "--tracking-uri", "none"])
    assert rc == EXIT_ENVIRONMENT
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "s3a://" in lines[0] and "spark-submit --packages org.apache.hadoop:hadoop-aws:" in lines[0]
