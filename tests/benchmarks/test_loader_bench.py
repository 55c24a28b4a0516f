"""benchmarks/loader_bench.py at toy sizes, in process: the shard it writes is read by the trainer's
loader, every variant's row has positive rates and the steps' count, the baseline is 1.00x; a
balance job's shard set (written here without Spark) is measured as given; bad arguments stop it
in one line."""
from __future__ import annotations

import re

import pytest

from tests import helpers

ROW = re.compile(r"^\| (read[^|]*) \| (\d+\.\d\d)M \| \[(\d+\.\d\d)M, (\d+\.\d\d)M\] \| (\d+) \| (\d+\.\d\d)x \|$")


def table_rows(text: str) -> dict[str, tuple[float, float, float, int, float]]:
    rows = {}
    for line in text.splitlines():
        if match := ROW.match(line):
            median, low, high, ratio = (float(match.group(i)) for i in (2, 3, 4, 6))
            rows[match.group(1)] = (median, low, high, int(match.group(5)), ratio)
    return rows


def test_the_smoke_run_measures_every_variant(tmp_path, capsys, monkeypatch):
    from benchmarks import loader_bench

    monkeypatch.setenv("FREESCALE_COMMIT", "abc1234")  # no git process: the fast tier starts none
    output = tmp_path / "loader.md"
    assert loader_bench.main(["--smoke", "--output", str(output)]) == 0
    text = capsys.readouterr().out
    assert output.read_text() == text and "SMOKE RUN" in text and "- commit: abc1234" in text
    rows = table_rows(text)
    assert list(rows) == ["read", "read + collate", "read + collate, prefetch 2"]
    steps = -(-loader_bench.SMOKE.samples // loader_bench.SMOKE.local_batch_size)
    for median, low, high, batches, ratio in rows.values():
        assert 0 < low <= median <= high and ratio > 0 and batches == steps
    assert rows["read + collate"][4] == 1.0
    assert re.search(r"- shard: written here: .*; 96 histories, [\d,]+ tokens", text)


def test_a_balance_jobs_shard_set_is_measured_as_given(tmp_path, capsys):
    from benchmarks import loader_bench

    shards = helpers.write_shards(tmp_path / "shards", num_steps=5)
    assert loader_bench.main(["--shards", str(shards), "--rank", "1", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    files = len(helpers.load_manifest(shards)["ranks"][1]["files"])
    assert f"- shard: rank 1 of {shards}; " in text and f" 5 steps of 4 per rank, {files} file(s) of " in text
    assert {batches for *_, batches, _ in table_rows(text).values()} == {5}


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--samples, --max-length, --local-batch-size, --repeats and --prefetch must be >= 1"),
    (["--mean-length", "5000"], "--mean-length must be in 1..--max-length, got 5000"),
    (["--shards", "nowhere"], "--shards nowhere: no manifest.json"),
])
def test_bad_arguments_stop_it_in_one_line(capsys, argv, message):
    from benchmarks import loader_bench

    with pytest.raises(SystemExit) as stopped:
        loader_bench.main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_the_commit_is_read_from_gits_files(tmp_path, monkeypatch):
    """HEAD's branch as a loose ref, a packed ref, through a worktree's ``gitdir:`` file, or detached;
    nothing to read is None (the line then says so): no git process either way."""
    from benchmarks import common

    sha, other = "a" * 40, "b" * 40
    main = tmp_path / "repo" / ".git"
    (main / "refs" / "heads").mkdir(parents=True)
    (main / "HEAD").write_text("ref: refs/heads/main\n")
    (main / "refs" / "heads" / "main").write_text(sha + "\n")
    assert common.head_commit(main) == sha
    (main / "refs" / "heads" / "main").unlink()
    (main / "packed-refs").write_text(f"# pack-refs with: peeled\n{other} refs/heads/side\n{sha} refs/heads/main\n")
    assert common.head_commit(main) == sha
    worktree = main / "worktrees" / "wt"
    worktree.mkdir(parents=True)
    (worktree / "HEAD").write_text("ref: refs/heads/side\n")
    (worktree / "commondir").write_text("../..\n")
    checkout = tmp_path / "wt"
    checkout.mkdir()
    (checkout / ".git").write_text(f"gitdir: {worktree}\n")
    assert common.head_commit(checkout / ".git") == other
    (worktree / "HEAD").write_text(other + "\n")
    assert common.head_commit(checkout / ".git") == other
    assert common.head_commit(tmp_path / "nowhere" / ".git") is None
    monkeypatch.delenv("FREESCALE_COMMIT", raising=False)
    monkeypatch.setattr(common, "REPO", checkout)
    assert common.commit() == other[:7]
