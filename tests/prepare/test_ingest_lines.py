"""The plain `user item` per-line layout (--format user-item-lines): the line order is the time
order, across partitions; bad lines fail in one line naming the file and the line number."""
from __future__ import annotations

import random
import re

import pytest
from pyspark.sql import functions as F

from freescale.jobs import prepare
from freescale.prepare import preflight
from freescale.runtime.errors import InputError
from freescale.prepare.ingest import read_interactions, read_numbered_lines

FMT = "user-item-lines"


def _interleaved(n_lines: int, n_users: int, seed: int) -> list[tuple[int, int]]:
    """(user, item) per line, users interleaved at random; items repeat so order is not item order."""
    rng = random.Random(seed)
    return [(rng.randrange(1, n_users + 1), rng.randrange(1, 50)) for _ in range(n_lines)]


def _grouped(n_users: int, seed: int) -> list[tuple[int, int]]:
    """SASRec's shape: each user's lines together, users not in id order."""
    rng = random.Random(seed)
    users = list(range(1, n_users + 1))
    rng.shuffle(users)
    return [(u, rng.randrange(1, 50)) for u in users for _ in range(rng.randrange(3, 12))]


def _write(path, pairs, sep=" ") -> None:
    path.write_text("".join(f"{u}{sep}{i}\n" for u, i in pairs))


def _sequences_by_line_order(pairs):
    expected: dict[str, list[str]] = {}
    for u, i in pairs:
        expected.setdefault(str(u), []).append(str(i))
    return expected


def test_line_numbers_survive_many_partitions(spark, tmp_path):
    path = tmp_path / "lines.txt"
    pairs = _interleaved(3000, 40, seed=1)
    _write(path, pairs)
    lines = read_numbered_lines(spark, str(path), min_partitions=7)
    assert lines.rdd.getNumPartitions() >= 7  # the file really was split
    got = {row["line"]: row["value"] for row in lines.collect()}
    assert got == {n: f"{u} {i}" for n, (u, i) in enumerate(pairs, 1)}


@pytest.mark.parametrize("shape", ["interleaved", "grouped"])
def test_sequences_come_out_in_line_order(spark, tmp_path, shape):
    pairs = _interleaved(2500, 30, seed=2) if shape == "interleaved" else _grouped(200, seed=3)
    path = tmp_path / "Beauty.txt"
    _write(path, pairs, sep="\t" if shape == "grouped" else " ")
    df = read_interactions(spark, path, fmt=FMT)
    assert [f.name for f in df.schema] == ["user_id", "item", "timestamp", "rating"]
    rows = (df.groupBy("user_id")
            .agg(F.sort_array(F.collect_list(F.struct("timestamp", "item"))).alias("events"),
                 F.max("rating").alias("rating"))
            .collect())
    got = {r["user_id"]: [e["item"] for e in r["events"]] for r in rows}
    assert got == _sequences_by_line_order(pairs)
    times = df.agg(F.min("timestamp"), F.max("timestamp"), F.countDistinct("timestamp")).first()
    assert tuple(times) == (1, len(pairs), len(pairs))  # the 1-based line number, one per line
    assert all(r["rating"] is None for r in rows)


@pytest.mark.parametrize("bad, shown", [("7 8 9", "'7 8 9'"), ("", "''")])
def test_bad_line_past_the_preflight_window_named_by_spark(spark, tmp_path, bad, shown):
    pairs = _interleaved(preflight.PREFLIGHT_LINES + 500, 20, seed=4)
    lines = [f"{u} {i}" for u, i in pairs]
    lines[preflight.PREFLIGHT_LINES + 99] = bad  # line PREFLIGHT_LINES + 100
    path = tmp_path / "late.txt"
    path.write_text("\n".join(lines) + "\n")
    preflight.check_interactions(str(path), FMT)  # the first lines are fine
    with pytest.raises(InputError) as err:
        read_interactions(spark, path, fmt=FMT)
    line = preflight.PREFLIGHT_LINES + 100
    assert str(err.value) == (f"{path}: 1 of {len(lines)} lines are not {preflight.LINE_ORDER_FORMATS[FMT][0]}; "
                              f"the first, line {line}, is {shown}")


def test_prepare_refuses_bad_input_before_spark(tmp_path, capsys):
    good = tmp_path / "ok.txt"
    _write(good, _interleaved(20, 3, seed=5))
    bad = tmp_path / "bad.txt"
    bad.write_text("1 10\n1 11\n2 10 5\n")
    for text, line in (("1 2\n7 x", 2), ("7", 1), ("1 2\n\n3 4", 2), ("1\t2\r\n3 4.0", 2)):
        wrong = tmp_path / "wrong.txt"
        wrong.write_text(text + "\n")
        with pytest.raises(InputError, match=f"^{re.escape(str(wrong))}: line {line}: expected `user item`"):
            preflight.check_interactions(str(wrong), FMT)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(InputError, match="empty input"):
        preflight.check_interactions(str(empty), FMT)
    folder = tmp_path / "folder"
    folder.mkdir()
    cases = [
        (["--input", str(bad), "--format", FMT], f"{bad}: line 3: expected `user item`"),
        (["--input", str(folder), "--format", FMT], "reads one file, not a folder"),
        (["--input", str(good), "--format", FMT, "--user-col", "u"], "--user-col does not apply to --format"),
        (["--input", str(good)], f"needs --format {FMT}"),  # .txt is never guessed
    ]
    for argv, message in cases:
        out = tmp_path / "out"
        assert prepare.main([*argv, "--output", str(out), "--tracking-uri", "none"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
        assert not out.exists()
