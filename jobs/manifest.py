"""The shard manifest: what a trainer needs to trust a shard directory before reading it."""
from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from pyspark.sql import SparkSession

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "freescale.shards/1"
RANK_DIR = "rank={rank}"


def arrow_uri(path: str) -> str:
    """Hadoop writes local paths as file:/x; pyarrow wants file:///x."""
    if path.startswith("file:/") and not path.startswith("file:///"):
        return "file://" + path[len("file:"):]
    return path


def describe_file(uri: str) -> dict[str, Any]:
    """Size, SHA-256 and Parquet row count of one file (runs on an executor)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, path = pafs.FileSystem.from_uri(arrow_uri(uri))
    digest = hashlib.sha256()
    size = 0
    with fs.open_input_stream(path) as stream:
        while chunk := stream.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    with fs.open_input_file(path) as handle:
        rows = pq.ParquetFile(handle).metadata.num_rows
    return {"uri": uri, "bytes": size, "sha256": digest.hexdigest(), "rows": rows}


def describe_files(spark: SparkSession, uris: list[str]) -> list[dict[str, Any]]:
    """Checksums computed in parallel on the executors; returned in the order given."""
    if not uris:
        return []
    slices = min(len(uris), max(1, spark.sparkContext.defaultParallelism * 2))
    described = spark.sparkContext.parallelize(uris, slices).map(describe_file).collect()
    by_uri = {d["uri"]: d for d in described}
    return [by_uri[u] for u in uris]


def relative_to(root: str, uri: str) -> str:
    root = root.rstrip("/") + "/"
    if not uri.startswith(root):
        raise ValueError(f"{uri} is not under {root}")
    return uri[len(root):]


def build_manifest(*, root: str, files: list[dict[str, Any]], rank_summaries: dict[int, dict[str, Any]],
                   world_size: int, **fields: Any) -> dict[str, Any]:
    """Assemble the manifest; `fields` are job parameters and statistics recorded as given."""
    ranks = []
    for rank in range(world_size):
        prefix = RANK_DIR.format(rank=rank) + "/"
        rank_files = [
            {"path": relative_to(root, f["uri"]), "rows": f["rows"], "bytes": f["bytes"], "sha256": f["sha256"]}
            for f in files if relative_to(root, f["uri"]).startswith(prefix)
        ]
        summary = rank_summaries.get(rank, {})
        ranks.append({
            "rank": rank,
            "rows": sum(f["rows"] for f in rank_files),
            "tokens": int(summary.get("tokens", 0)),
            "cost": float(summary.get("cost", 0.0)),
            "files": rank_files,
        })
    return {
        "format": MANIFEST_FORMAT,
        "created_unix_s": int(time.time()),
        "world_size": world_size,
        **fields,
        "ranks": ranks,
    }


def dumps(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, indent=2, sort_keys=False) + "\n"
