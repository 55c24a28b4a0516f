"""The trainer on 2 gloo ranks, launched through torch's elastic launcher, end to end."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shards.manifest import load_manifest, seal

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def freescale_train(shards: Path, *args: str, nproc: int = 2, timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jobs.cli", "train", "--shards", str(shards), "--nproc-per-node", str(nproc),
           *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def error_lines(run: subprocess.CompletedProcess) -> list[str]:
    """The launch's error lines: one, gathering the failed ranks' reasons (theirs are in the log)."""
    return [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("freescale train: error:")]


# A small model, and the end-of-run evaluation on 64 samples per rank (all 943 users, test and
# validation item, cost ~1 s per run): tests that measure evaluation pass --training.eval_max_samples 0.
SMALL_RUN = ("--model.hstu.num_layers", "1", "--loss.num_negatives", "32", "--training.eval_max_samples", "64")


def small_run_args(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return ["--tracking-uri", "none", "--summary-json", str(tmp_path / f"{name}.json"), *SMALL_RUN, *extra]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_exact_resume_matches_uninterrupted_run(movielens_shards, tmp_path, sharding):
    """Sharded item table (either way), table-wise user feature tables, dense part and
    both optimizers come back exactly. Table-wise puts whole tables on one rank, so
    the other rank restores tensors it holds no shard of."""
    manifest = json.loads((movielens_shards / "manifest.json").read_text())
    assert [f["name"] for f in manifest["user_features"]] == ["age", "gender", "occupation", "zip_code"]
    sharding_args = ("--parallel.sharding", sharding, "--comm-mode", "prioritized")
    whole = freescale_train(movielens_shards, "--max-steps", "6", *small_run_args(tmp_path, "whole", *sharding_args))
    assert whole.returncode == 0, whole.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    first = freescale_train(movielens_shards, "--max-steps", "3", "--checkpoint.folder", str(ckpt),
                            *small_run_args(tmp_path, "first", *sharding_args))
    assert first.returncode == 0, first.stderr[-3000:]
    assert (ckpt / "step_3" / "COMPLETE").exists()
    second = freescale_train(movielens_shards, "--max-steps", "6", "--checkpoint.folder", str(ckpt),
                             *small_run_args(tmp_path, "second", *sharding_args))
    assert second.returncode == 0, second.stderr[-3000:]
    whole_log = json.loads((tmp_path / "whole.json").read_text())
    first_log = json.loads((tmp_path / "first.json").read_text())
    second_log = json.loads((tmp_path / "second.json").read_text())
    assert second_log["steps"] == [3, 4, 5]
    assert first_log["losses"] + second_log["losses"] == whole_log["losses"]
    if sharding == "row_wise":
        # The checkpoint's loader position means nothing in another shard set: refused.
        other = copy_shards(movielens_shards, tmp_path / "other")
        manifest["seed"] = manifest.get("seed", 0) + 1
        (other / "manifest.json").write_text(json.dumps(seal(manifest)))  # a deliberate edit, resealed
        elsewhere = freescale_train(other, "--max-steps", "6", "--checkpoint.folder", str(ckpt),
                                    *small_run_args(tmp_path, "elsewhere", *sharding_args))
        assert elsewhere.returncode == 2  # bad input (jobs/job_errors.py)
        lines = error_lines(elsewhere)
        assert lines and all("was written for other shards" in line for line in lines), lines
    # the model learned: later losses below the first
    assert whole_log["losses"][-1] < whole_log["losses"][0]


@pytest.mark.slow
def test_world_size_mismatch_names_both_numbers(movielens_shards, tmp_path):
    run = freescale_train(movielens_shards, "--max-steps", "2", *small_run_args(tmp_path, "x"), nproc=1)
    assert run.returncode == 2
    lines = error_lines(run)
    assert lines and "2" in lines[0] and "1" in lines[0], (run.stdout + run.stderr)[-2000:]


def copy_shards(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_missing_manifest_is_one_line_on_every_rank(movielens_shards, tmp_path):
    shards = copy_shards(movielens_shards, tmp_path / "s")
    (shards / "manifest.json").unlink()
    run = freescale_train(shards, "--max-steps", "2", *small_run_args(tmp_path, "x"))
    assert run.returncode == 2
    lines = error_lines(run)
    assert len(lines) == 1 and "no manifest.json" in lines[0] and "(ranks 0, 1 of 2 failed)" in lines[0], lines


@pytest.mark.slow
def test_corrupt_parquet_stops_every_rank_without_hanging(movielens_shards, tmp_path):
    shards = copy_shards(movielens_shards, tmp_path / "s")
    victim = sorted((shards / "rank=1").glob("*.parquet"))[0]
    victim.write_bytes(b"\x00" * victim.stat().st_size)
    started = time.monotonic()
    run = freescale_train(shards, "--max-steps", "2", *small_run_args(tmp_path, "x"), timeout=120)
    assert run.returncode == 2
    assert time.monotonic() - started < 120
    lines = error_lines(run)
    assert any(victim.name in line for line in lines), lines
    assert any("rank 0" in line for line in lines), lines  # the healthy rank stopped too


@pytest.mark.slow
def test_item_id_beyond_table_names_the_id(movielens_shards, tmp_path):
    shards = copy_shards(movielens_shards, tmp_path / "s")
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["num_items"] = 50
    (shards / "manifest.json").write_text(json.dumps(seal(manifest)))  # a deliberate edit, resealed
    run = freescale_train(shards, "--max-steps", "2", *small_run_args(tmp_path, "x"), timeout=120)
    assert run.returncode == 2
    output = run.stdout + run.stderr
    assert "50" in output and "item" in output.lower()


@pytest.mark.slow
def test_empty_rank_shard_is_refused(movielens_shards, tmp_path):
    shards = copy_shards(movielens_shards, tmp_path / "s")
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["ranks"][1]["rows"] = 0
    manifest["ranks"][1]["files"] = []
    (shards / "manifest.json").write_text(json.dumps(seal(manifest)))  # a deliberate edit, resealed
    run = freescale_train(shards, "--max-steps", "2", *small_run_args(tmp_path, "x"), timeout=120)
    assert run.returncode == 2
    lines = error_lines(run)
    assert lines and all("rank 1" in line or "rank=1" in line for line in lines), lines


@pytest.mark.slow
def test_two_rank_run_logs_to_mlflow_server(movielens_shards, tmp_path, mlflow_server):
    run = freescale_train(movielens_shards, "--max-steps", "8", "--tracking-uri", mlflow_server,
                          "--run-name", "e2e", "--summary-json", str(tmp_path / "s.json"),
                          "--model.hstu.num_layers", "1", "--loss.num_negatives", "32")
    assert run.returncode == 0, run.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("freescale").experiment_id])
    assert len(runs) == 1
    logged = runs[0]
    for name in ("loss", "step_time_s", "samples_per_s", "bubble_fraction", "imbalance",
                 "hr_at_10", "ndcg_at_10", "mrr"):
        assert name in logged.data.metrics, name
    assert logged.data.tags["freescale.strategy"] == "kk" and logged.data.tags["freescale.world_size"] == "2"
    assert "freescale.code_version" in logged.data.tags
    assert logged.data.params["training.max_steps"] == "8" and logged.data.params["model.hstu.num_layers"] == "1"
    history = client.get_metric_history(logged.info.run_id, "step/loss")
    assert sorted(m.step for m in history) == list(range(8))
    artifacts = [a.path for a in client.list_artifacts(logged.info.run_id)]
    assert "rank_timelines.png" in artifacts
    log = json.loads((tmp_path / "s.json").read_text())
    summary = log["summary"]
    assert summary["eval_samples"] == 943 - 943 % 32
    # The summary's bubble is the per-step timings' (warm-up steps left out), and MLflow has it.
    import numpy as np

    from training.bubbles import bubble_fraction
    table = np.array(log["timings"]["steps_ranks_fields"])[2:]
    fields = log["timings"]["fields"]
    expected = bubble_fraction(table[..., fields.index("dense_compute_s")],
                               table[..., fields.index("step_s")].max(axis=1))
    assert summary["bubble_fraction"] == pytest.approx(expected, rel=1e-9)
    assert logged.data.metrics["bubble_fraction"] == pytest.approx(expected, rel=1e-6)
    # The cost column's unit: the shards' cost model, which freescale simulate checks.
    assert log["cost_model"] == load_manifest(movielens_shards).cost_model


def rank_process(rank: int, marker: str, timeout: float = 120) -> int:
    """PID of the training worker with RANK=`rank` whose command line holds `marker`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                environ = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if "jobs.train" in cmdline and marker in cmdline and f"RANK={rank}".encode() in environ:
                return int(proc.name)
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} worker found")


def start_long_run(shards: Path, tmp_path: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jobs.cli", "train", "--shards", str(shards), "--nproc-per-node", "2",
           "--max-steps", "100000", "--comm-mode", "prioritized", *small_run_args(tmp_path, "long"), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_training(proc: subprocess.Popen) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step "):
            return lines
    raise AssertionError("training never started:\n" + "".join(lines[-30:]))


@pytest.mark.slow
def test_a_dead_rank_stops_the_others(movielens_shards, tmp_path):
    proc = start_long_run(movielens_shards, tmp_path, "--training.log_every", "1")
    try:
        wait_for_training(proc)
        os.kill(rank_process(1, str(movielens_shards)), 9)
        started = time.monotonic()
        proc.wait(timeout=120)
        assert proc.returncode != 0
        assert time.monotonic() - started < 120
    finally:
        proc.kill()


@pytest.mark.slow
def test_a_hung_rank_hits_the_collective_timeout(movielens_shards, tmp_path):
    proc = start_long_run(movielens_shards, tmp_path, "--training.log_every", "1",
                          "--parallel.collective_timeout_s", "5")
    try:
        wait_for_training(proc)
        os.kill(rank_process(1, str(movielens_shards)), 19)  # SIGSTOP: alive but silent
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert "freescale train: error:" in output or "Timed out" in output or "timeout" in output.lower()
    finally:
        proc.kill()
