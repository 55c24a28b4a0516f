"""Test helper: read a balance job's output back with pyarrow, independently of Spark."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq


def load_manifest(shards: Path) -> dict:
    return json.loads((shards / "manifest.json").read_text())


def read_rank(shards: Path, rank: int) -> pd.DataFrame:
    """Rows of one rank in file order (the order the trainer will stream them)."""
    manifest = load_manifest(shards)
    files = manifest["ranks"][rank]["files"]
    frames = [pq.read_table(shards / f["path"]).to_pandas() for f in files]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    frame["rank"] = rank
    return frame


def read_all(shards: Path) -> pd.DataFrame:
    manifest = load_manifest(shards)
    return pd.concat([read_rank(shards, r) for r in range(manifest["world_size"])], ignore_index=True)
