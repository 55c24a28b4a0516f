"""Input layouts the prepare job recognises: formats, raw MovieLens files, column names.

Plain data, no pyspark, so the command line can offer ``--format`` choices before Spark
loads. Adding a layout is one entry here; ``freescale.prepare.ingest`` reads every layout from it.
"""
from __future__ import annotations

# Raw MovieLens layouts: file name -> (format, separator, header, column names).
# Headerless layouts get their columns named here so column recognition applies.
MOVIELENS_LAYOUTS: dict[str, tuple[str, str, bool, tuple[str, ...] | None]] = {
    "u.data": ("ml-100k", "\t", False, ("user_id", "item_id", "rating", "timestamp")),
    "ratings.dat": ("ml-1m", "::", False, ("user_id", "item_id", "rating", "timestamp")),
    "ratings.csv": ("ml-csv", ",", True, None),  # header: userId,movieId,rating,timestamp
}

# The same table keyed by format: (file name, separator, header, column names).
LAYOUT_BY_FORMAT = {fmt: (name, sep, header, cols) for name, (fmt, sep, header, cols) in MOVIELENS_LAYOUTS.items()}

# Plain per-line layouts with no timestamp column, as public sequential-recommendation data
# sets ship them (SASRec's ml-1m.txt, Beauty.txt): each line ``user item``, two integers
# separated by spaces or tabs, users' lines grouped or interleaved. A user's lines are in
# chronological order, so the line number (1-based) stands in for the timestamp. One file,
# never a folder: the order of a folder's files would be undefined.
# Format -> (what a line holds, the line's pattern: group 1 the user, group 2 the item). The
# pattern is both a Python and a Java regex: preflight checks the first lines with it, Spark
# every line.
LINE_ORDER_FORMATS: dict[str, tuple[str, str]] = {
    "user-item-lines": ("`user item` (two integer ids separated by spaces or tabs)",
                        r"^[ \t]*(-?[0-9]{1,18})[ \t]+(-?[0-9]{1,18})[ \t]*$"),
}

FORMATS: tuple[str, ...] = ("parquet", "csv", *LAYOUT_BY_FORMAT, *LINE_ORDER_FORMATS)

# Compressions Spark's text and CSV readers undo by the file name's suffix (Hadoop's codecs):
# ``ratings.csv.gz`` is a CSV file.
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".zst", ".lz4", ".snappy", ".deflate")


def uncompressed_name(name: str) -> str:
    """``name`` without a compression suffix: the name the file's format is told by."""
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name

# Recognised column names, matched case-insensitively, first match wins.
USER_COLUMNS = ("user_id", "userId", "user", "uid")
ITEM_COLUMNS = ("item_id", "movie_id", "movieId", "item", "iid")
TIME_COLUMNS = ("timestamp", "ts", "time", "event_time")
RATING_COLUMNS = ("rating", "action", "score")
