"""What the manifest records of each shard file (size, SHA-256, Parquet row count), computed on
Spark's executors. The manifest itself is ``freescale.shards.manifest``; pyspark is only needed by
``describe_files``, which is handed a running session."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from freescale.runtime.paths import to_uri

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def arrow_uri(path: str) -> str:
    """Hadoop prints a local path as file:/x, never percent-encoded; pyarrow wants a real URI
    (file:///x, a space as %20): ``freescale.runtime.paths.to_uri``, the one conversion."""
    return to_uri(path)


def describe_file(uri: str) -> dict[str, Any]:
    """Size, SHA-256 and Parquet row count of one file (runs on an executor).

    ``uri`` is a Hadoop path string as ``HadoopFS.list_files`` returns it, and comes back
    unchanged as the result's ``uri``."""
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
