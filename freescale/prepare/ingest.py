"""Read user-item interactions from common layouts into one canonical schema.

Canonical schema (``CANONICAL_SCHEMA``)::

    user_id: string, item: string, timestamp: long (unix seconds), rating: float (null when absent)

A line-order layout (``LINE_ORDER_FORMATS``: ``user item`` per line, no timestamp column)
gets its 1-based line number as the timestamp: the order is exact, the gaps are line gaps.

Everything downstream (vocabulary, sequences, balancing) assumes this schema,
so every format difference is absorbed here, and bad input fails here with a
one-line ``InputError`` naming the path and the column or value, instead of
failing later inside a Spark stage with a JVM stack trace.

Validation costs one aggregate pass over the input (row count, null counts and
unparseable counts together); nothing but that one-row result reaches the driver.
The same rules, for what can be told from a local file's footer, run before Spark
starts in ``freescale.prepare.preflight``.

Duplicate interactions (same user, item and timestamp) are not an error: the prepare
job counts them inside the per-user aggregation of its sequences (``build_sequences(...,
repeated=)``) and, when there are any, rebuilds from ``drop_duplicate_interactions``.
"""
from __future__ import annotations

import os

from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from freescale.runtime.errors import InputError
from freescale.prepare.layouts import (
    ITEM_COLUMNS,
    LAYOUT_BY_FORMAT,
    LINE_ORDER_FORMATS,
    RATING_COLUMNS,
    TIME_COLUMNS,
    USER_COLUMNS,
)
from freescale.runtime.paths import to_uri
from freescale.prepare.preflight import bad_line_message, check_line_layout_columns, pick_column, resolve_input

# Spark reports every column as nullable; validation guarantees user_id, item
# and timestamp are never null in what read_interactions returns.
CANONICAL_SCHEMA = T.StructType([
    T.StructField("user_id", T.StringType()),
    T.StructField("item", T.StringType()),
    T.StructField("timestamp", T.LongType()),
    T.StructField("rating", T.FloatType()),
])

# One interaction is one (user, item, timestamp): a row repeated with the same three is a
# duplicate (a log written twice, a retried export). Left in, a user whose last event is
# duplicated gets test_item == valid_item, the test target leaked into the history.
INTERACTION_KEY = ("user_id", "item", "timestamp")


def drop_duplicate_interactions(interactions: DataFrame) -> DataFrame:
    """Canonical interactions with one row per ``INTERACTION_KEY`` (same columns, same order).

    Duplicates that disagree elsewhere keep each other column's largest value (the highest
    rating), so the result does not depend on row order or partitioning.
    """
    others = [c for c in interactions.columns if c not in INTERACTION_KEY]
    if not others:
        return interactions.dropDuplicates(list(INTERACTION_KEY))
    return (interactions.groupBy(*INTERACTION_KEY)
            .agg(*[F.max(c).alias(c) for c in others])
            .select(*interactions.columns))


def distinct_interactions() -> Column:
    """Aggregate expression: distinct ``INTERACTION_KEY`` values, i.e. the rows
    ``drop_duplicate_interactions`` keeps; ``count - distinct`` is the number it drops. Not for
    large inputs beside another distinct aggregate: Spark then expands and shuffles every row
    (issue 18: it doubled prepare's time at 1M users; prepare counts in build_sequences)."""
    return F.countDistinct(*[F.col(c) for c in INTERACTION_KEY])



# What Spark raises for unreadable files (missing, corrupt, not the format).
_READ_ERRORS = (PySparkException, Py4JJavaError)

_INTEGRAL = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)
_FRACTIONAL = (T.FloatType, T.DoubleType, T.DecimalType)
_DATETIME = (T.TimestampType, T.TimestampNTZType, T.DateType)


def read_interactions(
    spark: SparkSession,
    path: str | os.PathLike,
    *,
    fmt: str | None = None,
    user_col: str | None = None,
    item_col: str | None = None,
    time_col: str | None = None,
    rating_col: str | None = None,
) -> DataFrame:
    """Read interactions at ``path`` and return them in ``CANONICAL_SCHEMA``.

    ``fmt`` is one of ``FORMATS`` or None to detect it from the path. Column
    names default to the first recognised name (``USER_COLUMNS`` etc.);
    ``*_col`` arguments override. Raises ``InputError`` on bad input.
    """
    # The format and column rules live in freescale.prepare.preflight (no Spark), so the jobs' checks
    # before Spark starts and this read give the same answers and the same messages.
    fmt, source = resolve_input(str(path), fmt)
    if fmt in LINE_ORDER_FORMATS:
        check_line_layout_columns(fmt, user_col=user_col, item_col=item_col, time_col=time_col,
                                  rating_col=rating_col)
        return _read_line_order(spark, source, fmt)
    raw = _read_raw(spark, source, fmt)
    if not raw.columns:
        raise InputError(f"{source}: empty input (no columns and no rows)")

    user = _pick(raw, source, "user", user_col, USER_COLUMNS, required=True)
    item = _pick(raw, source, "item", item_col, ITEM_COLUMNS, required=True)
    time = _pick(raw, source, "timestamp", time_col, TIME_COLUMNS, required=True)
    rating = _pick(raw, source, "rating", rating_col, RATING_COLUMNS, required=False)

    user_expr = _id_expr(raw, source, user)
    item_expr = _id_expr(raw, source, item)
    time_expr = _time_expr(raw, source, time)
    rating_expr = _rating_expr(raw, source, rating) if rating else F.lit(None).cast("float")

    out = raw.select(
        user_expr.alias("user_id"),
        item_expr.alias("item"),
        time_expr.alias("timestamp"),
        rating_expr.alias("rating"),
        # Raw values and the file of each row ride along for validation only, dropped below.
        _col(time).alias("_raw_time"),
        (_col(rating) if rating else F.lit(None).cast("string")).alias("_raw_rating"),
        F.input_file_name().alias("_file"),
    )
    _validate(out, source, user, item, time, rating)
    return out.select(*CANONICAL_SCHEMA.fieldNames())


def _read_raw(spark: SparkSession, path: str, fmt: str) -> DataFrame:
    try:
        if fmt == "parquet":
            return spark.read.parquet(path)
        # Text formats are read as strings and parsed below, so one code path
        # decides what a malformed value is and reports it by name.
        sep, header, cols = ",", True, None
        if fmt in LAYOUT_BY_FORMAT:
            _, sep, header, cols = LAYOUT_BY_FORMAT[fmt]
        reader = spark.read.option("sep", sep).option("header", header).option("inferSchema", False)
        if cols:
            reader = reader.schema(", ".join(f"{c} string" for c in cols))
        return reader.csv(path)
    except _READ_ERRORS as err:
        raise InputError(f"{path}: cannot read as {fmt}: {_spark_reason(err)}") from None


def read_numbered_lines(spark: SparkSession, path: str, min_partitions: int | None = None) -> DataFrame:
    """``(line: long, value: string)``: every line of the one text file at ``path`` with its
    1-based line number.

    Spark's DataFrame text reader keeps no line order across partitions. Hadoop's line reader
    splits one file into byte ranges in file order, partition i being the i-th range, and
    ``zipWithIndex`` numbers rows by partition then position, so the number is the line's
    place in the file however many partitions read it (``min_partitions`` asks for at least
    that many). Costs one extra pass (the rows per partition) and a trip through Python
    workers per line.
    """
    lines = spark.sparkContext.textFile(path, min_partitions or spark.sparkContext.defaultMinPartitions)
    numbered = lines.zipWithIndex().map(lambda pair: (pair[1] + 1, pair[0]))
    return spark.createDataFrame(numbered, "line long, value string")


def _read_line_order(spark: SparkSession, source: str, fmt: str) -> DataFrame:
    """A ``LINE_ORDER_FORMATS`` file in ``CANONICAL_SCHEMA``: the line number is the timestamp,
    the rating null. Every line must match the layout: the first that does not is named."""
    try:
        files = spark.read.text(source).inputFiles()  # lists, reads nothing
    except _READ_ERRORS as err:
        raise InputError(f"{source}: cannot read as {fmt}: {_spark_reason(err)}") from None
    if len(files) != 1:
        raise InputError(f"{source}: --format {fmt} reads one file, found {len(files)} "
                         "(the line order is the time order)")
    pattern = LINE_ORDER_FORMATS[fmt][1]
    lines = read_numbered_lines(spark, source)
    good = F.col("value").rlike(pattern)
    try:
        row = lines.agg(F.count(F.lit(1)).alias("lines"),
                        F.sum(F.when(good, 0).otherwise(1)).alias("bad"),
                        F.min_by(F.struct("line", "value"), F.when(~good, F.col("line"))).alias("first_bad"),
                        ).first()
    except _READ_ERRORS as err:
        raise InputError(f"{source}: cannot read as {fmt}: {_spark_reason(err)}") from None
    if row["lines"] == 0:
        raise InputError(f"{source}: empty input (zero lines)")
    if row["bad"]:
        first = row["first_bad"]
        raise InputError(bad_line_message(source, fmt, first["line"], first["value"], row["bad"], row["lines"]))
    # Ids are integers in this layout: "007" and "7" are one id, written as 7.
    return lines.select(
        F.regexp_extract("value", pattern, 1).cast("long").cast("string").alias("user_id"),
        F.regexp_extract("value", pattern, 2).cast("long").cast("string").alias("item"),
        F.col("line").alias("timestamp"),
        F.lit(None).cast("float").alias("rating"),
    )


def _spark_reason(err: Exception) -> str:
    """First line of a Spark error, without the JVM stack trace."""
    text = err.java_exception.getMessage() if isinstance(err, Py4JJavaError) else str(err)
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else type(err).__name__


def _pick(df: DataFrame, source: str, role: str, explicit: str | None,
          candidates: tuple[str, ...], *, required: bool) -> str | None:
    """Actual column name for ``role``: the explicit one, else the first recognised name."""
    return pick_column(df.columns, source, role, explicit, candidates, required=required)


def _col(name: str) -> Column:
    # Backticks make names with dots or spaces literal instead of struct paths.
    return F.col("`" + name.replace("`", "``") + "`")


def _type_error(source: str, name: str, dtype: T.DataType, expected: str) -> InputError:
    return InputError(f"{source}: column {name!r} has type {dtype.simpleString()}; expected {expected}")


def _id_expr(df: DataFrame, source: str, name: str) -> Column:
    dtype = df.schema[name].dataType
    col = _col(name)
    if isinstance(dtype, (T.StringType, *_INTEGRAL)):
        return col.cast("string")
    if isinstance(dtype, _FRACTIONAL):
        # pandas writes integer ids as float when a column had NaNs: 3.0 must
        # become "3", and NaN becomes null (reported as a null id).
        return F.when(~F.isnan(col.cast("double")), col.try_cast("long").cast("string"))
    raise _type_error(source, name, dtype, "string or integer ids")


def _time_expr(df: DataFrame, source: str, name: str) -> Column:
    dtype = df.schema[name].dataType
    col = _col(name)
    if isinstance(dtype, _INTEGRAL):
        return col.cast("long")
    if isinstance(dtype, _FRACTIONAL):
        # try_cast: NaN or out-of-range become null and are reported, not an ANSI stack trace.
        return F.when(~F.isnan(col.cast("double")), col.try_cast("long"))
    if isinstance(dtype, _DATETIME):
        # NTZ and date values are read in the session time zone (UTC for our sessions).
        return F.unix_seconds(col.cast("timestamp"))
    if isinstance(dtype, T.StringType):
        # Integral seconds first (exact for large values), then fractional
        # seconds, then a datetime string; whatever is left unparsed is an error.
        return F.coalesce(
            col.try_cast("long"),
            col.try_cast("double").cast("long"),
            F.unix_seconds(F.try_to_timestamp(col)),
        )
    raise _type_error(source, name, dtype, "unix seconds (integer), a timestamp, or a string of either")


def _rating_expr(df: DataFrame, source: str, name: str) -> Column:
    dtype = df.schema[name].dataType
    col = _col(name)
    if isinstance(dtype, (*_INTEGRAL, *_FRACTIONAL)):
        return col.cast("float")
    if isinstance(dtype, T.StringType):
        return col.try_cast("float")
    raise _type_error(source, name, dtype, "a number")


def _validate(df: DataFrame, source: str, user: str, item: str, time: str, rating: str | None) -> None:
    """One aggregate pass; raise on the first problem found, most basic first."""
    def count_if(cond: Column) -> Column:
        return F.sum(F.when(cond, 1).otherwise(0))

    def first_file(cond: Column) -> Column:
        return F.first(F.when(cond, F.col("_file")), ignorenulls=True)

    bad_time = F.col("_raw_time").isNotNull() & F.col("timestamp").isNull()
    bad_rating = F.col("_raw_rating").isNotNull() & F.col("rating").isNull()
    aggregate = df.agg(
        F.count(F.lit(1)).alias("rows"),
        count_if(F.col("user_id").isNull()).alias("null_users"),
        count_if(F.col("item").isNull()).alias("null_items"),
        count_if(F.col("_raw_time").isNull()).alias("null_times"),
        first_file(F.col("user_id").isNull()).alias("null_user_file"),
        first_file(F.col("item").isNull()).alias("null_item_file"),
        first_file(F.col("_raw_time").isNull()).alias("null_time_file"),
        count_if(bad_time).alias("bad_times"),
        F.first(F.when(bad_time, F.col("_raw_time").cast("string")), ignorenulls=True).alias("bad_time_example"),
        count_if(bad_rating).alias("bad_ratings"),
        F.first(F.when(bad_rating, F.col("_raw_rating").cast("string")), ignorenulls=True).alias("bad_rating_example"),
    )
    try:
        row = aggregate.first()
    except _READ_ERRORS as err:  # corrupt data pages surface only when rows are read
        raise InputError(f"{source}: cannot read: {_spark_reason(err)}") from None

    def in_file(key: str) -> str:
        """Which file of a folder holds the first such row (a folder's files may name a column
        differently: Spark reads one file's schema, and the others' rows have nulls in it)."""
        file = row[key]
        return f" (the first in {file})" if file and file != to_uri(source) else ""

    if row["rows"] == 0:
        raise InputError(f"{source}: empty input (zero rows)")
    if row["null_users"]:
        raise InputError(f"{source}: {row['null_users']} of {row['rows']} rows have a null user id in column {user!r}"
                         + in_file("null_user_file"))
    if row["null_items"]:
        raise InputError(f"{source}: {row['null_items']} of {row['rows']} rows have a null item in column {item!r}"
                         + in_file("null_item_file"))
    if row["null_times"]:
        raise InputError(f"{source}: {row['null_times']} of {row['rows']} rows have a null timestamp in column "
                         f"{time!r}" + in_file("null_time_file"))
    if row["bad_times"]:
        raise InputError(
            f"{source}: column {time!r} has {row['bad_times']} values that are not unix seconds or a timestamp, "
            f"e.g. {_short(row['bad_time_example'])}"
        )
    if row["bad_ratings"]:
        raise InputError(
            f"{source}: column {rating!r} has {row['bad_ratings']} non-numeric values, "
            f"e.g. {_short(row['bad_rating_example'])}"
        )


def _short(value: object, limit: int = 40) -> str:
    """repr() keeps the message on one line even if the value holds a newline."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"
