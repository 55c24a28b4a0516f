"""User-level features: a user table -> one categorical id per feature per user, inside Spark.

A user table has a user column (recognised as in ``freescale.prepare.ingest``: user_id,
userId, user, uid) and feature columns, e.g. MovieLens ``users.parquet``
(age, gender, occupation, zip_code). Every feature is categorical: its values,
compared as strings, get ids ``1..n`` by descending user count, ties by value,
so the same table always gets the same ids. Id 0 means unknown: a null value,
or a user with no row in the table. Numeric columns are categories too (MovieLens
age has 61 distinct values); bucket a continuous column before passing it.

``encode_user_features`` adds ``user_features: array<int>`` to the sequences,
one id per feature in the order of the ``names`` it is given. Users without a
row keep their sequence with all-zero ids and are counted by
``count_users_without_features``; nothing is dropped.
"""
from __future__ import annotations

import os

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql import types as T

from freescale.runtime.errors import InputError
from freescale.prepare.ingest import _col, _id_expr, _pick, _read_raw, _short
from freescale.prepare.layouts import USER_COLUMNS
from freescale.runtime.paths import local_path
from freescale.prepare.preflight import format_from_name

USER_FEATURES_COLUMN = "user_features"
UNKNOWN_ID = 0
# Values are categories; a nested or binary column has no meaningful string form.
_CATEGORICAL = (T.StringType, T.BooleanType, T.ByteType, T.ShortType, T.IntegerType, T.LongType,
                T.FloatType, T.DoubleType, T.DecimalType, T.DateType)


def read_user_table(
    spark: SparkSession,
    path: str | os.PathLike,
    *,
    user_col: str | None = None,
    feature_cols: list[str] | None = None,
) -> tuple[DataFrame, list[str]]:
    """``(users, names)``: ``user_id: string`` plus one string column per feature.

    ``feature_cols`` defaults to every column except the user column. Raises
    ``InputError`` naming the path and column for a missing or unusable column,
    a null user id, or a user listed twice.
    """
    source = str(path)
    local = local_path(source)
    if local is not None and not os.path.exists(local):
        raise InputError(f"{source}: path does not exist")
    fmt = "parquet" if local is not None and os.path.isdir(local) else format_from_name(source)
    raw = _read_raw(spark, source, fmt)
    user = _pick(raw, source, "user", user_col, USER_COLUMNS, required=True)
    if feature_cols is None:
        names = [c for c in raw.columns if c != user]
    else:
        names = [_pick(raw, source, "user feature", c, (), required=True) for c in feature_cols]
    if not names:
        raise InputError(f"{source}: no feature columns besides the user column {user!r}")
    if len(set(names)) != len(names) or user in names:
        raise InputError(f"{source}: user feature columns {names} repeat a column or include the user column")
    for name in names:
        dtype = raw.schema[name].dataType
        if not isinstance(dtype, _CATEGORICAL):
            raise InputError(f"{source}: user feature column {name!r} has type {dtype.simpleString()}; "
                             "expected a categorical (string, integer, boolean or number) column")
    users = raw.select(_id_expr(raw, source, user).alias("user_id"),
                       *[_col(n).cast("string").alias(n) for n in names])
    check = users.agg(
        F.sum(F.col("user_id").isNull().cast("long")).alias("null_users"),
        (F.count(F.lit(1)) - F.countDistinct("user_id")).alias("repeats")).first()
    if check["null_users"]:
        raise InputError(f"{source}: user column {user!r} has {check['null_users']} null values")
    if check["repeats"]:
        example = users.groupBy("user_id").count().where("count > 1").orderBy("user_id").first()
        raise InputError(f"{source}: user {_short(example['user_id'])} appears {example['count']} times in "
                         f"column {user!r}; a user table needs one row per user")
    return users, names


def build_user_feature_vocab(users: DataFrame, names: list[str]) -> DataFrame:
    """``feature: string, value: string, id: int, count: long``: ids ``1..n`` per feature.

    Ids follow descending count, ties by value; nulls get no id (they map to 0).
    """
    stacked = None
    for name in names:
        part = users.select(F.lit(name).alias("feature"), F.col(name).alias("value")).where(F.col("value").isNotNull())
        stacked = part if stacked is None else stacked.unionByName(part)
    counts = stacked.groupBy("feature", "value").agg(F.count(F.lit(1)).alias("count"))
    order = Window.partitionBy("feature").orderBy(F.desc("count"), F.asc("value"))
    return counts.select("feature", "value", F.row_number().over(order).cast("int").alias("id"), "count")


def feature_cardinalities(vocab: DataFrame, names: list[str]) -> list[dict[str, int | str]]:
    """``[{"name": feature, "num_ids": n + 1}]`` in ``names`` order: table sizes, id 0 included."""
    sizes = {r["feature"]: r["n"] for r in vocab.groupBy("feature").agg(F.max("id").alias("n")).collect()}
    return [{"name": name, "num_ids": int(sizes.get(name) or 0) + 1} for name in names]


def encode_user_features(sequences: DataFrame, users: DataFrame, vocab: DataFrame, names: list[str]) -> DataFrame:
    """``sequences`` plus ``user_features: array<int>`` (ids in ``names`` order, 0 = unknown)."""
    unknown = F.array_repeat(F.lit(UNKNOWN_ID), len(names))
    return (sequences.join(encoded_users(users, vocab, names), "user_id", "left")
            .withColumn(USER_FEATURES_COLUMN, F.coalesce(F.col(USER_FEATURES_COLUMN), unknown)))


def encoded_users(users: DataFrame, vocab: DataFrame, names: list[str]) -> DataFrame:
    """``user_id, user_features: array<int>``: each row of the user table as ids in ``names`` order
    (0 for a value ``vocab`` lacks)."""
    encoded = users
    for name in names:
        # Each feature's vocabulary is small: broadcast it and join on the value.
        ids = vocab.where(F.col("feature") == name).select(F.col("value").alias(name), F.col("id").alias(f"_{name}_id"))
        encoded = encoded.join(F.broadcast(ids), name, "left")
    return encoded.select("user_id", F.array(*[F.coalesce(F.col(f"_{n}_id"), F.lit(UNKNOWN_ID)) for n in names])
                          .alias(USER_FEATURES_COLUMN))


def count_users_without_features(sequences: DataFrame, users: DataFrame) -> int:
    """Sequences whose user has no row in the user table (they train with unknown ids)."""
    return sequences.select("user_id").join(users.select("user_id"), "user_id", "left_anti").count()
