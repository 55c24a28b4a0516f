"""Input layouts the prepare job recognises: formats, raw MovieLens files, column names.

Plain data, no pyspark, so the command line can offer ``--format`` choices before Spark
loads. Adding a layout is one entry here; ``pipeline.ingest`` reads every layout from it.
"""
from __future__ import annotations

# Raw MovieLens layouts: file name -> (format, separator, header, column names).
# Headerless layouts get their columns named here so column recognition applies.
MOVIELENS_LAYOUTS: dict[str, tuple[str, str, bool, tuple[str, ...] | None]] = {
    "u.data": ("ml-100k", "\t", False, ("user_id", "item_id", "rating", "timestamp")),
    "ratings.dat": ("ml-1m", "::", False, ("user_id", "item_id", "rating", "timestamp")),
    "ratings.csv": ("ml-csv", ",", True, None),  # header: userId,movieId,rating,timestamp
}

FORMATS: tuple[str, ...] = ("parquet", "csv", *(fmt for fmt, *_ in MOVIELENS_LAYOUTS.values()))

# Recognised column names, matched case-insensitively, first match wins.
USER_COLUMNS = ("user_id", "userId", "user", "uid")
ITEM_COLUMNS = ("item_id", "movie_id", "movieId", "item", "iid")
TIME_COLUMNS = ("timestamp", "ts", "time", "event_time")
RATING_COLUMNS = ("rating", "action", "score")
