"""The prepare and balance jobs end to end on local Spark (in-process, shared session)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from freescale.jobs import balance, prepare
from tests import helpers
from tests.helpers import load_manifest, read_all, read_rank, sqlite_store

NO_TRACKING = ["--tracking-uri", "none"]


@pytest.fixture(scope="module")
def prepared_ml(movielens_prepared) -> Path:
    return movielens_prepared


@pytest.fixture(scope="module")
def prepared_synthetic(spark, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("syn") / "prepared"
    assert prepare.main(["--output", str(out), "--synthetic-users", "3000", "--synthetic-items", "800",
                         "--seed", "7", "--max-seq-len", "300", *NO_TRACKING]) == 0
    return out


def run_balance(prepared: Path, out: Path, *extra: str) -> int:
    return balance.main(["--input", str(prepared), "--output", str(out), *NO_TRACKING, *extra])


def test_prepare_movielens_counts(prepared_ml):
    meta = json.loads((prepared_ml / "prepare.json").read_text())
    assert meta["users"] == 943 and meta["num_items"] == 1682 and meta["input_interactions"] == 100_000
    assert meta["users_dropped_short"] == 0 and meta["users_truncated"] == 0
    # every interaction is a training item or one of the two held-out targets
    assert meta["train_interactions"] + 2 * meta["users"] == meta["input_interactions"]


def test_prepare_movielens_user_features(prepared_ml, movielens_dir):
    meta = json.loads((prepared_ml / "prepare.json").read_text())
    users = pq.read_table(movielens_dir / "users.parquet").to_pandas()
    names = ["age", "gender", "occupation", "zip_code"]
    assert meta["user_features"] == [{"name": n, "num_ids": users[n].nunique() + 1} for n in names]
    assert meta["users_without_features"] == 0
    sequences = pq.read_table(prepared_ml / "sequences", columns=["user_id", "user_features"]).to_pandas()
    vocab = pq.read_table(prepared_ml / "user_feature_vocab").to_pandas()
    ids = {(r.feature, r.value): r.id for r in vocab.itertuples()}
    # a sequence's ids decode back to its user's row of the user table
    expected = {str(r.user_id): [ids[(n, str(getattr(r, n)))] for n in names] for r in users.itertuples()}
    assert all(list(f) == expected[u] for u, f in zip(sequences["user_id"], sequences["user_features"]))


def test_prepare_bad_user_table_leaves_nothing(spark, movielens_dir, tmp_path, capsys):
    bad = tmp_path / "users.parquet"
    pq.write_table(pa.table({"user_id": [1, 1], "age": [20, 30]}), bad)
    rc = prepare.main(["--input", str(movielens_dir / "ratings.parquet"), "--user-features", str(bad),
                       "--output", str(tmp_path / "out"), *NO_TRACKING])
    assert_one_line_error(capsys, rc, "user '1' appears 2 times")
    assert not (tmp_path / "out").exists()


def test_balance_movielens_every_sample_once(prepared_ml, tmp_path):
    out = tmp_path / "shards"
    assert run_balance(prepared_ml, out, "--world-size", "4", "--local-batch-size", "16",
                       "--strategy", "kk", "--window-steps", "4", "--leftover", "drop") == 0
    manifest = load_manifest(out)
    rows = read_all(out)
    assert manifest["leftover"] == {"policy": "drop", "samples": 943 % 64}
    assert manifest["num_samples"] == len(rows) == 943 - 943 % 64
    assert rows["user_id"].is_unique
    assert manifest["num_steps"] == 943 // 64 and manifest["num_items"] == 1682
    # what the trainer loads: sealed, typed, totals consistent with the files
    from freescale.shards.manifest import load_manifest as load_checked
    checked = load_checked(out, 4)
    assert checked.num_rows == len(rows) and checked.strategy == "kk" and len(checked.user_features) == 4
    # each step holds exactly one global batch, and knows its targets over all ranks
    assert (rows.groupby("step").size() == 64).all()
    per_step = rows.groupby("step").agg(targets=("length", lambda x: int((x - 1).sum())),
                                        step_targets=("step_targets", "first"))
    assert (per_step["targets"] == per_step["step_targets"]).all()
    # the leftover is exactly the users missing from the shards
    sequences = pq.read_table(prepared_ml / "sequences").to_pandas()
    assert len(set(sequences["user_id"]) - set(rows["user_id"])) == manifest["leftover"]["samples"]
    # a shard row carries its sequence unchanged
    merged = rows.merge(sequences, on="user_id", suffixes=("", "_src"))
    assert all(np.array_equal(a, b) for a, b in zip(merged["items"], merged["items_src"]))
    assert (merged["test_item"] == merged["test_item_src"]).all()
    assert all(np.array_equal(a, b) for a, b in zip(merged["user_features"], merged["user_features_src"]))
    assert manifest["user_features"] == json.loads((prepared_ml / "prepare.json").read_text())["user_features"]
    assert manifest["stats"]["bubble"] < manifest["stats"]["bubble_contiguous"]


def test_shards_in_step_order_with_valid_checksums(prepared_ml, tmp_path):
    out = tmp_path / "shards"
    assert run_balance(prepared_ml, out, "--world-size", "3", "--local-batch-size", "8") == 0
    manifest = load_manifest(out)
    for rank_entry in manifest["ranks"]:
        frame = read_rank(out, rank_entry["rank"])
        assert len(frame) == rank_entry["rows"]
        keys = list(zip(frame["step"], frame["slot"]))
        assert keys == sorted(keys)
        for f in rank_entry["files"]:
            data = (out / f["path"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == f["sha256"] and len(data) == f["bytes"]
            assert pq.ParquetFile(out / f["path"]).metadata.num_rows == f["rows"]


def test_synthetic_equal_counts_and_token_cap(prepared_synthetic, tmp_path):
    out = tmp_path / "shards"
    assert run_balance(prepared_synthetic, out, "--leftover", "drop", "--world-size", "4", "--local-batch-size", "8",
                       "--equal-counts", "--token-cap", "4000", "--window-steps", "8") == 0
    rows = read_all(out)
    per_rank_step = rows.groupby(["step", "rank"]).agg(n=("user_id", "size"), tokens=("length", "sum"))
    assert (per_rank_step["n"] == 8).all()
    assert per_rank_step["tokens"].max() <= 4000
    assert rows["user_id"].is_unique and len(rows) == 3000 - 3000 % 32


def test_balance_flops_kk_through_the_cli(prepared_ml, tmp_path, capsys):
    """The peer's online FLOP balancer: equal counts per (step, rank) without --equal-counts, one step
    per window; a window or a token cap is refused in one line before Spark starts."""
    out = tmp_path / "shards"
    assert run_balance(prepared_ml, out, "--leftover", "drop", "--world-size", "4", "--local-batch-size", "16",
                       "--strategy", "flops_kk", "--flop-width", "32") == 0
    manifest = load_manifest(out)
    assert manifest["strategy"] == "flops_kk"
    rows = read_all(out)
    assert (rows.groupby(["step", "rank"]).size() == 16).all()
    assert manifest["moved_samples"] == 0
    assert manifest["stats"]["bubble"] < manifest["stats"]["bubble_contiguous"]
    capsys.readouterr()
    for extra, fragment in ((["--window-steps", "4"], "--window-steps must be 1, got 4"),
                            (["--token-cap", "5000"], "takes no --token-cap")):
        rc = run_balance(prepared_ml, tmp_path / "refused", "--world-size", "4", "--local-batch-size", "16",
                         "--strategy", "flops_kk", *extra)
        assert_one_line_error(capsys, rc, fragment)
        assert not (tmp_path / "refused").exists()


def test_the_default_keeps_the_leftover_as_a_short_last_step(prepared_ml, tmp_path):
    out = tmp_path / "shards"
    assert run_balance(prepared_ml, out, "--world-size", "4", "--local-batch-size", "16") == 0
    rows = read_all(out)
    assert len(rows) == 943 and rows["user_id"].is_unique  # every user trains, every epoch
    manifest = load_manifest(out)
    assert manifest["leftover"] == {"policy": "keep", "samples": 0} and manifest["num_steps"] == 943 // 64 + 1
    # the short last step is planned over the ranks like any step, and its targets are its own
    last = rows[rows["step"] == manifest["num_steps"] - 1]
    assert len(last) == 943 % 64 and last["rank"].nunique() > 1
    assert int((last["length"] - 1).sum()) == int(last["step_targets"].iloc[0])


@pytest.mark.extended
def test_deterministic_for_a_seed(prepared_ml, tmp_path):
    def assignment(out, seed):
        assert run_balance(prepared_ml, out, "--world-size", "4", "--local-batch-size", "16",
                           "--window-steps", "4", "--seed", seed) == 0
        return read_all(out).sort_values("user_id")[["user_id", "step", "rank", "slot"]].to_numpy().tolist()

    first = assignment(tmp_path / "a", "3")
    assert first == assignment(tmp_path / "b", "3")
    assert first != assignment(tmp_path / "c", "4")


def test_mirror_control_gives_every_rank_the_same_samples(prepared_ml, tmp_path):
    out = tmp_path / "shards"
    assert run_balance(prepared_ml, out, "--world-size", "3", "--local-batch-size", "8",
                       "--control", "mirror") == 0
    rows = read_all(out)
    manifest = load_manifest(out)
    assert manifest["control"] == "mirror" and manifest["num_steps"] == 943 // 24
    assert manifest["leftover"]["policy"] == "drop"  # whole steps only, whatever --leftover says
    by_rank = [read_rank(out, r).groupby("step")["user_id"].apply(list) for r in range(3)]
    assert by_rank[0].equals(by_rank[1]) and by_rank[0].equals(by_rank[2])
    assert len(rows) == 3 * 8 * manifest["num_steps"]


def assert_one_line_error(capsys, rc: int, *fragments: str) -> None:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_keep_that_would_leave_ranks_empty_is_refused(prepared_ml, tmp_path, capsys):
    """It used to write 4,057 empty rank shards that the trainer then refused."""
    rc = run_balance(prepared_ml, tmp_path / "out", "--world-size", "5000", "--local-batch-size", "1",
                     "--leftover", "keep")
    assert_one_line_error(capsys, rc, "943 samples for --world-size 5000: 4057 ranks would get none")
    assert not (tmp_path / "out").exists()


def test_an_all_zero_cost_model_is_refused(prepared_ml, tmp_path, capsys):
    """It used to write NaN bubbles into the manifest."""
    model = tmp_path / "zero.json"
    model.write_text(json.dumps({"format": "freescale.cost_model/1", "kind": "quadratic", "a": 0, "b": 0, "c": 0}))
    rc = run_balance(prepared_ml, tmp_path / "out", "--world-size", "2", "--local-batch-size", "4",
                     "--cost-model", str(model))
    assert_one_line_error(capsys, rc, str(model), "predicts zero cost at every length")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag,value", [("--world-size", "0"), ("--local-batch-size", "-3"),
                                        ("--window-steps", "0")])
def test_balance_rejects_non_positive_sizes(prepared_ml, tmp_path, capsys, flag, value):
    sizes = {"--world-size": "2", "--local-batch-size": "4", "--window-steps": "1", flag: value}
    rc = run_balance(prepared_ml, tmp_path / "out", *[x for kv in sizes.items() for x in kv])
    assert_one_line_error(capsys, rc, flag, value)
    assert not (tmp_path / "out").exists()


def test_balance_rejects_bad_cost_model(prepared_ml, tmp_path, capsys):
    bad = tmp_path / "cost.json"
    bad.write_text("{not json")
    rc = run_balance(prepared_ml, tmp_path / "out", "--world-size", "2", "--local-batch-size", "4",
                     "--cost-model", str(bad))
    assert_one_line_error(capsys, rc, "cost.json")
    assert not (tmp_path / "out").exists()


def test_balance_refuses_existing_output_without_overwrite(prepared_ml, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    rc = run_balance(prepared_ml, out, "--world-size", "2", "--local-batch-size", "4")
    assert_one_line_error(capsys, rc, str(out), "--overwrite")
    assert (out / "keep.txt").read_text() == "precious"
    assert run_balance(prepared_ml, out, "--world-size", "2", "--local-batch-size", "4", "--overwrite") == 0
    assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()
    assert not list(tmp_path.glob("out.*")), "staging or retired directories left behind"


def test_an_existing_local_output_is_refused_before_spark_starts(prepared_ml, tmp_path, capsys, monkeypatch):
    """A scheduler's accidental rerun learns it in a second, not after Spark's ~10 s start."""
    from freescale.runtime import session

    monkeypatch.setattr(session, "build_spark_session", lambda *a, **k: pytest.fail("Spark was started"))
    out = tmp_path / "out"
    out.mkdir()
    rc = prepare.main(["--output", str(out), "--synthetic-users", "10", *NO_TRACKING])
    assert_one_line_error(capsys, rc, f"output {out} already exists", "--overwrite")
    rc = run_balance(prepared_ml, out, "--world-size", "2", "--local-batch-size", "4")
    assert_one_line_error(capsys, rc, f"output {out} already exists", "--overwrite")
    assert list(out.iterdir()) == []


def test_balance_infeasible_token_cap_leaves_nothing(prepared_ml, tmp_path, capsys):
    rc = run_balance(prepared_ml, tmp_path / "out", "--world-size", "2", "--local-batch-size", "4",
                     "--token-cap", "100")
    assert_one_line_error(capsys, rc, "100")
    assert not list(tmp_path.iterdir())


def test_balance_rejects_input_without_sequences(spark, tmp_path, capsys):
    pq.write_table(pa.table({"user_id": ["a"], "foo": [1]}), tmp_path / "x.parquet")
    rc = run_balance(tmp_path / "x.parquet", tmp_path / "out", "--world-size", "2", "--local-batch-size", "4")
    assert_one_line_error(capsys, rc, "items")
    assert not (tmp_path / "out").exists()


def test_balance_rejects_too_few_samples(prepared_ml, tmp_path, capsys):
    rc = run_balance(prepared_ml, tmp_path / "out", "--leftover", "drop", "--world-size", "100",
                     "--local-batch-size", "10")
    assert_one_line_error(capsys, rc, "943", "1000")


@pytest.mark.parametrize("case", ["missing_column", "mistyped_timestamp", "null_user", "null_item", "empty",
                                  "no_such_path"])
def test_prepare_bad_input(spark, tmp_path, capsys, case):
    src = tmp_path / "in.parquet"
    table = {"user_id": ["u1", "u2"], "item_id": ["i1", "i2"], "timestamp": [1, 2]}
    expected = {"missing_column": "timestamp", "mistyped_timestamp": "timestamp", "null_user": "user_id",
                "null_item": "item_id", "empty": "in.parquet", "no_such_path": "nowhere"}[case]
    types = {"user_id": pa.string(), "item_id": pa.string(), "timestamp": pa.int64()}
    if case == "missing_column":
        del table["timestamp"]
    elif case == "mistyped_timestamp":
        table["timestamp"], types["timestamp"] = ["yesterday", "today"], pa.string()
    elif case == "null_user":
        table["user_id"][1] = None
    elif case == "null_item":
        table["item_id"][0] = None
    elif case == "empty":
        table = {k: v[:0] for k, v in table.items()}
    if case == "no_such_path":
        src = tmp_path / "nowhere.parquet"
    else:
        pq.write_table(pa.table(table, schema=pa.schema([(k, types[k]) for k in table])), src)
    rc = prepare.main(["--input", str(src), "--output", str(tmp_path / "out"), *NO_TRACKING])
    assert_one_line_error(capsys, rc, expected)
    assert not (tmp_path / "out").exists()


def test_jobs_log_to_mlflow(prepared_ml, tmp_path):
    import mlflow

    uri = sqlite_store(tmp_path / "mlflow.db")
    assert balance.main(["--input", str(prepared_ml), "--output", str(tmp_path / "out"), "--world-size", "2",
                         "--local-batch-size", "16", "--tracking-uri", uri, "--experiment", "jobs-test"]) == 0
    client = mlflow.tracking.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("jobs-test").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    manifest = load_manifest(tmp_path / "out")
    assert run.data.params["world_size"] == "2" and run.data.params["strategy"] == "kk"
    assert run.data.metrics["bubble"] == pytest.approx(manifest["stats"]["bubble"])
    assert run.data.metrics["leftover_samples"] == manifest["leftover"]["samples"]
    assert run.data.tags["freescale.job"] == "balance"


def _loaded_after(code: str, timeout: float = 120) -> tuple[list[str], str]:
    """Run ``code`` in a fresh interpreter; which heavy modules it loaded (helpers.HEAVY), and its stderr."""
    run = helpers.loaded_after(code, timeout)
    assert run.returncode == 0, run.stderr
    return helpers.heavy_loaded(run), run.stderr


@pytest.mark.spawns
@pytest.mark.parametrize("job", ["prepare", "balance", "calibrate", "cli"])
def test_importing_a_job_loads_nothing_heavy(job):
    assert _loaded_after(f"import freescale.jobs.{job}")[0] == []


@pytest.mark.spawns
def test_balance_argument_error_is_one_line_before_any_heavy_import():
    """`freescale balance --world-size 0` is reported before any heavy import (the error handling
    once imported the trainer's config, and with it torch and torchrec): through the installed
    command, and with nothing heavy loaded. How long it takes is benchmarks/latency_bench.py's."""
    import subprocess
    import sys

    command = [str(Path(sys.executable).parent / "freescale"), "balance", "--input", "x", "--output", "y",
               "--world-size", "0", "--local-batch-size", "4"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["freescale balance: error: --world-size must be a positive "
                                               "integer, got 0"]
    loaded, stderr = _loaded_after("from freescale.jobs import balance\n"
                                   "balance.main(['--input', 'x', '--output', 'y', '--world-size', '0', "
                                   "'--local-batch-size', '4'])")
    assert loaded == [], stderr


@pytest.mark.spawns
def test_prepare_argument_error_loads_nothing_heavy():
    loaded, stderr = _loaded_after("from freescale.jobs import prepare\n"
                                   "assert prepare.main(['--output', 'y', '--max-seq-len', '0']) == 2")
    assert loaded == [] and stderr.strip() == "freescale prepare: error: --max-seq-len must be a positive integer, got 0"


@pytest.mark.slow
@pytest.mark.spawns
def test_prepare_and_balance_runs_never_load_torch():
    """The data jobs, MLflow tracking included, run without torch or torchrec in the driver (the
    run is the session's, started in the background: tests/helpers.py's DataJobsRun)."""
    data_jobs = helpers.DATA_JOBS[0] if helpers.DATA_JOBS else helpers.DataJobsRun()
    run = data_jobs.result()
    assert run.returncode == 0, run.stderr
    assert (data_jobs.root / "out" / "shards" / "manifest.json").exists(), run.stderr
    assert helpers.heavy_loaded(run) == ["pyspark"], run.stderr
