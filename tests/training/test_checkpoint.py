"""Checkpoint folders: one job at a time (a lock naming its holder; a stale one is taken over), and a
resume refused into another model shape or table placement, warned about with changed hyperparameters."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from freescale.training.checkpoint.checkpointer import CONFIG, LOCK, Checkpointer
from freescale.training.config import ConfigError, TrainConfig, shape_keys, to_flat_dict
from tests.helpers import in_process_args, train_in_process


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


@pytest.mark.spawns
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


def test_shape_keys_are_the_marked_fields_of_every_encoder_and_the_model():
    keys = shape_keys()
    assert set(keys) <= set(to_flat_dict(TrainConfig()))
    # The keys the hand-kept list had (width and rating input now the model's own).
    assert set(keys) == {"model.encoder", "model.embedding_dim", "model.use_rating_feature",
                         "model.hstu.num_layers", "model.hstu.num_heads", "model.hstu.attention_dim",
                         "model.hstu.linear_dim", "model.hstu.num_position_buckets", "model.hstu.num_time_buckets",
                         "model.hstu.position_embeddings", "model.hstu.output_norm", "model.hstu.norm_affine",
                         "model.hstu.feed_forward_dim",
                         "model.sasrec.num_layers", "model.sasrec.feed_forward_dim", "model.sasrec.max_seq_len",
                         "optimizer.sparse_optimizer"}


def test_another_model_shape_is_refused_naming_the_keys(tmp_path):
    checkpointer, config = saved_config(tmp_path, **{"model.embedding_dim": 32, "model.hstu.num_heads": 4,
                                                     "optimizer.dense_lr": 0.5})
    with pytest.raises(ConfigError) as refused:
        checkpointer.check_config(1, config)
    message = str(refused.value)
    assert "\n" not in message
    assert "model.embedding_dim 64 -> 32" in message and "model.hstu.num_heads 2 -> 4" in message
    assert "dense_lr" not in message


def test_a_checkpoint_recording_the_width_under_its_old_key_is_compared_under_the_new_one(tmp_path):
    """Checkpoints written before the width moved to [model] record model.hstu.embedding_dim."""
    checkpointer, config = saved_config(tmp_path)
    recorded = checkpointer.step_dir(1) / CONFIG
    old = json.loads(recorded.read_text())
    old["model.hstu.embedding_dim"] = old.pop("model.embedding_dim")
    old["model.hstu.use_rating_feature"] = old.pop("model.use_rating_feature")
    recorded.write_text(json.dumps(old))
    assert checkpointer.check_config(1, config) == []  # the same model: no change named
    with pytest.raises(ConfigError, match=r"another model shape \(model.embedding_dim 64 -> 32\)"):
        checkpointer.check_config(1, {**config, "model.embedding_dim": 32})


def test_changed_hyperparameters_are_named_and_other_keys_ignored(tmp_path):
    checkpointer, config = saved_config(tmp_path, **{"optimizer.dense_lr": 0.002, "model.hstu.dropout": 0.0,
                                                     "training.max_steps": 99, "comm.mode": "plain",
                                                     "tracking.uri": "none"})
    assert sorted(checkpointer.check_config(1, config)) == ["model.hstu.dropout 0.1 -> 0.0",
                                                             "optimizer.dense_lr 0.001 -> 0.002"]


def test_a_half_written_checkpoint_is_named_when_skipped(tmp_path, capsys):
    from freescale.training.checkpoint.resume import resume_latest

    checkpointer = Checkpointer(str(tmp_path), rank=0)
    for step in (2, 4):
        checkpointer.step_dir(step).mkdir()
    (checkpointer.step_dir(2) / "COMPLETE").write_text("2\n")
    assert checkpointer.latest_step() == 2 and checkpointer.half_written() == [checkpointer.step_dir(4)]
    (checkpointer.step_dir(2) / "COMPLETE").unlink()  # nothing complete: the run starts over, saying why
    assert resume_latest(checkpointer, TrainConfig(), "sha", 0, None, ({}, {}), 10) is None
    [line] = capsys.readouterr().err.splitlines()
    assert str(checkpointer.step_dir(2)) in line and str(checkpointer.step_dir(4)) in line
    assert "no COMPLETE" in line and line.endswith("starting from step 0")


def test_a_resume_that_would_add_or_drop_the_best_weights_is_refused(tmp_path):
    """Validation during training checkpoints the best weights beside the model: a checkpoint
    without them cannot feed a run that keeps them, nor the reverse; the period may change."""
    checkpointer, config = saved_config(tmp_path, **{"evaluation.every_epochs": 1})
    with pytest.raises(ConfigError, match=r"saved without the best weights .*every_epochs 0 -> 1"):
        checkpointer.check_config(1, config)
    assert checkpointer.check_config(1, {**config, "evaluation.restore_best": False}) == []
    (checkpointer.step_dir(1) / CONFIG).write_text(json.dumps(config))
    assert checkpointer.check_config(1, {**config, "evaluation.every_epochs": 3}) == []
    with pytest.raises(ConfigError, match="saved with the best weights"):
        checkpointer.check_config(1, {**config, "evaluation.every_epochs": 0})


@pytest.mark.slow
def test_a_second_training_on_the_same_folder_is_refused(stopped_run):
    """While the session's Ctrl-C run trained, a second training on its folder (one rank, in this
    process) was refused in one line naming the folder and the holder; the first job, stopped by
    the signal, released the folder."""
    assert stopped_run.alive
    assert stopped_run.second_rc == 2
    lines = [line for line in stopped_run.second_err.splitlines() if "error:" in line]
    assert len(lines) == 1, stopped_run.second_err
    assert str(stopped_run.folder) in lines[0]
    assert f"PID {stopped_run.holder['pid']} on {stopped_run.holder['host']}" in lines[0]
    assert "Traceback" not in stopped_run.second_err
    assert not (stopped_run.folder / LOCK).exists()


def test_resume_refuses_another_shape_and_warns_about_changed_hyperparameters(movielens_shards_1, tmp_path,
                                                                              capsys):
    """One rank, in process: a checkpoint of 2 steps, then resumes with other settings."""
    def train(*extra: str) -> tuple[int, list[str]]:
        rc = train_in_process(*in_process_args(movielens_shards_1, "--checkpoint.folder", str(tmp_path / "ckpt"),
                                               *extra))
        return rc, capsys.readouterr().err.splitlines()

    rc, err = train("--training.max_steps", "2")
    assert rc == 0, err[-20:]
    rc, err = train("--training.max_steps", "4", "--model.hstu.embedding_dim", "32")  # the old spelling
    errors = [line for line in err if "error:" in line]
    assert rc == 2 and len(errors) == 1 and "model.embedding_dim 64 -> 32" in errors[0], err[-20:]
    assert not any("Traceback" in line for line in err)
    # Another table placement: the per-rank sparse optimizer state cannot follow (it failed
    # inside TorchRec with "Parameter embedding_bags.user_feature_0.weight not found").
    rc, err = train("--training.max_steps", "4", "--parallel.sharding", "table_wise")
    errors = [line for line in err if "error:" in line]
    assert rc == 2 and len(errors) == 1, err[-20:]
    assert "another table placement (parallel.sharding row_wise -> table_wise" in errors[0], errors
    rc, err = train("--training.max_steps", "4", "--optimizer.dense_lr", "0.002")
    assert rc == 0, err[-20:]
    assert len([line for line in err if "optimizer.dense_lr 0.001 -> 0.002" in line]) == 1, err[-20:]


def test_a_resume_at_another_precision_is_named_and_an_older_checkpoint_is_not(tmp_path):
    """The weights are fp32 either way, so the resume goes on, but its steps will not match an
    uninterrupted run's: the change is named like any hyperparameter's. A checkpoint from before
    training.precision existed records no such key and gets no warning."""
    saved = to_flat_dict(TrainConfig())
    checkpointer = Checkpointer(str(tmp_path), rank=0)
    for step, recorded in ((2, saved), (4, {k: v for k, v in saved.items() if k != "training.precision"})):
        checkpointer.step_dir(step).mkdir(parents=True)
        (checkpointer.step_dir(step) / CONFIG).write_text(json.dumps(recorded))
    bf16 = {**saved, "training.precision": "bf16"}
    assert checkpointer.check_config(2, bf16) == ["training.precision fp32 -> bf16"]
    assert checkpointer.check_config(4, bf16) == []



# -- retention: [checkpoint] keep_last ------------------------------------------


def fake_checkpoints(folder: Path, complete: list[int], half_written: list[int]) -> Checkpointer:
    checkpointer = Checkpointer(str(folder), rank=0, keep_last=2)
    for step in complete + half_written:
        checkpointer.step_dir(step).mkdir(parents=True)
        (checkpointer.step_dir(step) / "rank_0.pt").write_bytes(b"x")
    for step in complete:
        (checkpointer.step_dir(step) / "COMPLETE").write_text(f"{step}\n")
    return checkpointer


def test_prune_keeps_the_newest_complete_and_what_is_newer_than_the_save(tmp_path):
    checkpointer = fake_checkpoints(tmp_path / "ckpt", complete=[1, 2, 3, 6, 9], half_written=[4, 5, 10])
    # The save of step 6 completed: up to it, the newest 2 complete stay (3, 6); 1 and 2 go, and the
    # half-written 4 and 5 (older than a complete save: no resume can use them). 9 (newer: another
    # run's) and the half-written 10 (the resume names it) are left.
    assert checkpointer.prune(6) == [1, 2, 4, 5]
    left = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert left == ["step_10", "step_3", "step_6", "step_9"]
    assert checkpointer.latest_step() == 9  # what a resume loads is untouched
    assert checkpointer.prune(6) == []  # nothing more to do
    keep_all = fake_checkpoints(tmp_path / "all", complete=[1, 2, 3], half_written=[])
    keep_all.keep_last = 0
    assert keep_all.prune(3) == [] and len(list((tmp_path / "all").iterdir())) == 3


def test_a_prune_cut_short_leaves_no_checkpoint_behind(tmp_path):
    """A folder being deleted is renamed first: a kill mid-delete leaves no step_<n> folder that looks
    complete, and the next prune removes the rest."""
    from freescale.training.checkpoint.checkpointer import PRUNED_PREFIX

    checkpointer = fake_checkpoints(tmp_path, complete=[1, 2, 3], half_written=[])
    leftover = tmp_path / f"{PRUNED_PREFIX}0"
    leftover.mkdir()
    (leftover / "COMPLETE").write_text("0\n")
    assert checkpointer.latest_step() == 3 and checkpointer.half_written() == []
    assert checkpointer.prune(3) == [1] and not leftover.exists()


SAVER = """
import sys, time
import torch, torch.distributed as dist
from freescale.training.checkpoint.checkpointer import Checkpointer

folder, store, steps, block_at = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")], int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

class Progress:
    def __init__(self, step):
        self.step = step
    def state_dict(self):
        if self.step == block_at:
            print(f"saving {self.step}", flush=True)
            time.sleep(600)  # killed here: the DCP files are written, this rank's file and COMPLETE are not
        return {"step": self.step}
    def load_state_dict(self, state):
        self.step = state["step"]

model = torch.nn.Linear(3, 2)
checkpointer = Checkpointer(folder, 0, keep_last=2)
for step in steps:
    checkpointer.save(step, {"model": model}, {"trainer": Progress(step)}, "sha", {})
    print(f"saved {step}", flush=True)
dist.destroy_process_group()
"""


def run_saver(tmp_path: Path, folder: Path, steps: str, block_at: int = -1) -> subprocess.Popen:
    from tests.helpers import REPO

    store = tmp_path / f"store-{steps.replace(',', '-')}"
    return subprocess.Popen([sys.executable, "-c", SAVER, str(folder), str(store), steps, str(block_at)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.spawns
def test_a_kill_during_a_save_keeps_every_older_complete_checkpoint(tmp_path, capsys):
    from freescale.training.checkpoint.resume import resume_latest

    folder = tmp_path / "ckpt"
    proc = run_saver(tmp_path, folder, "1,2,3,4", block_at=4)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("saving 4"):
                break
        assert lines[-1] == "saving 4", lines
        proc.kill()  # SIGKILL mid-save
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    checkpointer = Checkpointer(str(folder), rank=0, keep_last=2)
    # keep_last 2 pruned step 1 after step 3 completed; the cut-short step 4 pruned nothing
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step_")) == ["step_2", "step_3", "step_4"]
    assert checkpointer.latest_step() == 3 and checkpointer.half_written() == [checkpointer.step_dir(4)]
    assert any(folder.joinpath("step_4").glob("*.distcp"))  # the kill came mid-save, after DCP's files
    # the resume picks the newest complete checkpoint, naming the half-written one
    progress = type("P", (), {"step": 0, "load_state_dict": lambda self, s: setattr(self, "step", s["step"]),
                              "state_dict": lambda self: {"step": self.step}})()
    import torch

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    assert resume_latest(checkpointer, TrainConfig(), "sha", 0, optimizer, ({"model": model}, {"trainer": progress}),
                         10) == 3
    assert progress.step == 3
    [line] = capsys.readouterr().err.splitlines()
    assert str(checkpointer.step_dir(4)) in line and line.endswith(f"resuming from {checkpointer.step_dir(3)}")
    # the next complete save would prune step 2 and the half-written step 4, never step 3 before it is older
    assert checkpointer.prune(5) == [] and checkpointer.latest_step() == 3  # nothing newer is complete yet
    (checkpointer.step_dir(5)).mkdir()
    (checkpointer.step_dir(5) / "COMPLETE").write_text("5\n")
    assert checkpointer.prune(5) == [2, 4] and checkpointer.latest_step() == 5
    assert sorted(p.name for p in folder.iterdir()) == ["step_3", "step_5"]
