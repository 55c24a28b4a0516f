"""Checkpoint folders: one job at a time (a lock naming its holder; a stale one is taken over), and a
resume refused into another model shape or table placement, warned about with changed hyperparameters."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from training.checkpoint import CONFIG, LOCK, SHAPE_KEYS, Checkpointer
from training.config import ConfigError, TrainConfig, to_flat_dict
from tests.test_train import SMALL_RUN, freescale_train

REPO = Path(__file__).resolve().parents[1]


def write_lock(folder: Path, pid: int, host: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK).write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid, "start": None}))


def test_a_free_folder_is_locked_and_released(tmp_path):
    checkpointer = Checkpointer(str(tmp_path / "ckpt"), rank=0)
    checkpointer.lock()
    holder = json.loads((tmp_path / "ckpt" / LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    checkpointer.unlock()
    assert not (tmp_path / "ckpt" / LOCK).exists()


def test_a_live_holder_is_refused_in_one_line_naming_folder_and_holder(tmp_path, other_process):
    folder = tmp_path / "ckpt"
    write_lock(folder, other_process)
    with pytest.raises(FileExistsError) as refused:
        Checkpointer(str(folder), rank=0).lock()
    message = str(refused.value)
    assert "\n" not in message and str(folder) in message
    assert f"PID {other_process} on {socket.gethostname()}" in message
    Checkpointer(str(folder), rank=0).unlock()  # not ours: left alone
    assert json.loads((folder / LOCK).read_text())["pid"] == other_process


def test_a_holder_on_another_host_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    write_lock(folder, 1, host="elsewhere.invalid")
    with pytest.raises(FileExistsError, match="elsewhere.invalid"):
        Checkpointer(str(folder), rank=0).lock()


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = tmp_path / "ckpt"
    write_lock(folder, dead.pid)
    checkpointer = Checkpointer(str(folder), rank=0)
    checkpointer.lock()
    assert json.loads((folder / LOCK).read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"taking over the stale lock of PID {dead.pid}" in err
    checkpointer.unlock()


def test_a_reused_pid_is_stale(tmp_path, other_process):
    """The PID lives, but its start time is not the one recorded: another process got the number."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": other_process, "start": 1}))
    Checkpointer(str(folder), rank=0).lock()
    assert json.loads((folder / LOCK).read_text())["pid"] == os.getpid()


def saved_config(tmp_path: Path, **changes) -> tuple[Checkpointer, dict]:
    """A checkpointer whose step_1 recorded the default config; the config `changes` makes of it."""
    checkpointer = Checkpointer(str(tmp_path), rank=0)
    checkpointer.step_dir(1).mkdir(parents=True)
    flat = to_flat_dict(TrainConfig())
    (checkpointer.step_dir(1) / CONFIG).write_text(json.dumps(flat))
    return checkpointer, {**flat, **changes}


def test_every_shape_key_is_a_config_key():
    assert set(SHAPE_KEYS) <= set(to_flat_dict(TrainConfig()))


def test_another_model_shape_is_refused_naming_the_keys(tmp_path):
    checkpointer, config = saved_config(tmp_path, **{"model.hstu.embedding_dim": 32, "model.hstu.num_heads": 4,
                                                     "optimizer.dense_lr": 0.5})
    with pytest.raises(ConfigError) as refused:
        checkpointer.check_config(1, config)
    message = str(refused.value)
    assert "\n" not in message
    assert "model.hstu.embedding_dim 64 -> 32" in message and "model.hstu.num_heads 2 -> 4" in message
    assert "dense_lr" not in message


def test_changed_hyperparameters_are_named_and_other_keys_ignored(tmp_path):
    checkpointer, config = saved_config(tmp_path, **{"optimizer.dense_lr": 0.002, "model.hstu.dropout": 0.0,
                                                     "training.max_steps": 99, "comm.mode": "plain",
                                                     "tracking.uri": "none"})
    assert sorted(checkpointer.check_config(1, config)) == ["model.hstu.dropout 0.1 -> 0.0",
                                                             "optimizer.dense_lr 0.001 -> 0.002"]


def small_args(*extra: str) -> list[str]:
    return ["--tracking-uri", "none", *SMALL_RUN, *extra]


def train_lines(run: subprocess.CompletedProcess, marker: str) -> list[str]:
    """The lines holding `marker`, leaving out the launcher's closing summary of failed ranks."""
    return [line for line in (run.stdout + run.stderr).splitlines()
            if marker in line and not line.startswith("freescale train: error: rank")]


@pytest.mark.slow
def test_a_second_training_on_the_same_folder_is_refused(movielens_shards, tmp_path):
    folder = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "jobs.cli", "train", "--shards", str(movielens_shards), "--nproc-per-node", "2",
           "--max-steps", "100000", "--training.log_every", "1", "--checkpoint.folder", str(folder),
           *small_args()]
    first = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in first.stdout:
            if line.startswith("step "):
                break
        holder = json.loads((folder / LOCK).read_text())
        second = freescale_train(movielens_shards, "--max-steps", "2", "--checkpoint.folder", str(folder),
                                 *small_args(), timeout=180)
    finally:
        os.killpg(first.pid, signal.SIGINT)
        first.communicate(timeout=90)
    assert second.returncode != 0
    lines = train_lines(second, "error:")
    assert lines and len({line.split("error: ", 1)[1] for line in lines}) == 1, lines
    assert str(folder) in lines[0] and f"PID {holder['pid']} on {holder['host']}" in lines[0]
    assert "Traceback" not in second.stderr
    assert not (folder / LOCK).exists()  # the first job, stopped by a signal, released it


@pytest.mark.slow
def test_resume_refuses_another_shape_and_warns_about_changed_hyperparameters(movielens_shards, tmp_path):
    folder = ("--checkpoint.folder", str(tmp_path / "ckpt"))
    first = freescale_train(movielens_shards, "--max-steps", "2", *folder, *small_args())
    assert first.returncode == 0, first.stderr[-3000:]
    wider = freescale_train(movielens_shards, "--max-steps", "4", *folder, *small_args("--model.hstu.embedding_dim",
                                                                                       "32"))
    assert wider.returncode != 0
    lines = train_lines(wider, "error:")
    assert lines and all("model.hstu.embedding_dim 64 -> 32" in line for line in lines), wider.stderr[-3000:]
    assert "Traceback" not in wider.stderr
    # Another table placement: the per-rank sparse optimizer state cannot follow (it failed
    # inside TorchRec with "Parameter embedding_bags.user_feature_0.weight not found").
    moved = freescale_train(movielens_shards, "--max-steps", "4", *folder, *small_args("--parallel.sharding",
                                                                                      "table_wise"))
    assert moved.returncode == 2
    lines = train_lines(moved, "error:")
    assert lines and all("another table placement (parallel.sharding row_wise -> table_wise" in line
                         for line in lines), moved.stderr[-3000:]
    faster = freescale_train(movielens_shards, "--max-steps", "4", *folder, *small_args("--optimizer.dense_lr",
                                                                                        "0.002"))
    assert faster.returncode == 0, faster.stderr[-3000:]
    assert len(train_lines(faster, "optimizer.dense_lr 0.001 -> 0.002")) == 1, faster.stderr[-3000:]
