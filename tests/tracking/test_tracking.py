"""Tracking never stops a job: an unreachable server is one warning line; training records its
steps as it goes and its run ends FINISHED, FAILED or KILLED; a resumed training continues its run."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from freescale.tracking.store import DISABLED, reachable_tracking_uri
from tests.helpers import (SMALL_RUN, in_process_args, logged_losses, read_until_step, runs_of, sqlite_store,
                           start_train, train_in_process, wait_for_logged_steps)

DEAD_URI = "http://127.0.0.1:9/"  # the discard port: nothing listens, the connection is refused


def unreachable_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "is unreachable" in line]


def test_an_unreachable_server_is_one_warning_line_within_seconds(capsys, monkeypatch):
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert reachable_tracking_uri("balance", DEAD_URI) == DISABLED
    err = capsys.readouterr().err
    assert err == (f"freescale balance: warning: MLflow at {DEAD_URI} is unreachable (Connection refused); "
                   "running untracked\n")
    # the rest of the job: mlflow's own client gives up in seconds, not minutes
    assert int(os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]) <= 2
    assert int(os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"]) <= 10


@pytest.mark.spawns  # mlflow's run context asks git for the source version
def test_a_rerun_to_the_same_output_ends_the_run_a_killed_job_left_running(tmp_path, capsys, monkeypatch):
    """kill -9 leaves a job's run RUNNING; the next run of the same job to the same output (however
    it is spelled) ends it FAILED with one note line. Other outputs, other jobs and ended runs are
    left alone."""
    from mlflow.tracking import MlflowClient

    from freescale.tracking.runs import job_run, output_key

    uri = sqlite_store(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    experiment = client.create_experiment("orphans")
    shards = output_key(str(tmp_path / "shards"))

    def run(job: str, output: str) -> str:
        return client.create_run(experiment, tags={"freescale.job": job, "freescale.output": output}).info.run_id

    orphan, other_output, other_job = run("balance", shards), run("balance", shards + "-2"), run("prepare", shards)
    finished = run("balance", shards)
    client.set_terminated(finished, "FINISHED")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()  # mlflow's notes on creating the store
    with job_run("balance", tracking_uri=uri, experiment="orphans", output="./shards/") as this:
        pass
    status = {r.info.run_id: r.info.status for r in client.search_runs([experiment])}
    assert status == {orphan: "FAILED", other_output: "RUNNING", other_job: "RUNNING", finished: "FINISHED",
                      this.run_id: "FINISHED"}
    assert capsys.readouterr().err == (f"freescale balance: note: 1 MLflow run(s) of a killed balance of {shards} "
                                       f"were still RUNNING: ended FAILED ({orphan})\n")


def test_a_tracking_setting_has_one_meaning_of_unset(monkeypatch, tmp_path):
    """A config file's "" and the command line's None are the same setting: MLFLOW_TRACKING_URI, then the
    default store; 'none' disables, a URI is itself."""
    from freescale.tracking.store import DEFAULT_TRACKING_URI, Tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert Tracking("") == Tracking(None) and Tracking("").uri is None
    assert Tracking("").resolved_uri() == Tracking(None).resolved_uri() == DEFAULT_TRACKING_URI
    store = f"sqlite:///{tmp_path}/env.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert Tracking("").resolved_uri() == Tracking(None).resolved_uri() == store
    assert Tracking(DISABLED).resolved_uri() == Tracking(DISABLED).reachable_uri("train") == DISABLED
    assert Tracking(f"sqlite:///{tmp_path}/x.db").reachable_uri("train") == f"sqlite:///{tmp_path}/x.db"


def test_the_library_resolves_tracking_uris_only_through_tracking():
    """Every job and stage reads its tracking URI through freescale.tracking.store.Tracking."""
    package = Path(__file__).resolve().parents[2] / "freescale"
    callers = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if path.name != "store.py" and any(name + "(" in path.read_text() for name in
                                                        ("reachable_tracking_uri", "resolve_tracking_uri")))
    assert callers == []


def test_local_stores_and_disabled_tracking_are_not_checked(capsys, tmp_path):
    assert reachable_tracking_uri("train", f"sqlite:///{tmp_path}/x.db") == f"sqlite:///{tmp_path}/x.db"
    assert reachable_tracking_uri("train", "none") == DISABLED
    assert capsys.readouterr().err == ""


def test_an_unwritable_local_store_is_one_warning_line_within_seconds(capsys, tmp_path):
    """mlflow would retry opening such a sqlite file for ~100 s, logging each attempt: the check
    finds it first. A file where a folder should be, a file that is not sqlite, a file store
    under a file: each is one line naming the problem, and the probe leaves nothing behind."""
    import time

    (tmp_path / "plain").write_text("not a folder\n")
    (tmp_path / "garbage.db").write_text("not a database\n" * 100)
    cases = {f"sqlite:///{tmp_path}/plain/mlflow.db": f"cannot create files in {tmp_path}/plain",
             f"sqlite:///{tmp_path}/garbage.db": f"{tmp_path}/garbage.db: file is not a database",
             f"sqlite:///{tmp_path}": f"{tmp_path} is a folder, not a sqlite file",
             f"file://{tmp_path}/plain/mlruns": f"cannot create files in {tmp_path}/plain"}
    for uri, reason in cases.items():
        before = sorted(tmp_path.rglob("*"))
        started = time.perf_counter()
        assert reachable_tracking_uri("simulate", uri) == DISABLED
        assert time.perf_counter() - started < 5
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"freescale simulate: warning: MLflow at {uri} cannot be written ({reason}")
        assert line.endswith("); running untracked")
        assert sorted(tmp_path.rglob("*")) == before
    # A store in a missing folder is fine: mlflow creates the folders (the check creates nothing).
    assert reachable_tracking_uri("simulate", f"sqlite:///{tmp_path}/new/sub/x.db") != DISABLED
    assert not (tmp_path / "new").exists()


@pytest.mark.spawns
def test_a_job_on_a_read_only_store_runs_untracked_with_one_line(tmp_path):
    """The issue's command: `freescale simulate` on sqlite:////sys/mlflow.db (a system folder no
    process can create files in) gives up on tracking at once, with one line."""
    import subprocess
    import sys
    import tempfile
    import time

    try:
        with tempfile.TemporaryFile(dir="/sys"):
            pytest.skip("this machine lets the tests create files in /sys")
    except OSError:
        pass
    uri = "sqlite:////sys/mlflow.db"
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "freescale.jobs.cli", "simulate", "--lengths", "lognormal:4.2,0.9",
                          "--world-sizes", "4", "--steps", "2", "--tracking-uri", uri], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert time.perf_counter() - started < 10
    assert run.stderr.splitlines() == [f"freescale simulate: warning: MLflow at {uri} cannot be written "
                                       "(cannot create files in /sys: Permission denied); running untracked"]


def test_train_with_an_unreachable_server_trains_untracked(movielens_shards_1, tmp_path, capfd):
    """One rank, in process (rank 0 is the one that records)."""
    summary = tmp_path / "dead.json"
    assert train_in_process("--summary-json", str(summary),
                            *in_process_args(movielens_shards_1, "--training.max_steps", "3",
                                             "--tracking.uri", DEAD_URI)) == 0
    captured = capfd.readouterr()
    assert len(unreachable_lines(captured.out + captured.err)) == 1, (captured.out + captured.err)[-3000:]
    assert json.loads(summary.read_text())["steps"] == [0, 1, 2]


@pytest.mark.slow
def test_balance_with_an_unreachable_server_runs_untracked(movielens_prepared, tmp_path, capfd):
    from freescale.jobs import balance

    assert balance.main(["--input", str(movielens_prepared), "--output", str(tmp_path / "kk"), "--world-size", "2",
                         "--local-batch-size", "16", "--tracking-uri", DEAD_URI]) == 0
    captured = capfd.readouterr()
    assert len(unreachable_lines(captured.out + captured.err)) == 1, captured.err[-3000:]
    assert (tmp_path / "kk" / "manifest.json").exists()


def _sigterm_run(shards, uri: str, experiment: str):
    """A training signalled the way a scheduler does: SIGTERM to the process it started, the
    launcher alone. What was seen while it ran, and after."""
    proc = start_train(shards, "--max-steps", "100000", "--tracking-uri", uri, "--tracking.experiment", experiment,
                       "--training.log_every", "1", *SMALL_RUN)
    try:
        read_until_step(proc, 3)
        wait_for_logged_steps(uri, experiment, 3)
        alive = proc.poll() is None
        [run] = runs_of(uri, experiment)
        running = (run.info.status, logged_losses(uri, run.info.run_id))
        # The launcher waits while torchrun stops the ranks with the signal.
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    [run] = runs_of(uri, experiment)
    return alive, running, run.info.status


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["ctrl-c", pytest.param("sigterm-to-launcher", marks=pytest.mark.extended)])
def test_steps_are_recorded_as_they_go_and_a_stop_signal_ends_the_run_killed(movielens_shards, mlflow_server,
                                                                       stop, request):
    assert reachable_tracking_uri("train", mlflow_server) == mlflow_server  # a live server passes the check
    if stop == "ctrl-c":  # the session's run stopped by SIGINT to its process group, as a terminal does
        seen = request.getfixturevalue("stopped_run")
        alive, (status, logged), final = seen.alive, (seen.status_while_running, seen.logged_while_running), \
            seen.final_status
    else:
        alive, (status, logged), final = _sigterm_run(movielens_shards, mlflow_server, "e2e-sigterm")
    assert alive, "the training was meant to be still running"
    assert status == "RUNNING"
    assert [step for step, _ in logged][:3] == [0, 1, 2]
    assert final == "KILLED"
    if stop == "ctrl-c":  # the timing table gathered before the stop, as the run's artifact
        steps = seen.timing_steps
        assert steps is not None and len(steps) >= 2 * 3 and steps == [s for s in range(len(steps) // 2) for _ in "ab"]


@pytest.mark.slow
def test_an_exception_ends_the_run_failed_with_the_steps_before_it(hung_run, row_run):
    """Rank 0's collective timed out (its peer was stopped): the run ends FAILED, holding each step
    trained before, once, with the losses an uninterrupted run of the same settings has."""
    assert hung_run.returncode != 0
    assert hung_run.final_status == "FAILED"
    steps = [step for step, _ in hung_run.logged]
    assert len(steps) >= 3 and steps == list(range(len(steps)))
    reference = row_run.log["losses"]
    assert [loss for step, loss in hung_run.logged if step < len(reference)] == reference[:min(len(steps), 8)]
