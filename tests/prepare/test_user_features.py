"""User-level features: a user table -> categorical ids per user, joined onto the sequences."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from freescale.runtime.errors import InputError
from freescale.prepare.user_features import (
    USER_FEATURES_COLUMN,
    build_user_feature_vocab,
    count_users_without_features,
    encode_user_features,
    feature_cardinalities,
    read_user_table,
)


def write_users(tmp_path: Path, frame: pd.DataFrame, name: str = "users.parquet") -> Path:
    path = tmp_path / name
    if name.endswith(".csv"):
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path, index=False)
    return path


USERS = pd.DataFrame({"user_id": [1, 2, 3, 4], "gender": ["F", "M", "M", None], "age": [25, 25, 31, 40]})


def test_movielens_users_become_one_id_per_feature(spark, movielens_dir) -> None:
    users, names = read_user_table(spark, movielens_dir / "users.parquet")
    assert names == ["age", "gender", "occupation", "zip_code"]
    assert users.count() == 943
    vocab = build_user_feature_vocab(users, names)
    sizes = {f["name"]: f["num_ids"] for f in feature_cardinalities(vocab, names)}
    distinct = users.agg(*[F.countDistinct(n).alias(n) for n in names]).first().asDict()
    assert sizes == {n: distinct[n] + 1 for n in names}  # ids 1..n plus 0 for unknown
    # MovieLens-100K has 670 men and 273 women: the more frequent value gets id 1.
    assertDataFrameEqual(vocab.where("feature = 'gender'").select("value", "id", "count"),
                         [("M", 1, 670), ("F", 2, 273)])


def test_ids_follow_count_then_value_and_null_is_unknown(spark, tmp_path) -> None:
    users, names = read_user_table(spark, write_users(tmp_path, USERS))
    assert names == ["gender", "age"]
    vocab = build_user_feature_vocab(users, names)
    assertDataFrameEqual(vocab, [("gender", "M", 1, 2), ("gender", "F", 2, 1),
                                 ("age", "25", 1, 2), ("age", "31", 2, 1), ("age", "40", 3, 1)])
    sequences = spark.createDataFrame([("1", 3), ("4", 5), ("9", 2)], "user_id string, length int")
    encoded = encode_user_features(sequences, users, vocab, names)
    assertDataFrameEqual(encoded, [("1", 3, [2, 1]), ("4", 5, [0, 3]), ("9", 2, [0, 0])])
    assert encoded.schema[USER_FEATURES_COLUMN].dataType.simpleString() == "array<int>"
    assert count_users_without_features(sequences, users) == 1  # user 9 kept, with unknown ids


def test_chosen_columns_and_csv(spark, tmp_path) -> None:
    path = write_users(tmp_path, USERS.rename(columns={"user_id": "userId"}), "users.csv")
    users, names = read_user_table(spark, path, feature_cols=["AGE"])
    assert names == ["age"] and users.columns == ["user_id", "age"]
    assert sorted(r["user_id"] for r in users.collect()) == ["1", "2", "3", "4"]


@pytest.mark.parametrize("frame, kwargs, message", [
    (USERS, {"feature_cols": ["height"]}, "user feature column 'height' not found; available columns: "
                                          "user_id, gender, age"),
    (USERS.drop(columns=["user_id"]), {}, "missing user column"),
    (USERS[["user_id"]], {}, "no feature columns besides the user column 'user_id'"),
    (pd.DataFrame({"user_id": [1, 1], "g": ["a", "b"]}), {}, "user '1' appears 2 times in column 'user_id'"),
    (pd.DataFrame({"user_id": [1], "tags": [[1, 2]]}), {}, "user feature column 'tags' has type array<bigint>"),
])
def test_bad_user_table(spark, tmp_path, frame, kwargs, message) -> None:
    path = write_users(tmp_path, frame)
    with pytest.raises(InputError) as error:
        read_user_table(spark, path, **kwargs)
    assert message in str(error.value) and str(path) in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_user_table(spark, tmp_path) -> None:
    with pytest.raises(InputError, match="users.parquet: path does not exist"):
        read_user_table(spark, tmp_path / "users.parquet")
