"""read_interactions: formats, column recognition and overrides, one-line errors."""
from __future__ import annotations

import datetime as dt

import pytest
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual, assertSchemaEqual

from freescale.runtime.errors import InputError
from freescale.prepare.ingest import CANONICAL_SCHEMA, read_interactions
from freescale.runtime.paths import to_uri

# (user, item, rating, timestamp) as the raw MovieLens files store them.
RAW = [(1, 10, 5, 881250949), (2, 20, 3, 881250950), (1, 30, 4, 881250951)]
CANONICAL = [("1", "10", 881250949, 5.0), ("2", "20", 881250950, 3.0), ("1", "30", 881250951, 4.0)]


def canonical(spark, rows):
    return spark.createDataFrame(rows, CANONICAL_SCHEMA)


def test_movielens_100k_parquet_auto_columns(spark, movielens_dir):
    df = read_interactions(spark, movielens_dir)  # the directory: finds ratings.parquet
    assertSchemaEqual(df.schema, CANONICAL_SCHEMA)
    stats = df.agg(F.count(F.lit(1)).alias("rows"),
                   F.countDistinct("user_id").alias("users"),
                   F.countDistinct("item").alias("items"),
                   F.min("timestamp").alias("t0")).first()
    assert (stats["rows"], stats["users"], stats["items"]) == (100000, 943, 1682)
    assert stats["t0"] > 800_000_000  # 1997: seconds, not milliseconds or days


def _write_layout(tmp_path, name):
    if name == "u.data":
        text = "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in RAW)
    elif name == "ratings.dat":
        text = "".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in RAW)
    else:
        text = "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r}.0,{t}\n" for u, i, r, t in RAW)
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["u.data", "ratings.dat", "ratings.csv"])
@pytest.mark.parametrize("pass_dir", [False, True], ids=["file", "dir"])
def test_movielens_raw_layouts(spark, tmp_path, name, pass_dir):
    path = _write_layout(tmp_path, name)
    df = read_interactions(spark, tmp_path if pass_dir else path)
    assertDataFrameEqual(df, canonical(spark, CANONICAL))


@pytest.mark.parametrize("name, fmt", [("u.data", "ml-100k"), ("ratings.dat", "ml-1m"), ("ratings.csv", "ml-csv")])
def test_explicit_format(spark, tmp_path, name, fmt):
    _write_layout(tmp_path, name)
    assertDataFrameEqual(read_interactions(spark, tmp_path, fmt=fmt), canonical(spark, CANONICAL))


def test_column_overrides_and_timestamp_type(spark, tmp_path):
    when = [dt.datetime(2020, 1, 1, tzinfo=dt.timezone.utc), dt.datetime(2020, 1, 2, tzinfo=dt.timezone.utc)]
    # A decoy `user_id` column that must lose to the explicit override.
    src = spark.createDataFrame(
        [("decoy", "alice", 7, when[0], 4.5), ("decoy", "bob", 8, when[1], None)],
        "user_id string, Buyer string, sku long, event_time timestamp, stars double")
    path = str(tmp_path / "events.parquet")
    src.write.parquet(path)
    df = read_interactions(spark, path, user_col="buyer", item_col="SKU", rating_col="stars")
    assertDataFrameEqual(df, canonical(spark, [("alice", "7", 1577836800, 4.5), ("bob", "8", 1577923200, None)]))


def test_csv_string_timestamps_and_missing_rating(spark, tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("UID,iid,ts\nu1,a,2020-01-01 00:00:00\nu1,b,1577836801\nu2,a,1577836802.9\n")
    df = read_interactions(spark, path)
    assertDataFrameEqual(df, canonical(spark, [("u1", "a", 1577836800, None), ("u1", "b", 1577836801, None),
                                               ("u2", "a", 1577836802, None)]))


def _error(spark, path, **kwargs) -> str:
    with pytest.raises(InputError) as err:
        read_interactions(spark, path, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("content, needles", [
    ("user,item\nu1,a\n", ["missing timestamp column", "available columns: user, item"]),
    ("user,time\nu1,5\n", ["missing item column", "movie_id"]),
    ("user,item,ts\nu1,a,5\nu1,b,yesterday\n", ["'ts'", "1 values", "'yesterday'"]),
    ("user,item,ts\nu1,a,5\n,b,6\n,c,7\n", ["2 of 3 rows", "null user", "'user'"]),
    ("user,movie_id,ts\nu1,a,5\nu1,,6\n", ["1 of 2 rows", "null item", "'movie_id'"]),
    ("user,item,ts\nu1,a,\n", ["null timestamp", "'ts'"]),
    ("user,item,ts,score\nu1,a,5,good\n", ["'score'", "non-numeric", "'good'"]),
    ("user,item,ts\n", ["empty input"]),
    ("", ["empty input"]),
])
def test_bad_csv_raises_one_line_error(spark, tmp_path, content, needles):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    msg = _error(spark, path)
    assert str(path) in msg
    for needle in needles:
        assert needle in msg, msg


def test_bad_override_names_column(spark, tmp_path):
    path = _write_layout(tmp_path, "ratings.csv")
    msg = _error(spark, path, user_col="customer")
    assert "'customer'" in msg and "userId" in msg


def test_wrong_column_type(spark, tmp_path):
    path = str(tmp_path / "flags.parquet")
    spark.createDataFrame([("u", "i", True)], "user_id string, item string, timestamp boolean").write.parquet(path)
    msg = _error(spark, path)
    assert "'timestamp'" in msg and "boolean" in msg


def test_nonexistent_path(spark, tmp_path):
    missing = tmp_path / "nope" / "ratings.parquet"
    msg = _error(spark, missing)
    assert str(missing) in msg and "does not exist" in msg


def test_unknown_format(spark, tmp_path):
    (tmp_path / "data.txt").write_text("1 2 3\n")
    assert "unknown format" in _error(spark, tmp_path / "data.txt")
    assert "unknown format 'xml'" in _error(spark, tmp_path / "data.txt", fmt="xml")
    assert "unknown format" in _error(spark, tmp_path)  # a directory with nothing recognisable


def test_corrupt_parquet(spark, tmp_path):
    (tmp_path / "part-0.parquet").write_text("not parquet")
    msg = _error(spark, tmp_path)
    assert str(tmp_path) in msg and "parquet" in msg


# ---------------------------------------------------------------- duplicates, and the checks before Spark


def test_drop_duplicate_interactions_keeps_one_row_per_user_item_timestamp(spark):
    from freescale.prepare.ingest import distinct_interactions, drop_duplicate_interactions

    rows = [("1", "10", 100, 3.0), ("1", "10", 100, 5.0), ("1", "10", 100, None),  # one event, three rows
            ("1", "10", 200, 4.0),  # the same item again later: a real repeat, kept
            ("2", "10", 100, 1.0), ("2", "10", 100, 1.0)]
    df = canonical(spark, rows)
    out = drop_duplicate_interactions(df)
    assert out.columns == df.columns
    # The highest rating wins, whatever the row order: the output does not depend on partitioning.
    expected = [("1", "10", 100, 5.0), ("1", "10", 200, 4.0), ("2", "10", 100, 1.0)]
    assertDataFrameEqual(out, canonical(spark, expected))
    assertDataFrameEqual(drop_duplicate_interactions(canonical(spark, rows[::-1]).repartition(3)),
                         canonical(spark, expected))
    counts = df.agg(F.count(F.lit(1)).alias("rows"), distinct_interactions().alias("distinct")).first()
    assert counts["rows"] - counts["distinct"] == 3 == df.count() - out.count()


def test_checks_before_spark_give_the_same_message_as_the_read(spark, tmp_path):
    """freescale.prepare.preflight and read_interactions share the format and column rules (and their text)."""
    from freescale.prepare.preflight import check_interactions

    path = tmp_path / "r.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"user_id": ["u"], "item": ["i"]}), path)
    with pytest.raises(InputError) as fast:
        check_interactions(str(path), None)
    assert str(fast.value) == _error(spark, path)
    assert "missing timestamp column" in str(fast.value)
    missing = tmp_path / "nope.parquet"
    with pytest.raises(InputError) as fast:
        check_interactions(str(missing), None)
    assert str(fast.value) == _error(spark, missing)


def test_csv_checks_before_spark_give_the_same_message_as_the_read(spark, tmp_path):
    """CSV gets the checks Parquet had (they took 19-30 s in Spark), never stricter than the read:
    an empty file, a header alone, wrong columns fail alike; gzip CSV is recognised by its name."""
    import gzip

    from freescale.prepare.preflight import check_interactions

    cases = {"empty.csv": "", "header.csv": "user_id,item_id,timestamp\n", "wrong.csv": "a,b,c\n1,2,3\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(InputError) as fast:
            check_interactions(str(tmp_path / name), None)
        assert str(fast.value) == _error(spark, tmp_path / name)
    packed = tmp_path / "ratings.log.csv.gz"
    packed.write_bytes(gzip.compress("userId,movieId,rating,timestamp\n1,10,5,881250949\n".encode()))
    check_interactions(str(packed), None)
    assertDataFrameEqual(read_interactions(spark, packed), canonical(spark, [("1", "10", 881250949, 5.0)]))


def test_a_null_column_in_a_folder_names_the_file_that_lacks_it(spark, tmp_path):
    """Where the checks before Spark do not reach (remote folders), the read names the first file
    whose rows have the nulls: there, the column is spelt differently."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "ratings"
    folder.mkdir()
    pq.write_table(pa.table({"user_id": ["u", "v"], "movie_id": ["i", "j"], "timestamp": [1, 2]}), folder / "a.parquet")
    pq.write_table(pa.table({"user_id": ["u"], "item": ["k"], "timestamp": [3]}), folder / "b.parquet")
    msg = _error(spark, folder)
    # Spark takes one file's schema (which one is its choice): the other file's rows are the nulls.
    expected = {"'movie_id'": ("1 of 3", "b.parquet"), "'item'": ("2 of 3", "a.parquet")}
    [(column, (count, file))] = [(c, v) for c, v in expected.items() if f"in column {c}" in msg]
    assert msg == f"{folder}: {count} rows have a null item in column {column} (the first in {to_uri(folder / file)})"
