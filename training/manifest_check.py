"""Trust a shard directory before training on it.

The balance job (``jobs/balance.py``) writes ``manifest.json`` next to
``rank=<k>/part-*.parquet``. A trainer that starts reading a directory written
for another world size, or one whose files were truncated by a failed copy,
would train on the wrong data for hours before anything visibly broke, so every
rank checks the manifest against its launch and the file system first. These
checks read only metadata (``stat``); the full SHA-256 pass is opt-in because it
reads every byte of the rank's shard.

All failures raise :class:`ShardError` with a one-line message naming the file
or value at fault, so the launcher log points straight at the problem.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "freescale.shards/1"
RANK_DIR = "rank={rank}"

# Keys a trainer cannot work without; the manifest carries more (stats, cost model).
_REQUIRED_INT_FIELDS = ("world_size", "local_batch_size", "num_steps", "num_items")

_CHUNK_BYTES = 1 << 22


class ShardError(ValueError):
    """A shard directory that cannot be trusted; the message is one line naming the culprit."""


def one_line(error: BaseException | str) -> str:
    """Arrow and OS errors can span lines; launcher logs are grepped one line per failure."""
    return " ".join(str(error).split())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_rank_entry(entry: Any, index: int, manifest_path: Path) -> None:
    if not isinstance(entry, dict) or entry.get("rank") != index:
        raise ShardError(f"{manifest_path}: ranks[{index}] should describe rank {index}, "
                         f"found {entry.get('rank') if isinstance(entry, dict) else entry!r}")
    files = entry.get("files")
    if not _is_int(entry.get("rows")) or not isinstance(files, list):
        raise ShardError(f"{manifest_path}: ranks[{index}] lacks integer 'rows' or a 'files' list")
    prefix = RANK_DIR.format(rank=index) + "/"
    total = 0
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) \
                or not _is_int(f.get("rows")) or not _is_int(f.get("bytes")):
            raise ShardError(f"{manifest_path}: rank {index} has a file entry without path/rows/bytes: {f!r}")
        path = f["path"]
        # A manifest is data, not code: refuse paths that would read outside the rank's directory.
        if not path.startswith(prefix) or ".." in Path(path).parts or os.path.isabs(path):
            raise ShardError(f"{manifest_path}: rank {index} lists file {path!r} outside {prefix}")
        total += f["rows"]
    if total != entry["rows"]:
        raise ShardError(f"{manifest_path}: rank {index} has rows={entry['rows']} but its files hold {total} rows")


def user_feature_sizes(manifest: dict[str, Any], manifest_path: str | os.PathLike[str] = MANIFEST_NAME
                       ) -> list[tuple[str, int]]:
    """``[(feature name, table size)]`` from the manifest's ``user_features`` (empty when absent)."""
    entries = manifest.get("user_features") or []
    if not isinstance(entries, list):
        raise ShardError(f"{manifest_path}: user_features should be a list, found {entries!r}")
    sizes = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                or not _is_int(entry.get("num_ids")) or entry["num_ids"] < 1:
            raise ShardError(f"{manifest_path}: user_features entry {entry!r} needs a name and num_ids >= 1")
        sizes.append((entry["name"], entry["num_ids"]))
    if len({name for name, _ in sizes}) != len(sizes):
        raise ShardError(f"{manifest_path}: user_features repeats a name: {[n for n, _ in sizes]}")
    return sizes


def rank_files(manifest: dict[str, Any], shards_dir: str | os.PathLike[str], rank: int) -> list[dict[str, Any]]:
    """The manifest's file entries of ``rank``, with ``abspath`` added, in streaming order."""
    root = Path(shards_dir)
    return [{**f, "abspath": root / f["path"]} for f in manifest["ranks"][rank]["files"]]


def load_manifest(shards_dir: str | os.PathLike[str], world_size: int, rank: int | None = None) -> dict[str, Any]:
    """Read and validate ``<shards_dir>/manifest.json`` for a launch of ``world_size`` ranks.

    Checks the format tag, that the manifest was written for exactly this world
    size, that its per-rank entries are consistent, that no rank is empty, and
    that every file of ``rank`` (of all ranks when ``rank`` is None) exists with
    the byte size the job recorded. Returns the parsed manifest.
    """
    root = Path(shards_dir)
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ShardError(f"no {MANIFEST_NAME} in shard directory {root} (not a balance job output, "
                         f"or the job did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardError(f"cannot parse {manifest_path}: {one_line(exc)}") from exc
    if not isinstance(manifest, dict):
        raise ShardError(f"{manifest_path} is not a JSON object")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ShardError(f"{manifest_path} has format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    for key in _REQUIRED_INT_FIELDS:
        if not _is_int(manifest.get(key)) or manifest[key] <= 0:
            raise ShardError(f"{manifest_path}: {key} must be a positive integer, found {manifest.get(key)!r}")
    if manifest["world_size"] != world_size:
        raise ShardError(f"{manifest_path} was written for world size {manifest['world_size']} "
                         f"but this launch has world size {world_size}")
    if rank is not None and not 0 <= rank < world_size:
        raise ShardError(f"rank {rank} is outside world size {world_size} for shard directory {root}")

    user_feature_sizes(manifest, manifest_path)
    ranks = manifest.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != world_size:
        raise ShardError(f"{manifest_path}: 'ranks' should list {world_size} ranks, "
                         f"found {len(ranks) if isinstance(ranks, list) else ranks!r}")
    for index, entry in enumerate(ranks):
        _check_rank_entry(entry, index, manifest_path)
        # An empty rank would "train" on empty batches for every step while its
        # peers do all the work: always a job or copy bug, never a plan.
        if entry["rows"] == 0:
            raise ShardError(f"rank {index} has an empty shard (0 rows) in {root}")

    for k in range(world_size) if rank is None else (rank,):
        for f in rank_files(manifest, root, k):
            path: Path = f["abspath"]
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise ShardError(f"shard file {path} of rank {k} is missing") from None
            if size != f["bytes"]:
                raise ShardError(f"shard file {path} has {size} bytes, manifest says {f['bytes']} "
                                 f"(truncated or overwritten)")
    return manifest


def manifest_sha256(shards_dir: str | os.PathLike[str]) -> str:
    """SHA-256 of the manifest file: names this exact shard set (a rerun of balance gets a new one)."""
    return hashlib.sha256((Path(shards_dir) / MANIFEST_NAME).read_bytes()).hexdigest()


def verify_checksums(manifest: dict[str, Any], shards_dir: str | os.PathLike[str], rank: int) -> None:
    """Recompute the SHA-256 of every file of ``rank`` and compare with the manifest.

    Reads the whole shard once, so it is optional (``build_loader(verify=True)``);
    the size check in :func:`load_manifest` catches truncation for free.
    """
    for f in rank_files(manifest, shards_dir, rank):
        path: Path = f["abspath"]
        expected = f.get("sha256")
        if not isinstance(expected, str):
            raise ShardError(f"manifest has no sha256 for shard file {path}")
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as handle:
                while chunk := handle.read(_CHUNK_BYTES):
                    digest.update(chunk)
        except OSError as exc:
            raise ShardError(f"cannot read shard file {path}: {one_line(exc)}") from exc
        if digest.hexdigest() != expected.lower():
            raise ShardError(f"shard file {path} has sha256 {digest.hexdigest()[:16]}..., "
                             f"manifest says {expected[:16]}... (corrupted)")
