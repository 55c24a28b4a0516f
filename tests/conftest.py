"""Shared fixtures: one local SparkSession per test run (Spark takes ~10 s to start)."""
from __future__ import annotations

import os
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
