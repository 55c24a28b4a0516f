"""balance of MovieLens-100K through spark-submit on local Spark (prepare through spark-submit is
tests/jobs/test_cluster.py's, on a cluster; here the session's prepare is the input)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_manifest, read_all

pytestmark = pytest.mark.extended  # docs/testing.md: the extended tier

REPO = Path(__file__).resolve().parents[2]


def spark_submit(script: str, *args: str) -> subprocess.CompletedProcess:
    submit = Path(sys.executable).parent / "spark-submit"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    return subprocess.run([str(submit), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
                           str(REPO / "freescale" / "jobs" / script), *args, "--tracking-uri", "none"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.mark.slow
def test_movielens_balance_via_spark_submit(movielens_prepared, tmp_path):
    shards = tmp_path / "shards"
    run = spark_submit("balance.py", "--input", str(movielens_prepared), "--output", str(shards), "--world-size", "8",
                       "--local-batch-size", "16", "--strategy", "ortools", "--window-steps", "4",
                       "--time-limit", "0.5")
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = load_manifest(shards)
    rows = read_all(shards)
    assert rows["user_id"].is_unique
    assert len(rows) + manifest["leftover"]["samples"] == 943
    assert manifest["strategy"] == "ortools" and manifest["world_size"] == 8
    assert manifest["stats"]["bubble"] < manifest["stats"]["bubble_contiguous"]
    # Quiet as under `freescale`: Spark logs at ERROR from its SparkContext's start (spark.log.level;
    # freescale/runtime/session.py), so its stream (the JVM's stderr; the job's own lines are on stdout)
    # ends with its note of that setting.
    spark = run.stderr.splitlines()
    assert spark and spark[-1] == 'Setting Spark log level to "ERROR".', spark[-5:]


@pytest.mark.slow
def test_spark_submit_bad_input_is_one_line(tmp_path):
    run = spark_submit("balance.py", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o"),
                       "--world-size", "2", "--local-batch-size", "4")
    assert run.returncode == 2
    # spark-submit's PythonRunner merges the driver's stderr into its stdout
    output = (run.stdout + run.stderr).splitlines()
    errors = [line for line in output if line.startswith("freescale balance: error:")]
    assert len(errors) == 1 and "missing" in errors[0]
    assert not (tmp_path / "o").exists()
