"""Driver-side file operations through Hadoop's FileSystem API.

The jobs write wherever Spark can (local, HDFS, S3A, ABFS, GCS), so renames,
existence checks and the small JSON files go through the same API Spark uses,
reached over the py4j gateway, instead of Python's os module.

Paths in and out are Hadoop path strings (``file:/x y/ä%``, ``hdfs://nn/x``): never
percent-encoded, ``%`` literal. Where one must become a real URI (pyarrow, anything
that parses URIs), ``freescale.runtime.paths.to_uri`` converts it; no code here or in the jobs
glues a path into a URI by hand.
"""
from __future__ import annotations

from pyspark.sql import SparkSession


class HadoopFS:
    def __init__(self, spark: SparkSession):
        self._jvm = spark.sparkContext._jvm
        self._conf = spark.sparkContext._jsc.hadoopConfiguration()

    def _path(self, path: str):
        return self._jvm.org.apache.hadoop.fs.Path(path)

    def _fs(self, path: str):
        return self._path(path).getFileSystem(self._conf)

    def qualify(self, path: str) -> str:
        """Absolute path string with scheme (file:/..., hdfs://...): stable across working
        directories. Hadoop's form, not percent-encoded: ``to_uri`` makes it a URI."""
        p = self._path(path)
        return str(self._fs(path).makeQualified(p))

    def exists(self, path: str) -> bool:
        return bool(self._fs(path).exists(self._path(path)))

    def delete(self, path: str) -> None:
        if self.exists(path):
            self._fs(path).delete(self._path(path), True)

    def rename(self, src: str, dst: str) -> None:
        parent = self._path(dst).getParent()
        if parent is not None:
            self._fs(dst).mkdirs(parent)
        if not self._fs(src).rename(self._path(src), self._path(dst)):
            raise OSError(f"could not rename {src} to {dst}")

    def list_files(self, directory: str, suffix: str = "") -> list[str]:
        """Plain files directly under `directory`, sorted by name (Spark's part order)."""
        statuses = self._fs(directory).listStatus(self._path(directory))
        names = [str(s.getPath()) for s in statuses if s.isFile()]
        return sorted(n for n in names if n.endswith(suffix))

    def list_dirs(self, directory: str) -> list[str]:
        statuses = self._fs(directory).listStatus(self._path(directory))
        return sorted(str(s.getPath()) for s in statuses if s.isDirectory())

    def write_text(self, path: str, text: str) -> None:
        stream = self._fs(path).create(self._path(path), True)
        try:
            stream.write(bytearray(text.encode("utf-8")))
        finally:
            stream.close()

    def read_text(self, path: str) -> str:
        stream = self._fs(path).open(self._path(path))
        try:
            # py4j hands a Java byte[] back as Python bytes in one copy.
            data = bytes(self._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
        finally:
            stream.close()
        return data.decode("utf-8")
