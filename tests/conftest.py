"""Shared fixtures: one local SparkSession per test run (Spark takes ~10 s to start)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MOVIELENS_DIR = (REPO_ROOT / ".." / "shared" / "data" / "movielens-100k").resolve()

# Jobs' Spark progress lines (pipeline/progress.py) off: tests count a job's stderr lines, and a
# loaded machine would make a stage long enough to print one. tests/test_progress.py turns it on.
os.environ.setdefault("FREESCALE_PROGRESS", "0")


@pytest.fixture(scope="session")
def spark():
    from pipeline.session import build_spark_session

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = build_spark_session(master="local[2]", app_name="freescale-tests")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def movielens_dir() -> Path:
    if not (MOVIELENS_DIR / "ratings.parquet").exists():
        pytest.fail(f"MovieLens-100K not found at {MOVIELENS_DIR} (expected ../shared/data/movielens-100k)")
    return MOVIELENS_DIR


@pytest.fixture(scope="session")
def movielens_prepared(spark, movielens_dir, tmp_path_factory) -> Path:
    """MovieLens-100K with its user features through the real prepare job (shared by the job
    and trainer tests)."""
    from jobs import prepare

    out = tmp_path_factory.mktemp("ml") / "prepared"
    assert prepare.main(["--input", str(movielens_dir / "ratings.parquet"), "--output", str(out),
                         "--user-features", str(movielens_dir / "users.parquet"), "--tracking-uri", "none"]) == 0
    return out


@pytest.fixture(scope="session")
def movielens_shards(spark, movielens_prepared, tmp_path_factory) -> Path:
    """2-rank balanced shards of MovieLens-100K (kk, 16 samples per rank per step)."""
    from jobs import balance

    out = tmp_path_factory.mktemp("ml-shards") / "kk"
    assert balance.main(["--input", str(movielens_prepared), "--output", str(out), "--world-size", "2",
                         "--local-batch-size", "16", "--tracking-uri", "none"]) == 0
    return out


@pytest.fixture(scope="session")
def movielens_comparison(spark, movielens_prepared, tmp_path_factory):
    """One real `freescale compare` (jobs.compare.main) on MovieLens-100K: 2 ranks x 16 samples,
    3 repeats of contiguous / balanced (kk) / mirror control, a few steps of a one-layer model
    (evaluated on 64 samples per rank),
    recorded in a fresh sqlite MLflow store. Attributes: tracking_uri, db_path, experiment_id,
    parent_run_id, child_run_ids ({variant: [run id per repeat]}), summary (the --summary-json
    content), workdir."""
    import json
    from types import SimpleNamespace

    from jobs import compare

    root = tmp_path_factory.mktemp("comparison")
    db_path = root / "mlflow.db"
    tracking_uri = f"sqlite:///{db_path}"
    summary_json = root / "comparison.json"
    rc = compare.main(["--input", str(movielens_prepared), "--world-size", "2", "--local-batch-size", "16",
                       "--repeats", "3", "--control", "--max-steps", "8", "--workdir", str(root / "work"),
                       "--summary-json", str(summary_json), "--tracking-uri", tracking_uri,
                       "--model.hstu.num_layers", "1", "--loss.num_negatives", "32",
                       "--training.eval_max_samples", "64", "--training.log_every", "1000"])
    assert rc == 0, f"freescale compare exited {rc} (logs in {root / 'work'})"
    summary = json.loads(summary_json.read_text())
    return SimpleNamespace(
        tracking_uri=tracking_uri, db_path=db_path, experiment_id=summary["experiment_id"],
        parent_run_id=summary["parent_run_id"], workdir=root / "work", summary=summary,
        child_run_ids={variant: [run["run_id"] for run in runs] for variant, runs in summary["runs"].items()})


@pytest.fixture
def other_process():
    """A live process that is not this one (the holder of someone else's lock)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on a fresh sqlite store; its address."""
    from tests.mlflow_server import mlflow_server as serve

    with serve(f"sqlite:///{tmp_path / 'server.db'}", tmp_path) as address:
        yield address
