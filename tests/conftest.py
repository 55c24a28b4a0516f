"""Shared fixtures: one local SparkSession per test run (Spark takes ~10 s to start)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MOVIELENS_DIR = (REPO_ROOT / ".." / "shared" / "data" / "movielens-100k").resolve()


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
