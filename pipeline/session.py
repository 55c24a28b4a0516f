"""SparkSession construction shared by the jobs and the tests."""
from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession


def under_spark_submit() -> bool:
    """spark-submit launches the Python driver with a gateway already listening."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def build_spark_session(master: str | None = None, app_name: str = "freescale") -> SparkSession:
    """Get or create a session.

    Under spark-submit the launcher's --master and --conf win; otherwise `master`
    defaults to local[*] with a small shuffle width suited to one machine.
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
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
