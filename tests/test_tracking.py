"""Tracking never stops a job: an unreachable server is one warning line; training records its
steps as it goes and its run ends FINISHED, FAILED or KILLED; a resumed training continues its run."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.tracking import DISABLED, reachable_tracking_uri
from tests.test_train import REPO, SMALL_RUN, freescale_train

DEAD_URI = "http://127.0.0.1:9/"  # the discard port: nothing listens, the connection is refused


def unreachable_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "is unreachable" in line]


def train_args(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return ["--summary-json", str(tmp_path / f"{name}.json"), *SMALL_RUN, *extra]


def runs_of(uri: str, experiment: str = "freescale") -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def logged_steps(uri: str, run_id: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, "step/loss"))


def test_an_unreachable_server_is_one_warning_line_within_seconds(capsys, monkeypatch):
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    started = time.monotonic()
    assert reachable_tracking_uri("balance", DEAD_URI) == DISABLED
    assert time.monotonic() - started < 6
    err = capsys.readouterr().err
    assert err == (f"freescale balance: warning: MLflow at {DEAD_URI} is unreachable (Connection refused); "
                   "running untracked\n")
    # the rest of the job: mlflow's own client gives up in seconds, not minutes
    assert int(os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) <= 2
    assert int(os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"]) <= 10


def test_local_stores_and_disabled_tracking_are_not_checked(capsys, tmp_path):
    assert reachable_tracking_uri("train", f"sqlite:///{tmp_path}/x.db") == f"sqlite:///{tmp_path}/x.db"
    assert reachable_tracking_uri("train", "none") == DISABLED
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_train_with_an_unreachable_server_trains_untracked(movielens_shards, tmp_path):
    started = time.monotonic()
    run = freescale_train(movielens_shards, "--max-steps", "3", "--tracking-uri", DEAD_URI,
                          *train_args(tmp_path, "dead"), timeout=90)
    assert run.returncode == 0, run.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert len(unreachable_lines(run.stdout + run.stderr)) == 1, (run.stdout + run.stderr)[-3000:]
    assert json.loads((tmp_path / "dead.json").read_text())["steps"] == [0, 1, 2]


@pytest.mark.slow
def test_balance_with_an_unreachable_server_runs_untracked(movielens_prepared, tmp_path, capfd):
    from jobs import balance

    started = time.monotonic()
    assert balance.main(["--input", str(movielens_prepared), "--output", str(tmp_path / "kk"), "--world-size", "2",
                         "--local-batch-size", "16", "--tracking-uri", DEAD_URI]) == 0
    assert time.monotonic() - started < 60
    captured = capfd.readouterr()
    assert len(unreachable_lines(captured.out + captured.err)) == 1, captured.err[-3000:]
    assert (tmp_path / "kk" / "manifest.json").exists()


def start_training(shards: Path, tmp_path: Path, uri: str, *extra: str) -> subprocess.Popen:
    """A training in its own process group (a terminal's or a scheduler's job), printing every step."""
    cmd = [sys.executable, "-m", "jobs.cli", "train", "--shards", str(shards), "--nproc-per-node", "2",
           "--tracking-uri", uri, "--training.log_every", "1", *train_args(tmp_path, "long"), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def read_until_step(proc: subprocess.Popen, step: int) -> list[str]:
    """The output up to the line of training step `step`."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) > step:  # "step DONE/TOTAL"
            return lines
    raise AssertionError(f"training ended before step {step}:\n" + "".join(lines[-40:]))


def ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # a terminal signals the whole foreground group


def scheduler_stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # a scheduler signals the process it started, the launcher alone


@pytest.mark.slow
@pytest.mark.parametrize("stop", [ctrl_c, scheduler_stop], ids=["ctrl-c", "sigterm-to-launcher"])
def test_steps_are_recorded_as_they_go_and_a_stop_signal_ends_the_run_killed(movielens_shards, tmp_path,
                                                                       mlflow_server, stop):
    assert reachable_tracking_uri("train", mlflow_server) == mlflow_server  # a live server passes the check
    proc = start_training(movielens_shards, tmp_path, mlflow_server, "--max-steps", "100000")
    try:
        read_until_step(proc, 3)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            runs = runs_of(mlflow_server)
            if runs and len(logged_steps(mlflow_server, runs[0].info.run_id)) >= 3:
                break
            time.sleep(0.5)
        assert proc.poll() is None, "the training was meant to be still running"
        [run] = runs_of(mlflow_server)
        assert run.info.status == "RUNNING"
        assert [s for s, _ in logged_steps(mlflow_server, run.info.run_id)][:3] == [0, 1, 2]
        # The launcher waits while torchrun stops the ranks with the signal.
        stop(proc)
        proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    [run] = runs_of(mlflow_server)
    assert run.info.status == "KILLED"


# A rank whose step fails: the trainer's finish of step 3 raises on both ranks.
FAILING_RANK = """
from training.trainer import Trainer

finish_step = Trainer._finish_step

def failing(self, timing):
    if self.step == 3:
        raise RuntimeError("injected failure at step 3")
    finish_step(self, timing)

Trainer._finish_step = failing
from jobs.train import main
from training.distributed import exit_without_finalization
exit_without_finalization(main())
"""


@pytest.mark.slow
def test_an_exception_ends_the_run_failed_with_the_steps_before_it(movielens_shards, tmp_path):
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           "--data.shards", str(movielens_shards), "--training.max_steps", "8", "--tracking.uri", uri,
           "--model.hstu.num_layers", "1", "--loss.num_negatives", "32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "injected failure at step 3" in run.stdout + run.stderr
    [logged] = runs_of(uri)
    assert logged.info.status == "FAILED"
    assert [s for s, _ in logged_steps(uri, logged.info.run_id)] == [0, 1, 2]


KILLS = 5
STEPS = 8


def kill_tree(root: int) -> None:
    """kill -9 of a process and all its descendants (torchrun starts each rank in its own session,
    so a process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(proc.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_kill_9_at_random_steps_then_resume_matches_an_uninterrupted_run(movielens_shards, tmp_path):
    """The issue's must-show: a kill -9 of the whole job at a random step, five times. Each
    resume gives the uninterrupted run's losses, and its MLflow run -- continued, not a new
    one -- ends FINISHED with every step's metrics exactly once."""
    whole = freescale_train(movielens_shards, "--max-steps", str(STEPS), "--tracking-uri", "none",
                            *train_args(tmp_path, "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = json.loads((tmp_path / "whole.json").read_text())["losses"]
    kill_steps = random.Random(8).choices(range(1, STEPS - 1), k=KILLS)
    for trial, kill_step in enumerate(kill_steps):
        folder, uri = tmp_path / f"ckpt{trial}", f"sqlite:///{tmp_path / f'mlflow{trial}.db'}"
        common = ("--max-steps", str(STEPS), "--checkpoint.folder", str(folder), "--checkpoint.every_steps", "1")
        proc = start_training(movielens_shards, tmp_path, uri, *common)
        try:
            read_until_step(proc, kill_step)
        finally:
            kill_tree(proc.pid)
            proc.wait(timeout=60)
        assert (folder / "LOCK").exists()  # nothing could release it
        resumed = freescale_train(movielens_shards, "--tracking-uri", uri, *common,
                                  *train_args(tmp_path, f"resumed{trial}"))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "taking over the stale lock" in resumed.stderr
        log = json.loads((tmp_path / f"resumed{trial}.json").read_text())
        first = log["steps"][0]
        assert 1 <= first <= kill_step + 1 and log["steps"] == list(range(first, STEPS)), (kill_step, log["steps"])
        assert log["losses"] == reference[first:], (trial, kill_step)
        [run] = runs_of(uri)
        assert run.info.status == "FINISHED"
        assert logged_steps(uri, run.info.run_id) == list(enumerate(reference)), (trial, kill_step)
        assert not (folder / "LOCK").exists()
