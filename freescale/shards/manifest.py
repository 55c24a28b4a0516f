"""The shard manifest as a typed, validated dataclass; loaded and checked once per rank.

The balance job builds a :class:`Manifest` and writes ``manifest.json`` with
:meth:`Manifest.dumps`. A trainer that starts reading a directory written for
another world size, or one whose files were truncated by a failed copy, would
train on the wrong data for hours before anything visibly broke, so every rank
calls :func:`load_manifest` first: it parses, validates and checks its files
against the file system (``stat`` only), and the result is passed down to the
reader, the evaluator and the checkpointer. The full SHA-256 pass
(:func:`verify_checksums`) is opt-in because it reads every byte of the shard.

All failures raise :class:`ShardError` with a one-line message naming the file
or value at fault, so the launcher log points straight at the problem.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freescale.runtime.errors import InputError, one_line
from freescale.shards.schema import MANIFEST_FORMAT, MANIFEST_NAME, rank_dir

_CHUNK_BYTES = 1 << 22
CONTENT_DIGEST = "content_sha256"
"""The manifest's seal: SHA-256 of its other fields. Checksums protect the data files; this
protects the manifest, so a hand edit (a batch size, a file's sha256) is refused, not trusted."""


class ShardError(InputError):
    """A shard directory that cannot be trusted; the message is one line naming the culprit."""


@dataclass(frozen=True)
class ShardFile:
    path: str
    """Relative to the shard directory, always under ``rank=<k>/``."""
    rows: int
    bytes: int
    sha256: str | None = None


@dataclass(frozen=True)
class RankShard:
    rank: int
    rows: int
    """Rows of all its files (the samples this rank trains on, over all steps)."""
    files: tuple[ShardFile, ...]
    """In streaming order."""
    tokens: int = 0
    """Sum of history lengths."""
    cost: float = 0.0
    """Sum of predicted costs."""


@dataclass(frozen=True)
class UserFeature:
    name: str
    num_ids: int
    """Table size, id 0 (unknown) included."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ``manifest.json`` holds, in the order it is written. The first five fields and
    ``ranks`` are required; the others describe how the plan was made."""

    created_unix_s: int = 0
    world_size: int
    local_batch_size: int
    global_batch_size: int = 0
    num_steps: int
    """Steps of one pass; every rank runs all of them, empty ones included."""
    window_steps: int = 1
    strategy: str = "unknown"
    """The balancing strategy (one of ``balancing.STRATEGIES``)."""
    control: str | None = None
    """``"mirror"``: every rank holds the same samples (a noise-floor control), else None."""
    seed: int = 0
    equal_counts: bool = False
    token_cap: int | None = None
    capacities: list[float] | None = None
    cost_model: dict[str, Any] = field(default_factory=dict)
    """The cost model's JSON (``freescale.costs.cost_model.CostModel.to_json``)."""
    num_items: int
    """Item ids run 1..num_items."""
    user_features: tuple[UserFeature, ...] = ()
    input: dict[str, Any] = field(default_factory=dict)
    """``{"uri", "samples"}`` of the prepared sequences read."""
    num_samples: int = 0
    num_rows: int = 0
    leftover: dict[str, Any] = field(default_factory=dict)
    """``{"policy", "samples"}``: what the leftover policy dropped, counted."""
    moved_samples: int = 0
    columns: list[str] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    """Predicted ``bubble``, ``bubble_contiguous``, imbalance quantiles, ``plan_seconds``."""
    step_stats: str | None = None
    ranks: tuple[RankShard, ...]
    # Where it was loaded from; not written.
    root: Path | None = field(default=None, compare=False)
    sha256: str = field(default="", compare=False)
    """SHA-256 of the file's bytes: names this exact shard set (a rerun of balance gets a new one)."""

    def rank_paths(self, rank: int) -> list[Path]:
        """Absolute paths of ``rank``'s files, in streaming order."""
        assert self.root is not None, "a manifest built in memory has no directory"
        return [self.root / f.path for f in self.ranks[rank].files]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": MANIFEST_FORMAT}
        for f in dataclasses.fields(self):
            if f.name not in ("root", "sha256"):
                out[f.name] = _plain(getattr(self, f.name))
        return seal(out)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n"


def content_digest(raw: dict[str, Any]) -> str:
    """SHA-256 of every field but the seal, in a canonical JSON form (key order and spacing
    do not matter, values do)."""
    body = {k: v for k, v in raw.items() if k != CONTENT_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with its seal (re)computed: what the balance job writes."""
    return {**{k: v for k, v in raw.items() if k != CONTENT_DIGEST}, CONTENT_DIGEST: content_digest(raw)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def build_rank_shards(files: list[dict[str, Any]], totals: dict[int, dict[str, Any]],
                      world_size: int) -> tuple[RankShard, ...]:
    """Per-rank entries from described files (``path`` relative to the directory, ``rows``,
    ``bytes``, ``sha256``) and per-rank ``{"tokens", "cost"}`` totals."""
    ranks = []
    for rank in range(world_size):
        prefix = rank_dir(rank) + "/"
        own = tuple(ShardFile(f["path"], int(f["rows"]), int(f["bytes"]), f["sha256"])
                    for f in files if f["path"].startswith(prefix))
        summary = totals.get(rank, {})
        ranks.append(RankShard(rank=rank, rows=sum(f.rows for f in own), files=own,
                               tokens=int(summary.get("tokens", 0)), cost=float(summary.get("cost", 0.0))))
    return tuple(ranks)


def new_manifest(**fields: Any) -> Manifest:
    """A manifest for the balance job to write, stamped with the time."""
    return Manifest(created_unix_s=int(time.time()), **fields)


# ---------------------------------------------------------------- reading


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _user_features(raw: Any, where: Path) -> tuple[UserFeature, ...]:
    entries = raw or []
    if not isinstance(entries, list):
        raise ShardError(f"{where}: user_features should be a list, found {entries!r}")
    features = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) \
                or not _is_int(entry.get("num_ids")) or entry["num_ids"] < 1:
            raise ShardError(f"{where}: user_features entry {entry!r} needs a name and num_ids >= 1")
        features.append(UserFeature(entry["name"], entry["num_ids"]))
    names = [f.name for f in features]
    if len(set(names)) != len(names):
        raise ShardError(f"{where}: user_features repeats a name: {names}")
    return tuple(features)


def _rank_shard(entry: Any, index: int, where: Path) -> RankShard:
    if not isinstance(entry, dict) or entry.get("rank") != index:
        raise ShardError(f"{where}: ranks[{index}] should describe rank {index}, "
                         f"found {entry.get('rank') if isinstance(entry, dict) else entry!r}")
    files = entry.get("files")
    if not _is_int(entry.get("rows")) or not isinstance(files, list):
        raise ShardError(f"{where}: ranks[{index}] lacks integer 'rows' or a 'files' list")
    prefix = rank_dir(index) + "/"
    parsed = []
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) \
                or not _is_int(f.get("rows")) or not _is_int(f.get("bytes")):
            raise ShardError(f"{where}: rank {index} has a file entry without path/rows/bytes: {f!r}")
        path = f["path"]
        # A manifest is data, not code: refuse paths that would read outside the rank's directory.
        if not path.startswith(prefix) or ".." in Path(path).parts or os.path.isabs(path):
            raise ShardError(f"{where}: rank {index} lists file {path!r} outside {prefix}")
        parsed.append(ShardFile(path, f["rows"], f["bytes"], f.get("sha256")))
    total = sum(f.rows for f in parsed)
    if total != entry["rows"]:
        raise ShardError(f"{where}: rank {index} has rows={entry['rows']} but its files hold {total} rows")
    # An empty rank would "train" on empty batches for every step while its
    # peers do all the work: always a job or copy bug, never a plan.
    if total == 0:
        raise ShardError(f"rank {index} has an empty shard (0 rows) in {where.parent}")
    return RankShard(rank=index, rows=total, files=tuple(parsed), tokens=int(entry.get("tokens", 0)),
                     cost=float(entry.get("cost", 0.0)))


_REQUIRED_INTS = ("world_size", "local_batch_size", "num_steps", "num_items")
_PARSED = {"format", CONTENT_DIGEST, "ranks", "user_features", *_REQUIRED_INTS}


def parse_manifest(raw: Any, where: Path, *, sha256: str = "") -> Manifest:
    """Validate parsed JSON into a :class:`Manifest`; ``where`` names the file in errors."""
    if not isinstance(raw, dict):
        raise ShardError(f"{where} is not a JSON object")
    if raw.get("format") != MANIFEST_FORMAT:
        raise ShardError(f"{where} has format {raw.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    for key in _REQUIRED_INTS:
        if not _is_int(raw.get(key)) or raw[key] <= 0:
            raise ShardError(f"{where}: {key} must be a positive integer, found {raw.get(key)!r}")
    ranks = raw.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != raw["world_size"]:
        raise ShardError(f"{where}: 'ranks' should list {raw['world_size']} ranks, "
                         f"found {len(ranks) if isinstance(ranks, list) else ranks!r}")
    if raw.get(CONTENT_DIGEST) != content_digest(raw):
        raise ShardError(f"{where} was changed after the balance job wrote it ({CONTENT_DIGEST} does not "
                         "match its fields): rerun `freescale balance` rather than editing it")
    known = {f.name for f in dataclasses.fields(Manifest)} - {"root", "sha256"}
    unknown = sorted(set(raw) - known - {"format", CONTENT_DIGEST})
    if unknown:
        raise ShardError(f"{where}: unknown field {unknown[0]!r} (written by a newer FreeScale?)")
    rest = {k: v for k, v in raw.items() if k not in _PARSED}
    hints = typing.get_type_hints(Manifest)
    for key, value in rest.items():
        if not _matches(value, hints[key]):
            raise ShardError(f"{where}: {key} should be {hints[key]}, found {value!r}")
    manifest = Manifest(**{k: raw[k] for k in _REQUIRED_INTS}, **rest,
                        user_features=_user_features(raw.get("user_features"), where),
                        ranks=tuple(_rank_shard(e, i, where) for i, e in enumerate(ranks)),
                        root=where.parent, sha256=sha256)
    _check_counts(manifest, where)
    return manifest


def _check_counts(m: Manifest, where: Path) -> None:
    """The manifest's totals against each other and its files' row counts (no data read).

    Every step holds a full global batch except perhaps the last (the window planner swaps
    samples 1-for-1, so step sizes never change); under the mirror control every rank holds
    the same ``local_batch_size`` samples per step.
    """
    rows = sum(r.rows for r in m.ranks)
    g = m.world_size * m.local_batch_size
    if m.global_batch_size and m.global_batch_size != g:
        raise ShardError(f"{where}: global_batch_size {m.global_batch_size} is not world_size {m.world_size} "
                         f"x local_batch_size {m.local_batch_size}")
    if m.num_rows and m.num_rows != rows:
        raise ShardError(f"{where}: num_rows {m.num_rows} but the ranks' files hold {rows} rows")
    if m.control == "mirror":
        if rows != m.world_size * m.num_steps * m.local_batch_size:
            raise ShardError(f"{where}: {rows} rows do not fill {m.num_steps} steps x {m.world_size} ranks x "
                             f"local_batch_size {m.local_batch_size} (mirror control)")
    elif not (m.num_steps - 1) * g < rows <= m.num_steps * g:
        raise ShardError(f"{where}: {rows} rows do not fit {m.num_steps} steps of world_size {m.world_size} x "
                         f"local_batch_size {m.local_batch_size} = {g} (every step but the last is full)")


def _matches(value: Any, hint: Any) -> bool:
    """Shallow check of a JSON value against a field's annotation (containers by kind only)."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is not None:
        return isinstance(value, list if origin is tuple else origin)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return _is_int(value)
    return isinstance(value, hint)


def load_manifest(shards_dir: str | os.PathLike[str], world_size: int | None = None,
                  rank: int | None = None) -> Manifest:
    """Read and validate ``<shards_dir>/manifest.json`` for a launch of ``world_size`` ranks
    (None: the manifest's own, for readers that launch nothing themselves).

    Checks the format tag, that the manifest was written for exactly this world
    size, that its per-rank entries are consistent, that no rank is empty, and
    that every file of ``rank`` (of all ranks when ``rank`` is None) exists with
    the byte size the job recorded.
    """
    root = Path(shards_dir)
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ShardError(f"no {MANIFEST_NAME} in shard directory {root} (not a balance job output, "
                         f"or the job did not finish)")
    try:
        data = path.read_bytes()
        raw = json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardError(f"cannot parse {path}: {one_line(exc)}") from exc
    manifest = parse_manifest(raw, path, sha256=hashlib.sha256(data).hexdigest())
    world_size = manifest.world_size if world_size is None else world_size
    if manifest.world_size != world_size:
        raise ShardError(f"{path} was written for world size {manifest.world_size} "
                         f"but this launch has world size {world_size}")
    if rank is not None and not 0 <= rank < world_size:
        raise ShardError(f"rank {rank} is outside world size {world_size} for shard directory {root}")
    for k in range(world_size) if rank is None else (rank,):
        for entry, file_path in zip(manifest.ranks[k].files, manifest.rank_paths(k)):
            try:
                size = file_path.stat().st_size
            except FileNotFoundError:
                raise ShardError(f"shard file {file_path} of rank {k} is missing") from None
            if size != entry.bytes:
                raise ShardError(f"shard file {file_path} has {size} bytes, manifest says {entry.bytes} "
                                 f"(truncated or overwritten)")
    return manifest


def verify_checksums(manifest: Manifest, rank: int) -> None:
    """Recompute the SHA-256 of every file of ``rank`` and compare with the manifest.

    Reads the whole shard once, so it is optional (``data.verify_checksums``);
    the size check in :func:`load_manifest` catches truncation for free.
    """
    for entry, path in zip(manifest.ranks[rank].files, manifest.rank_paths(rank)):
        if not isinstance(entry.sha256, str):
            raise ShardError(f"manifest has no sha256 for shard file {path}")
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as handle:
                while chunk := handle.read(_CHUNK_BYTES):
                    digest.update(chunk)
        except OSError as exc:
            raise ShardError(f"cannot read shard file {path}: {one_line(exc)}") from exc
        if digest.hexdigest() != entry.sha256.lower():
            raise ShardError(f"shard file {path} has sha256 {digest.hexdigest()[:16]}..., "
                             f"manifest says {entry.sha256[:16]}... (corrupted)")
