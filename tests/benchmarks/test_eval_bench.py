"""benchmarks/eval_bench.py on a small shard set written without Spark: every part of the pass is
timed and printed, the catalog table has a row per size, and bad arguments stop it in one line."""
from __future__ import annotations

import re

import pytest

from tests import helpers


def test_eval_bench_times_every_part_and_catalog(tmp_path, capsys, monkeypatch):
    from benchmarks import eval_bench

    monkeypatch.setenv("FREESCALE_COMMIT", "abc1234")  # no git process: the fast tier starts none
    shards = helpers.write_shards(tmp_path / "shards", num_items=150, num_steps=3)
    output = tmp_path / "eval.md"
    assert eval_bench.main(["--shards", str(shards), "--config", "configs/short_history.toml", "--repeats", "2",
                            "--catalogs", "500", "--catalog-queries", "100", "--output", str(output)]) == 0
    text = capsys.readouterr().out
    assert output.read_text() == text
    for part in ("read", "negatives, first", "negatives, kept", "encode", "rank, full catalog", "rank, sampled",
                 "evaluate(), first", "evaluate(), later", "evaluate(), later, the shards' batches"):
        assert f"| {part} | " in text
    assert "| 150 | " in text and "| 500 | " in text
    assert "commit abc1234;" in text
    assert re.search(r"rank 0 of \S+: [1-9]\d* samples in 3 batches, 150 items", text)


def test_eval_bench_refuses_bad_arguments(tmp_path, capsys):
    from benchmarks import eval_bench

    shards = str(helpers.write_shards(tmp_path / "shards"))
    for argv, message in ((["--shards", "nowhere"], "--shards nowhere: no manifest.json"),
                          (["--shards", shards, "--repeats", "0"], "--repeats, --threads and --catalog-queries must be >= 1"),
                          (["--shards", shards, "--catalogs", "1e5"], "--catalogs '1e5': not a comma-separated")):
        with pytest.raises(SystemExit) as stopped:
            eval_bench.main(argv)
        assert stopped.value.code == 2
        assert message in capsys.readouterr().err
