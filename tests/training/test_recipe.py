"""The training recipe: learning-rate schedule, gradient clipping, epochs, validation during
training, early stopping with the best weights restored, and its exact resume."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import helpers
from freescale.training.config import ConfigError, OptimizerConfig, load_config
from freescale.training.loop.schedule import LearningRateSchedule
from freescale.training.loop.trainer import planned_steps
from freescale.training.eval.validation import ValidationRecord

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ units


def schedule(**settings) -> LearningRateSchedule:
    dense = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return LearningRateSchedule(OptimizerConfig(dense_lr=0.1, **settings), 10, dense, [])


def test_warmup_then_decay_reach_their_ends() -> None:
    assert [schedule(warmup_steps=4).factor(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = schedule(warmup_steps=2, decay="linear", min_lr_ratio=0.1)
    assert linear.factor(2) == 1.0 and linear.factor(10) == pytest.approx(0.1) and linear.factor(50) == pytest.approx(0.1)
    assert linear.factor(6) == pytest.approx(0.1 + 0.9 * 0.5)
    cosine = schedule(decay="cosine")
    assert cosine.factor(0) == 1.0 and cosine.factor(5) == pytest.approx(0.5) and cosine.factor(10) == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(map(cosine.factor, range(10)), map(cosine.factor, range(1, 11))))


def test_schedule_sets_the_rate_of_the_step_and_leaves_constant_runs_alone() -> None:
    constant = schedule()
    constant.apply(3)
    assert constant.constant and constant.rates[0][0].param_groups[0]["lr"] == 0.1
    decaying = schedule(decay="linear")
    decaying.apply(5)
    assert decaying.rates[0][0].param_groups[0]["lr"] == pytest.approx(0.05)


def test_planned_steps_epochs_and_max_steps() -> None:
    def planned(*overrides: str) -> tuple[int, int]:
        return planned_steps(load_config(None, list(overrides)), 10)

    assert planned() == (10, 10)
    assert planned("--training.max_steps", "7") == (7, 7)
    assert planned("--training.max_epochs", "3") == (30, 30)
    assert planned("--training.max_epochs", "3", "--training.max_steps", "12") == (30, 12)  # same schedule, cut
    assert planned("--training.max_epochs", "3", "--training.max_steps", "99") == (30, 30)


def test_record_keeps_the_best_and_stops_after_patience() -> None:
    record = ValidationRecord()
    decisions = [record.update(value, epoch, epoch * 10, patience=2)
                 for epoch, value in enumerate([0.1, 0.3, 0.3, 0.2], start=1)]
    assert decisions == [True, True, False, False]  # a tie is no improvement
    assert (record.best_epoch, record.best_step, record.best_value, record.stopped) == (2, 20, 0.3, True)
    never = ValidationRecord()
    assert not never.update(math.nan, 1, 10, patience=0) and not never.stopped
    at_the_end = ValidationRecord()  # patience runs out at the run's last step: nothing was stopped
    for epoch, value in enumerate([0.3, 0.2, 0.1], start=1):
        at_the_end.update(value, epoch, epoch * 10, patience=2, last=epoch == 3)
    assert (at_the_end.since_best, at_the_end.best_epoch, at_the_end.stopped) == (2, 1, False)


@pytest.mark.parametrize("overrides, named", [
    (["--evaluation.patience", "2"], "every_epochs"),
    (["--evaluation.every_epochs", "1", "--evaluation.metric", "valid_sampled_mrr"], "sampled_negatives"),
    (["--evaluation.metric", "ndcg"], "evaluation.metric"),
    (["--optimizer.decay", "step"], "optimizer.decay"),
    (["--optimizer.min_lr_ratio", "2"], "min_lr_ratio"),
    (["--optimizer.max_grad_norm", "-1"], "max_grad_norm"),
    (["--training.max_epochs", "-1"], "max_epochs"),
])
def test_recipe_settings_are_checked(overrides, named) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config(None, overrides)


# ------------------------------------------------------------------ runs (one rank)

# Validation on 32 users' items (HR@10 moves in steps of 1/32, so it stalls within a few
# epochs), patience 1, a schedule and clipping on: the recipe end to end, small.
RECIPE = ("--training.max_epochs", "6", "--evaluation.every_epochs", "1", "--evaluation.patience", "1",
          "--evaluation.metric", "valid_hr_at_10", "--training.eval_max_samples", "32",
          "--optimizer.warmup_steps", "8", "--optimizer.decay", "cosine", "--optimizer.max_grad_norm", "1.0",
          "--model.hstu.embedding_dim", "32", "--training.log_every", "1")
TEST_METRICS = ("hr_at_10", "ndcg_at_10", "mrr")


def run_in_process(shards: Path, out: Path, *extra: str) -> dict:
    assert helpers.train_in_process(*helpers.in_process_args(shards, *RECIPE, *extra), "--summary-json",
                                    str(out)) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def early_stopped(movielens_shards_1, tmp_path_factory):
    """The recipe's run, uninterrupted; and a run without validation stopped at its best step."""
    out = tmp_path_factory.mktemp("recipe")
    uri = helpers.sqlite_store(out / "mlflow.db")
    stopped = run_in_process(movielens_shards_1, out / "stopped.json", "--tracking.uri", uri)
    best_step = int(stopped["summary"]["best_step"])
    cut = run_in_process(movielens_shards_1, out / "cut.json", "--training.max_steps", str(best_step),
                         "--evaluation.patience", "0", "--evaluation.every_epochs", "0")
    return SimpleNamespace(stopped=stopped, cut=cut, best_step=best_step, out=out, uri=uri)


@pytest.mark.extended
def test_early_stopping_restores_the_best_step_to_the_last_bit(early_stopped, movielens_shards_1) -> None:
    stopped, cut = early_stopped.stopped["summary"], early_stopped.cut["summary"]
    steps_per_epoch = helpers.load_manifest(movielens_shards_1)["num_steps"]
    trained = len(early_stopped.stopped["losses"])
    assert stopped["stopped_early"] == 1.0 and trained < 6 * steps_per_epoch, "validation never stalled"
    assert stopped["best_step"] == stopped["best_epoch"] * steps_per_epoch < trained
    # The weights tested are the best step's: exactly those of a run that ended there.
    assert early_stopped.cut["losses"] == early_stopped.stopped["losses"][:early_stopped.best_step]
    assert {m: stopped[m] for m in TEST_METRICS} == {m: cut[m] for m in TEST_METRICS}
    assert stopped["valid_hr_at_10"] == stopped["best_valid_hr_at_10"]
    assert "best_epoch" not in cut  # no validation during training, no best epoch


@pytest.mark.extended
def test_validations_are_mlflow_series_at_their_steps(early_stopped, movielens_shards_1) -> None:
    from mlflow.tracking import MlflowClient

    client, summary = MlflowClient(early_stopped.uri), early_stopped.stopped["summary"]
    run_id = early_stopped.stopped["mlflow_run_id"]
    series = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "epoch/valid_hr_at_10"))
    epochs = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "epoch/epoch"))
    steps_per_epoch = helpers.load_manifest(movielens_shards_1)["num_steps"]
    trained = len(early_stopped.stopped["losses"])
    assert [step for step, _ in series] == list(range(steps_per_epoch - 1, trained, steps_per_epoch))
    assert [value for _, value in epochs] == list(range(1, len(series) + 1))
    assert max(value for _, value in series) == summary["best_valid_hr_at_10"]
    # the same steps' losses are there too: a step takes its validation beside its metrics
    assert len(client.get_metric_history(run_id, "step/loss")) == trained


@pytest.mark.slow
@pytest.mark.extended
def test_kill_9_mid_epoch_resumes_to_the_same_stop(early_stopped, movielens_shards_1, tmp_path) -> None:
    """One rank as its own process (no torchrun), checkpointed every 5 steps, killed mid-epoch
    after the best validation (12 steps past it; the stop comes a whole epoch later); the rerun
    resumes, restores the best weights from the checkpoint, and ends as the uninterrupted run did."""
    folder, out = tmp_path / "ckpt", tmp_path / "resumed.json"
    cmd = [sys.executable, "-m", "freescale.jobs.train", *helpers.in_process_args(movielens_shards_1, *RECIPE),
           "--checkpoint.folder", str(folder), "--checkpoint.every_steps", "5"]
    env = {k: v for k, v in helpers.train_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        kill_at = early_stopped.best_step + 12
        helpers.read_until_step(proc, kill_at)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    resumed = subprocess.run([*cmd, "--summary-json", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log, reference = json.loads(out.read_text()), early_stopped.stopped
    first = log["steps"][0]
    # From a checkpoint taken after the best validation: the best weights came from it.
    assert early_stopped.best_step < first <= kill_at and first % 5 == 0
    assert log["losses"] == reference["losses"][first:]
    for name in ("best_epoch", "best_step", "best_valid_hr_at_10", "stopped_early", *TEST_METRICS):
        assert log["summary"][name] == reference["summary"][name], name
