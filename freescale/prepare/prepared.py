"""The prepared-data format, `freescale prepare`'s output, as freescale/shards/schema.py is the shards':

    <prepared>/sequences/            one row per user (freescale.shards.spark_balance.REQUIRED_COLUMNS and more);
                                     after --previous, only the users the new logs touch
    <prepared>/history/              one row per user, short ones too: the state a later --previous extends
                                     (freescale.prepare.sequences.STATE_COLUMNS, and user_features with them)
    <prepared>/item_vocab/           raw item -> contiguous id
    <prepared>/user_feature_vocab/   with user features: each feature's value -> id
    <prepared>/prepare.json          PREPARE_FORMAT, the source, the counts, the user features

Written by freescale/prepare/spark_prepare.py; read by balance (through Hadoop: :func:`parse_metadata`), compare,
simulate and the pipeline (local: :func:`read_metadata`). Standard library only.
"""
from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from freescale.runtime.errors import InputError
from freescale.runtime.paths import local_path

PREPARE_FORMAT = "freescale.prepared/1"
METADATA_NAME = "prepare.json"
SEQUENCES_DIR = "sequences"
HISTORY_DIR = "history"


def metadata_text(meta: dict[str, Any]) -> str:
    return json.dumps(meta, indent=2) + "\n"


def parse_metadata(text: str, where: str) -> dict[str, Any]:
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise InputError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise InputError(f"{where} holds {type(meta).__name__}, not a {METADATA_NAME} object")
    return meta


def is_prepared(folder: str | Path) -> bool:
    """Whether a local folder is a prepare output (it holds prepare.json)."""
    return (Path(folder) / METADATA_NAME).is_file()


def read_metadata(folder: str | Path) -> dict[str, Any]:
    """A local prepare output's prepare.json."""
    path = Path(folder) / METADATA_NAME
    return parse_metadata(path.read_text(), str(path))


def check_previous(meta: dict[str, Any], where: str, max_seq_len: int) -> None:
    """A ``--previous`` output's prepare.json (read from ``where``): a prepare output of this format,
    prepared with the same ``max_seq_len`` (its histories hold that many items)."""
    if meta.get("format") != PREPARE_FORMAT:
        raise InputError(f"--previous: {where} is not a `freescale prepare` output (format "
                         f"{meta.get('format')!r}, expected {PREPARE_FORMAT!r})")
    if meta.get("max_seq_len") != max_seq_len:
        raise InputError(f"--previous {where} was prepared with --max-seq-len {meta.get('max_seq_len')}, "
                         f"not {max_seq_len}: pass --max-seq-len {meta.get('max_seq_len')}")


def check_local_previous(folder: str, max_seq_len: int) -> None:
    """:func:`check_previous` of a local ``--previous`` before Spark starts (a remote one is
    checked once Spark runs)."""
    local = local_path(folder)
    if local is None:
        return
    if not is_prepared(local):
        raise InputError(f"--previous {folder} is not a `freescale prepare` output (no {METADATA_NAME})")
    check_previous(read_metadata(local), folder, max_seq_len)
    if not (Path(local) / SEQUENCES_DIR).is_dir():
        raise InputError(f"--previous {folder} is not a `freescale prepare` output (no {SEQUENCES_DIR}/)")


def sequences_path(folder: str | Path) -> Path:
    """The sequences of a local prepare output, or ``folder`` itself when it is a bare sequences Parquet."""
    root = Path(folder)
    return root / SEQUENCES_DIR if (root / SEQUENCES_DIR).exists() else root


def dataset_name(folder: Path | None) -> str:
    """The dataset a prepared folder came from: the input's folder for a file (movielens-100k for
    .../movielens-100k/ratings.parquet), the input folder itself, or synthetic-<users>u."""
    meta = read_metadata(folder) if folder is not None and is_prepared(folder) else {}
    source = meta.get("source", {})
    if source.get("kind") == "synthetic":
        return f"synthetic-{source.get('users')}u"
    if source.get("uri"):
        from urllib.parse import unquote, urlsplit

        path = PurePosixPath(unquote(urlsplit(source["uri"]).path))
        return (path.parent.name if path.suffix else path.name) or path.name
    return folder.name if folder is not None else "shards"
