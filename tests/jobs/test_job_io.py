"""The jobs' input/output guards (issue 8): an output never overwrites an input, any path
works (space, non-ASCII, %), duplicate interactions are dropped and counted, bad local
input fails before Spark starts, and what a killed run leaves is cleaned up by the next.

In-process job runs share the test session's Spark (``spark`` fixture); subprocesses only
where the point is a fresh interpreter (nothing heavy loaded) or a kill -9.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from freescale.jobs import balance, prepare
from freescale.runtime.paths import overlap, to_uri

REPO_ROOT = Path(__file__).resolve().parents[2]
NO_TRACKING = ["--tracking-uri", "none"]
# A space, a non-ASCII character and a percent sign in one folder name: each broke
# the balance job's path -> URI step (ArrowInvalid: Cannot parse URI).
ODD_NAME = "with space ä%"


def assert_one_line_error(capsys, rc: int, *fragments: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def write_interactions(path: Path, rows: int = 30) -> None:
    pq.write_table(pa.table({"user_id": [f"u{i % 5}" for i in range(rows)],
                             "item_id": [f"i{i % 7}" for i in range(rows)],
                             "timestamp": list(range(rows))}), path)


@pytest.fixture(scope="module")
def odd_prepared(spark, tmp_path_factory) -> Path:
    """Synthetic data prepared into a folder whose name has a space, 'ä' and '%'."""
    out = tmp_path_factory.mktemp("odd") / ODD_NAME / "prepared"
    assert prepare.main(["--output", str(out), "--synthetic-users", "300", "--synthetic-items", "100",
                         *NO_TRACKING]) == 0
    return out


# ---------------------------------------------------------------- 1. an output never replaces an input


def test_overlap_relations(tmp_path):
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "data", tmp_path / "link")
    assert overlap(tmp_path / "data", tmp_path / "data/") == "is"
    assert overlap(f"file:{tmp_path}/data", tmp_path / "data") == "is"
    assert overlap(tmp_path / "link", tmp_path / "data") == "is"  # through a symbolic link
    assert overlap(tmp_path / "data" / "out", tmp_path / "data") == "is inside"
    assert overlap(tmp_path, tmp_path / "data" / "x.parquet") == "contains"
    assert overlap(tmp_path / "data2", tmp_path / "data") is None
    assert overlap("hdfs://nn/a/b", "hdfs://nn/a") == "is inside"
    assert overlap("hdfs://nn/a", "hdfs://other/a") is None
    assert overlap("hdfs://nn/a", "/a") is None


@pytest.mark.parametrize("case", ["same", "inside", "contains", "user_features"])
def test_prepare_refuses_output_over_input(tmp_path, capsys, case):
    """`prepare --input DIR --output DIR --overwrite` exited 0 and deleted the input."""
    data = tmp_path / "data"
    data.mkdir()
    write_interactions(data / "ratings.parquet")
    before = (data / "ratings.parquet").read_bytes()
    args = {"same": ["--input", str(data), "--output", str(data)],
            "inside": ["--input", str(data), "--output", str(data / "prepared")],
            "contains": ["--input", str(data / "ratings.parquet"), "--output", str(tmp_path)],
            "user_features": ["--input", str(tmp_path / "elsewhere.parquet"),
                              "--user-features", str(data / "ratings.parquet"), "--output", str(data)]}[case]
    rc = prepare.main([*args, "--overwrite", *NO_TRACKING])
    output = args[args.index("--output") + 1]
    flag = "--user-features" if case == "user_features" else "--input"
    assert_one_line_error(capsys, rc, f"--output {output}", flag)
    assert (data / "ratings.parquet").read_bytes() == before
    assert not (data / "prepared").exists()


@pytest.mark.parametrize("flag", ["--input", "--cost-model", "--capacities"])
def test_balance_refuses_output_over_input(tmp_path, capsys, flag):
    data = tmp_path / "data"
    data.mkdir()
    (data / "cost.json").write_text("{}")
    (data / "speeds.json").write_text("{}")
    args = {"--input": ["--input", str(data), "--output", str(data)],
            "--cost-model": ["--input", str(tmp_path / "prepared"), "--cost-model", str(data / "cost.json"),
                             "--output", str(data)],
            "--capacities": ["--input", str(tmp_path / "prepared"), "--capacities", f"@{data / 'speeds.json'}",
                             "--output", str(data / "speeds.json")]}[flag]
    rc = balance.main([*args, "--world-size", "2", "--local-batch-size", "4", "--overwrite", *NO_TRACKING])
    output = args[args.index("--output") + 1]
    line = assert_one_line_error(capsys, rc, f"--output {output}", flag)
    assert "choose another output" in line
    assert (data / "cost.json").exists() and (data / "speeds.json").exists()


# ---------------------------------------------------------------- 2. paths with a space, 'ä' and '%'


@pytest.mark.parametrize("name", ["with space", "ä", "100%", "a%20b"])
def test_to_uri_quotes_and_pyarrow_reads_it_back(tmp_path, name):
    from freescale.shards.file_stats import describe_file

    folder = tmp_path / name / "rank=0"
    folder.mkdir(parents=True)
    file = folder / "part-0.parquet"
    pq.write_table(pa.table({"x": [1, 2, 3]}), file)
    hadoop_form = f"file:{file}"  # how HadoopFS.list_files names it
    uri = to_uri(hadoop_form)
    assert uri == to_uri(file) and uri.startswith("file:///") and " " not in uri and uri.isascii()
    described = describe_file(hadoop_form)  # raised ArrowInvalid: Cannot parse URI
    assert described["uri"] == hadoop_form and described["rows"] == 3
    assert described["bytes"] == file.stat().st_size


def test_to_uri_forms():
    assert to_uri("/a b/ä%/rank=0") == "file:///a%20b/%C3%A4%25/rank=0"
    assert to_uri("file:/a b") == to_uri("file:///a b") == "file:///a%20b"
    assert to_uri("hdfs://nn:8020/x y") == "hdfs://nn:8020/x%20y"
    assert to_uri("rel") == "file://" + os.path.abspath("rel")


@pytest.mark.slow
def test_prepare_and_balance_on_odd_paths_end_to_end(odd_prepared, tmp_path):
    """A space, 'ä' and '%' in the input and output paths: prepare and balance run, the
    manifest names the files, and the trainer's loader reads every rank."""
    from freescale.shards.manifest import load_manifest
    from freescale.training.data.shard_reader import build_loader

    meta = json.loads((odd_prepared / "prepare.json").read_text())
    assert meta["users"] == 300
    out = tmp_path / ODD_NAME / "shards"
    assert balance.main(["--input", str(odd_prepared), "--output", str(out), "--world-size", "2",
                         "--local-batch-size", "8", *NO_TRACKING]) == 0
    manifest = load_manifest(out, 2)
    assert manifest.input["uri"].endswith(f"{ODD_NAME}/prepared")
    seen = []
    for rank in range(2):
        batches = list(build_loader(manifest, rank, prefetch=0))
        assert len(batches) == manifest.num_steps
        seen += [u for b in batches for u in b.user_ids]
    assert len(seen) == len(set(seen)) == manifest.num_samples
    assert not list(out.parent.glob("shards.tmp-*"))


# ---------------------------------------------------------------- 3. duplicate interactions


@pytest.fixture(scope="module")
def duplicated_ratings(movielens_dir, tmp_path_factory) -> tuple[Path, int]:
    """The first 100 users' MovieLens ratings with every row appended twice more: each
    user's last event is duplicated, so its test target would equal its validation target."""
    table = pq.read_table(movielens_dir / "ratings.parquet")
    import pyarrow.compute as pc

    users = pc.cast(table["user_id"], pa.int64())
    table = table.filter(pc.less_equal(users, 100))
    path = tmp_path_factory.mktemp("dups") / "ratings.parquet"
    pq.write_table(pa.concat_tables([table, table, table]), path)
    return path, table.num_rows


def _prepared(out: Path) -> tuple[dict, object]:
    meta = json.loads((out / "prepare.json").read_text())
    sequences = pq.read_table(out / "sequences").to_pandas()
    return meta, sequences


@pytest.mark.slow
def test_prepare_drops_and_counts_duplicate_interactions(spark, duplicated_ratings, tmp_path, capsys):
    path, rows = duplicated_ratings
    out = tmp_path / "prepared"
    assert prepare.main(["--input", str(path), "--output", str(out), *NO_TRACKING]) == 0
    meta, sequences = _prepared(out)
    assert meta["duplicates_dropped"] == 2 * rows
    assert meta["input_interactions"] == 3 * rows and meta["interactions"] == rows
    assert (sequences["test_item"] == sequences["valid_item"]).sum() == 0
    assert f"{2 * rows} duplicate interactions dropped" in capsys.readouterr().out


@pytest.mark.slow
def test_prepare_keep_duplicates(spark, duplicated_ratings, tmp_path, capsys):
    path, rows = duplicated_ratings
    out = tmp_path / "prepared"
    assert prepare.main(["--input", str(path), "--output", str(out), "--keep-duplicates", *NO_TRACKING]) == 0
    meta, sequences = _prepared(out)
    assert meta["duplicates_dropped"] == 0 and meta["interactions"] == 3 * rows
    assert (sequences["test_item"] == sequences["valid_item"]).all()  # what dropping prevents
    assert f"{2 * rows} duplicate interactions kept (--keep-duplicates)" in capsys.readouterr().out


# ---------------------------------------------------------------- 8. bad input fails before Spark starts


def _run_fresh(job: str, args: list[str]) -> tuple[int, str, list[str]]:
    """``jobs.<job>.main(args)`` in a fresh interpreter: exit status, stderr and the heavy modules
    loaded (pyspark, torch): none means Spark never started."""
    probe = (f"import sys\nfrom freescale.jobs import {job}\nrc = {job}.main({args!r})\n"
             "print(rc, sorted(m for m in ('pyspark', 'torch') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300)
    rc, loaded = run.stdout.strip().splitlines()[-1].split(" ", 1)
    return int(rc), run.stderr.strip(), json.loads(loaded.replace("'", '"'))


def _bad_prepare_input(tmp_path: Path, case: str) -> tuple[list[str], tuple[str, ...]]:
    src = tmp_path / "in.parquet"
    if case == "missing":
        return ["--input", str(tmp_path / "nowhere.parquet")], ("nowhere.parquet", "does not exist")
    if case == "not_parquet":
        src.write_text("user_id,item_id,timestamp\n")
        return ["--input", str(src)], ("in.parquet", "not readable Parquet")
    if case == "missing_column":
        pq.write_table(pa.table({"user_id": ["u"], "item_id": ["i"]}), src)
        return ["--input", str(src)], ("in.parquet", "timestamp")
    if case == "named_column":
        write_interactions(src)
        return ["--input", str(src), "--rating-col", "stars"], ("in.parquet", "'stars'")
    if case == "empty":
        pq.write_table(pa.table({"user_id": pa.array([], pa.string()), "item_id": pa.array([], pa.string()),
                                 "timestamp": pa.array([], pa.int64())}), src)
        return ["--input", str(src)], ("in.parquet", "zero rows")
    if case == "user_features":
        write_interactions(src)
        users = tmp_path / "users.parquet"
        pq.write_table(pa.table({"user_id": ["u0"], "age": [3]}), users)
        return (["--input", str(src), "--user-features", str(users), "--user-feature-cols", "age,gender"],
                ("users.parquet", "'gender'"))
    if case == "item_spelt_two_ways":  # Spark gave 'movie_id' nulls for b.parquet's rows, naming neither
        folder = tmp_path / "ratings"
        folder.mkdir()
        pq.write_table(pa.table({"user_id": ["u"], "movie_id": ["i"], "timestamp": [1]}), folder / "a.parquet")
        pq.write_table(pa.table({"user_id": ["u"], "item": ["i"], "timestamp": [2]}), folder / "b.parquet")
        return ["--input", str(folder)], (f"its files name the item column differently: {folder}/a.parquet has "
                                          f"'movie_id', {folder}/b.parquet has 'item'",)
    if case == "csv_headers_differ":  # Spark reads a folder's CSV files by the first header's positions
        folder = tmp_path / "logs"
        folder.mkdir()
        (folder / "a.csv").write_text("user_id,item_id,timestamp\nu,i,1\n")
        (folder / "b.csv").write_text("item_id,user_id,timestamp\ni,u,2\n")
        return ["--input", str(folder)], (f"{folder}/b.csv has columns item_id, user_id, timestamp where "
                                          f"{folder}/a.csv has user_id, item_id, timestamp",)
    if case == "csv_empty":
        (tmp_path / "in.csv").write_text("")
        return ["--input", str(tmp_path / "in.csv")], ("in.csv: empty input (no columns and no rows)",)
    if case == "csv_header_only":
        (tmp_path / "in.csv").write_text("user_id,item_id,timestamp\n\n")
        return ["--input", str(tmp_path / "in.csv")], ("in.csv: empty input (zero rows)",)
    if case == "csv_wrong_columns":
        (tmp_path / "in.csv").write_text("who,what,when\nu,i,1\n")
        return ["--input", str(tmp_path / "in.csv")], ("in.csv: missing user column", "available columns: who")
    if case == "csv_gz_truncated":  # was refused as an unknown format ("pass fmt", an option nobody has)
        import gzip

        data = gzip.compress("".join(f"u{i},i{i},{i}\n" for i in range(5000)).encode())
        (tmp_path / "trunc.csv.gz").write_bytes(data[:len(data) // 2])
        return ["--input", str(tmp_path / "trunc.csv.gz")], (
            "trunc.csv.gz: cannot read: Compressed file ended before the end-of-stream marker was reached",)
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing", "not_parquet", "missing_column", "named_column", "empty",
                                  "user_features", "item_spelt_two_ways", "csv_headers_differ", "csv_empty",
                                  "csv_header_only", "csv_wrong_columns", "csv_gz_truncated"])
@pytest.mark.spawns
def test_prepare_bad_input_fails_before_spark(tmp_path, case):
    """A bad local input took 16-30 s to report, because Spark started first."""
    args, fragments = _bad_prepare_input(tmp_path, case)
    rc, err, loaded = _run_fresh("prepare", [*args, "--output", str(tmp_path / "out"), *NO_TRACKING])
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("freescale prepare: error: "), err
    for fragment in fragments:
        assert fragment in err, err
    assert loaded == [], (loaded, err)
    assert not (tmp_path / "out").exists()


@pytest.mark.spawns
@pytest.mark.parametrize("case", ["missing", "not_prepared", "missing_column", "empty_folder"])
def test_balance_bad_input_fails_before_spark(tmp_path, case):
    """A folder that is not a prepared dataset gave 'An error occurred while calling o54.parquet'."""
    data = tmp_path / "data"
    data.mkdir()
    if case == "missing":
        data = tmp_path / "nowhere"
        fragments = ("nowhere", "does not exist")
    elif case == "not_prepared":
        (data / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,2,3.0,4\n")
        fragments = ("ratings.csv", "not readable Parquet", "freescale prepare")
    elif case == "missing_column":
        (data / "sequences").mkdir()
        pq.write_table(pa.table({"user_id": ["a"], "items": [[1, 2]]}), data / "sequences" / "part-0.parquet")
        fragments = ("part-0.parquet", "'length'")
    else:
        fragments = ("no Parquet data files", "freescale prepare")
    rc, err, loaded = _run_fresh("balance", ["--input", str(data), "--output", str(tmp_path / "out"),
                                                      "--world-size", "2", "--local-batch-size", "4",
                                                      *NO_TRACKING])
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("freescale balance: error: input "), err
    for fragment in fragments:
        assert fragment in err, err
    assert loaded == [], (loaded, err)


# ---------------------------------------------------------------- 9. leftovers of an interrupted run


def _stale_and_decoys(parent: Path, name: str) -> tuple[list[Path], list[Path]]:
    stale = [parent / f"{name}.tmp-0123456789ab", parent / f"{name}.old-ba9876543210"]
    for folder in stale:
        (folder / "_temporary").mkdir(parents=True)
        (folder / "_temporary" / "part-0").write_text("half written")
    decoys = [parent / f"{name}.tmp-0123456789abc", parent / f"{name}.tmp-later", parent / f"{name}2.tmp-0123456789ab",
              parent / f"x{name}.tmp-0123456789ab", parent / f"{name}.bak-0123456789ab"]
    for folder in decoys:
        folder.mkdir()
    file_decoy = parent / f"{name}.tmp-fedcba987654"  # a file, not a folder the job made
    file_decoy.write_text("")
    return stale, [*decoys, file_decoy]


def test_prepare_removes_and_counts_stale_temporary_folders(spark, tmp_path, capsys):
    stale, decoys = _stale_and_decoys(tmp_path, "prepared")
    assert prepare.main(["--output", str(tmp_path / "prepared"), "--synthetic-users", "300",
                         "--synthetic-items", "100", *NO_TRACKING]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.endswith("; removed 2 stale temporary folders of an interrupted run"), out
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in decoys)


def test_balance_removes_and_counts_stale_temporary_folders(odd_prepared, tmp_path, capsys):
    stale, decoys = _stale_and_decoys(tmp_path, "shards")
    assert balance.main(["--input", str(odd_prepared), "--output", str(tmp_path / "shards"), "--world-size", "2",
                         "--local-batch-size", "8", *NO_TRACKING]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.endswith("; removed 2 stale temporary folders of an interrupted run"), out
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in decoys)


@pytest.mark.slow
@pytest.mark.extended
def test_balance_killed_then_rerun_cleans_up(odd_prepared, tmp_path, capsys):
    """kill -9 of a balance run while it writes leaves <output>.tmp-<hex>; the rerun removes
    it, says so, and leaves no temporary folder."""
    out = tmp_path / "shards"
    command = [str(Path(sys.executable).parent / "freescale"), "balance", "--input", str(odd_prepared),
               "--output", str(out), "--world-size", "2", "--local-batch-size", "8", *NO_TRACKING]
    log = tmp_path / "killed.log"
    with open(log, "w") as sink:
        # Its own process group, so the kill reaches the driver, its JVM and the Python workers.
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob("shards.tmp-*")):
            if proc.poll() is not None:
                pytest.fail(f"balance finished (rc {proc.returncode}) before its .tmp- folder was seen: "
                            f"{log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("no shards.tmp-* folder appeared within 240 s")
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(1)  # let the killed JVM's last file handles go
    assert len(list(tmp_path.glob("shards.tmp-*"))) == 1 and not out.exists()

    assert balance.main(["--input", str(odd_prepared), "--output", str(out), "--world-size", "2",
                         "--local-batch-size", "8", *NO_TRACKING]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith("; removed 1 stale temporary folder of an interrupted run"), line
    assert not list(tmp_path.glob("shards.tmp-*")) and not list(tmp_path.glob("shards.old-*"))
    assert (out / "manifest.json").exists()


def test_a_stopped_job_removes_its_staging_even_when_the_jvm_is_gone(tmp_path):
    """A stop signal sent to the job's process group takes Spark's JVM with it, and Hadoop's
    delete then fails: the local staging folder is removed all the same, and the stop goes on."""
    from freescale.runtime.atomic_output import atomic_output

    class DeadJvm:
        def exists(self, path: str) -> bool:
            return False

        def delete(self, path: str) -> None:
            raise ConnectionRefusedError("the JVM is gone")

    with pytest.raises(KeyboardInterrupt):
        with atomic_output(DeadJvm(), f"file:{tmp_path}/out", overwrite=False) as staging:
            Path(staging.removeprefix("file:"), "part-0").parent.mkdir(parents=True)
            Path(staging.removeprefix("file:"), "part-0").write_text("half\n")
            raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == []
