"""`freescale prepare --previous`: MovieLens-100K cut at its 80th-percentile timestamp into day 1 and
day 2, day 2 prepared on day 1's output, checked against the raw rows and against one prepare of
both days (the session's movielens_prepared); and the refusals, before Spark starts."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from freescale.jobs import balance, prepare

NO_TRACKING = ["--tracking-uri", "none"]


@pytest.fixture(scope="module")
def two_days(spark, movielens_dir, tmp_path_factory) -> tuple[Path, pd.DataFrame, pd.DataFrame]:
    root = tmp_path_factory.mktemp("days")
    ratings = pq.read_table(movielens_dir / "ratings.parquet")
    cut = float(np.percentile(ratings["timestamp"].to_numpy(), 80))
    day1 = ratings.filter(pc.less_equal(ratings["timestamp"], cut))
    day2 = ratings.filter(pc.greater(ratings["timestamp"], cut))
    pq.write_table(day1, root / "day1.parquet")
    pq.write_table(day2, root / "day2.parquet")
    users = str(movielens_dir / "users.parquet")
    assert prepare.main(["--input", str(root / "day1.parquet"), "--output", str(root / "day1"),
                         "--user-features", users, *NO_TRACKING]) == 0
    assert prepare.main(["--input", str(root / "day2.parquet"), "--previous", str(root / "day1"),
                         "--output", str(root / "day2"), "--user-features", users, *NO_TRACKING]) == 0
    return root, day1.to_pandas(), day2.to_pandas()


def vocab_of(prepared: Path) -> pd.DataFrame:
    return pq.read_table(prepared / "item_vocab").to_pandas()


def raw_sequences(prepared: Path) -> pd.DataFrame:
    """The sequences with their items as raw MovieLens ids, through the output's own vocabulary."""
    raw = dict(zip(*[vocab_of(prepared)[c] for c in ("item_id", "raw_item")]))
    frame = pq.read_table(prepared / "sequences").to_pandas().set_index("user_id").sort_index()
    frame["items"] = [[raw[i] for i in items] for items in frame["items"]]
    frame["valid_item"] = frame["valid_item"].map(raw)
    frame["test_item"] = frame["test_item"].map(raw)
    return frame


def test_items_keep_their_ids_and_new_items_come_after(two_days):
    root, day1, day2 = two_days
    before, after = vocab_of(root / "day1"), vocab_of(root / "day2")
    kept = before.merge(after, on="raw_item", suffixes=("_1", "_2"))
    assert len(kept) == len(before) and (kept["item_id_1"] == kept["item_id_2"]).all()
    added = after[~after["raw_item"].isin(before["raw_item"])].sort_values("item_id")
    assert len(added) == len(set(day2["movie_id"]) - set(day1["movie_id"])) > 0
    assert list(added["item_id"]) == list(range(len(before) + 1, len(after) + 1))
    # Among themselves: by day-2 count, ties by raw id.
    ranked = added.assign(key=added["raw_item"]).sort_values(["count", "key"], ascending=[False, True])
    assert list(ranked["item_id"]) == list(added["item_id"])
    meta = json.loads((root / "day2" / "prepare.json").read_text())
    assert meta["new_items"] == len(added) and meta["num_items"] == len(after)


def test_returning_users_count_both_days(two_days):
    root, day1, day2 = two_days
    counts1, counts2 = day1.groupby("user_id").size(), day2.groupby("user_id").size()
    sequences = pq.read_table(root / "day2" / "sequences").to_pandas().set_index("user_id")
    returning = sorted(set(counts1.index) & set(counts2.index))
    assert returning
    raw_total = {str(u): counts1[u] + counts2[u] for u in returning}
    agree = sum(sequences.loc[u, "num_interactions"] == n for u, n in raw_total.items() if u in sequences.index)
    assert agree / len(returning) >= 0.95, f"{agree} of {len(returning)} returning users count both days"
    meta = json.loads((root / "day2" / "prepare.json").read_text())
    assert meta["returning_users"] == len(returning)
    assert meta["new_users"] == len(set(counts2.index) - set(counts1.index))
    assert meta["unchanged_users"] == len(set(counts1.index) - set(counts2.index))
    assert meta["users"] == len(sequences) and set(sequences.index) <= {str(u) for u in counts2.index}
    assert meta["late_events"] == 0 and meta["previous"]["state"] == "history"
    history = pq.read_table(root / "day2" / "history", columns=["user_id"]).to_pandas()
    assert len(history) == history["user_id"].nunique() == len(set(counts1.index) | set(counts2.index))


def test_touched_users_get_the_sequences_of_one_prepare_of_both_days(two_days, movielens_prepared):
    root, _, _ = two_days
    incremental, scratch = raw_sequences(root / "day2"), raw_sequences(movielens_prepared)
    scratch = scratch.loc[incremental.index]
    for column in ("timestamps", "valid_timestamp", "test_timestamp", "num_interactions", "length", "user_features"):
        same = [np.array_equal(a, b) for a, b in zip(incremental[column], scratch[column])]
        assert all(same), f"{column}: {same.count(False)} of {len(same)} users differ"
    # Events of one timestamp are ordered by item id, which the two vocabularies give differently:
    # within such a tie the order may differ, nothing else.
    assert [tie_free_events(r) for r in incremental.itertuples()] == [tie_free_events(r) for r in scratch.itertuples()]
    # Events alone on their timestamp have one place: the same in both.
    untied = [untied_events(r) for r in incremental.itertuples()]
    assert sum(map(len, untied)) > len(incremental)
    assert untied == [untied_events(r) for r in scratch.itertuples()]


def untied_events(row) -> list[tuple]:
    """``(position, raw item, rating)`` of a sequence's events (items, then the validation and the
    test target, whose rating is not kept) that no other event of the user shares a timestamp with."""
    events = [*zip(row.timestamps, row.items, row.ratings), (row.valid_timestamp, row.valid_item, row.valid_rating),
              (row.test_timestamp, row.test_item, None)]
    shared = Counter(timestamp for timestamp, _, _ in events)
    return [(i, item, rating) for i, (timestamp, item, rating) in enumerate(events) if shared[timestamp] == 1]


def tie_free_events(row) -> list[tuple]:
    """A sequence's events, (timestamp, raw item), in an order that does not depend on item ids (a
    rating goes with its place: the test target's is not kept)."""
    return sorted([*zip(row.timestamps, row.items), (row.valid_timestamp, row.valid_item),
                   (row.test_timestamp, row.test_item)])


def test_balance_reads_the_output(two_days, tmp_path):
    root, _, _ = two_days
    out = tmp_path / "shards"
    assert balance.main(["--input", str(root / "day2"), "--output", str(out), "--world-size", "2",
                         "--local-batch-size", "8", *NO_TRACKING]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    meta = json.loads((root / "day2" / "prepare.json").read_text())
    assert manifest["input"]["samples"] == meta["users"] and manifest["num_items"] == meta["num_items"]
    assert manifest["user_features"] == meta["user_features"]


@pytest.mark.parametrize("case", ["not_prepared", "other_max_seq_len"])
def test_a_bad_previous_is_one_line_before_spark(tmp_path, capsys, monkeypatch, case):
    from freescale.runtime import session

    monkeypatch.setattr(session, "build_spark_session", lambda *a, **k: pytest.fail("Spark was started"))
    previous = tmp_path / "previous"
    (previous / "sequences").mkdir(parents=True)
    logs = tmp_path / "day2.parquet"
    pq.write_table(pa.table({"user_id": [1], "item_id": [2], "timestamp": [3]}), logs)
    if case == "other_max_seq_len":
        (previous / "prepare.json").write_text(json.dumps({"format": "freescale.prepared/1", "max_seq_len": 50}))
    out = tmp_path / "out"
    rc = prepare.main(["--input", str(logs), "--previous", str(previous), "--output", str(out), *NO_TRACKING])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("freescale prepare: error: --previous")
    assert ("not a `freescale prepare` output" if case == "not_prepared" else "--max-seq-len 50") in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["day2.parquet", "previous"]
