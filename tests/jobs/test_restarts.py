"""`freescale train --max-restarts N`: a failed rank's job starts again from the newest checkpoint
with the losses of an uninterrupted run, the same MLflow run and the restarts counted; and a stop
signal is a stop, never a failure to restart from, wherever it lands (the run's last barrier too)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from tests import helpers
from tests.scenarios import RESTART_EVERY, RESTART_KILL_AT, RESTART_STEPS


def _lines(output: str, prefix: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
def test_a_rank_killed_mid_run_restarts_from_the_newest_checkpoint_with_the_same_losses_and_run(restarted_run):
    """kill -9 of rank 1 (a process torchrun started, not the launcher) at step 15 of 25, checkpoints
    every 10: the job goes on from step 10 and exits 0; its losses are the uninterrupted run's; one
    line said the restart; the summary and the one MLflow run -- continued, FINISHED, every step's
    loss once -- count it. (tests/e2e/fault_sweep.py kills at random steps.)"""
    run, reference = restarted_run.restarted, restarted_run.stopped
    assert run.returncode == 0, run.output[-3000:]
    assert run.killed_pid != run.launcher_pid  # a rank torchrun started
    [line] = _lines(run.output, "freescale train: restart")
    checkpoint = run.folder / f"step_{RESTART_EVERY}"
    # torchrun names the rank it saw fail first: the killed one, or (on a starved machine) its peer,
    # whose collective lost it.
    assert re.fullmatch(rf"freescale train: restart 1 of 1 after (rank 1 killed by SIGKILL|rank 0: RuntimeError: .*"
                        rf"Connection closed by peer.*): resuming from {re.escape(str(checkpoint))}", line), line
    assert _lines(run.output, "freescale train: error") == []

    assert reference.log is not None and len(reference.log["losses"]) == RESTART_STEPS
    assert RESTART_EVERY < RESTART_KILL_AT < RESTART_STEPS
    assert run.log["steps"] == list(range(RESTART_EVERY, RESTART_STEPS))
    assert run.log["losses"][-10:] == reference.log["losses"][-10:]
    assert run.log["losses"] == reference.log["losses"][RESTART_EVERY:]  # to the last bit
    assert run.log["summary"]["restarts"] == 1
    assert reference.log["summary"]["restarts"] == 0

    [recorded] = helpers.runs_of(run.uri)  # continued, not a second run
    assert recorded.info.status == "FINISHED"
    assert recorded.info.run_id == run.log["mlflow_run_id"]
    assert recorded.data.metrics["restarts"] == 1
    assert helpers.logged_losses(run.uri, recorded.info.run_id) == list(enumerate(reference.log["losses"]))
    assert not (run.folder / "LOCK").exists()
    print(f"restarted run {run.seconds:.0f} s, the reference (stopped after its summary) {reference.seconds:.0f} s, "
          "launched together")


@pytest.mark.slow
def test_a_sigterm_just_after_the_summary_line_is_a_stop_not_a_failure(restarted_run):
    """SIGTERM to the job's process group as soon as the summary line is out: a rank whose peer the
    stop ended first loses it in the run's last barrier, which is the stop, not a failure: exit
    128 + 15, one line saying so, the MLflow run KILLED, and nothing restarted (it was launched with
    --max-restarts 1)."""
    run = restarted_run.stopped
    assert run.returncode == 128 + signal.SIGTERM, run.output[-3000:]
    errors = _lines(run.output, "freescale train: error")
    assert [helpers.without_details(line) for line in errors] == ["freescale train: error: stopped by SIGTERM"]
    assert run.output.rstrip().splitlines()[-1] == errors[0]
    assert "RuntimeError" not in run.output and "failed" not in run.output
    assert _lines(run.output, "freescale train: restart") == []
    [recorded] = helpers.runs_of(run.uri)
    assert recorded.info.status == "KILLED"


def test_max_restarts_is_passed_to_torchrun_only_when_asked():
    from freescale.launch.launcher import torchrun_command

    assert "--max-restarts=2" in torchrun_command(["--standalone"], 2, None, None, [], max_restarts=2)
    assert not any(arg.startswith("--max-restarts") for arg in torchrun_command(["--standalone"], 2, None, None, []))


def test_a_failed_attempt_is_noted_for_the_next_and_its_errors_are_not_the_jobs(tmp_path):
    """torchrun's report of an attempt's failure (its first failed rank): what the restarted rank 0
    names. The failed attempt's error lines do not reach the job's last line once torchrun restarts."""
    from freescale.launch.launcher import RankOutput
    from freescale.launch.restarts import FAILURE_NOTE

    output = RankOutput(tmp_path / "train.log", str(tmp_path), nnodes=1, max_restarts=1)
    output._log = open(output.log_path, "w")
    report = ("E1207 00:25:14.146000 6309 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
              "(exitcode: {code}) local_rank: {rank} (pid: 6322) of binary: python\n")

    class Terminal:
        def write(self, text):
            pass

        def flush(self):
            pass

    output._pump(["freescale train (rank 0): error: RuntimeError: boom\n", report.format(code=1, rank=0)], Terminal())
    assert (tmp_path / FAILURE_NOTE).read_text() == "rank 0: RuntimeError: boom"
    assert output.reported == {}  # restarted: not the job's last line
    output._pump([report.format(code=-9, rank=1)], Terminal())
    assert (tmp_path / FAILURE_NOTE).read_text() == "rank 1 killed by SIGKILL"
    output._pump(["freescale train (rank 1): error: ValueError: again\n", report.format(code=1, rank=1)], Terminal())
    assert output.reported == {1: "ValueError: again"}  # no restart left: the job's last line names it
    output._log.close()


def test_rank_0_says_which_restart_after_what_and_from_where(tmp_path, monkeypatch):
    from freescale.runtime.job_errors import STATUS_DIR_ENV
    from freescale.launch import restarts

    monkeypatch.setenv(STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(restarts.RESTART_COUNT_ENV, raising=False)
    assert restarts.restart_line("step 0") is None  # the first attempt
    monkeypatch.setenv(restarts.RESTART_COUNT_ENV, "2")
    monkeypatch.setenv(restarts.MAX_RESTARTS_ENV, "3")
    assert restarts.restart_line("step 0") == "freescale train: restart 2 of 3 after a failure: resuming from step 0"
    restarts.write_note(restarts.FAILURE_NOTE, "rank 1 killed by SIGKILL", tmp_path)
    assert restarts.restart_line("/ckpt/step_10") == (
        "freescale train: restart 2 of 3 after rank 1 killed by SIGKILL: resuming from /ckpt/step_10")


FAKE_TORCHRUN = """
import signal, sys, time
from pathlib import Path
got = []
def stop(signum, frame):
    got.append(signum)
    if len(got) == 1:  # torchrun's own word, as its agent logs it
        print("W1207 00:29:32.050000 9609 api.py:753] Received 15 death signal, shutting down workers",
              file=sys.stderr, flush=True)
signal.signal(signal.SIGTERM, stop)
Path(sys.argv[1], "ready").touch()
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(float(sys.argv[2]) + 1)  # time for a second signal to come
Path(sys.argv[1], "signals").write_text(str(len(got)))
"""


@pytest.mark.spawns
@pytest.mark.parametrize("to_group", [True, False])
def test_torchrun_gets_one_sigterm_whether_sent_to_the_group_or_to_the_launcher(tmp_path, monkeypatch, capsys,
                                                                                 to_group):
    """A second SIGTERM cuts torchrun's stopping of its ranks short. Sent to the process group, the
    signal reaches torchrun itself, and the launcher does not pass it on; sent to the launcher alone,
    it does."""
    import time

    from freescale.runtime import logs
    from freescale.launch import launcher

    monkeypatch.setenv(logs.LOG_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(launcher, "FORWARD_WAIT_S", 1.0)
    torchrun = [sys.executable, "-c", FAKE_TORCHRUN, str(tmp_path), "1.0"]

    def signal_when_ready():
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)
        if to_group:  # what killpg does: every process of the group, the launcher first or not
            os.kill(torchrun_pid[0], signal.SIGTERM)

    torchrun_pid = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        torchrun_pid.append(proc.pid)
        return proc

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    sender = threading.Thread(target=signal_when_ready, daemon=True)
    sender.start()
    assert launcher.run_ranks(torchrun, 2, 1, None, None) == 128 + signal.SIGTERM
    sender.join()
    assert (tmp_path / "signals").read_text() == "1"
    assert capsys.readouterr().err.splitlines()[-1].startswith("freescale train: error: stopped by SIGTERM")


@pytest.mark.spawns
def test_a_sigterm_the_launcher_takes_in_a_pipeline_stops_the_pipeline(tmp_path, monkeypatch, capsys):
    """`freescale pipeline` runs the launcher in its own process, whose SIGTERM handler (freescale/runtime/stops.py)
    ends the pipeline as stopped. The launcher takes SIGTERM while torchrun runs (to pass it on);
    after torchrun, the stop goes on to the pipeline's handler, whatever the ranks said."""
    from freescale.runtime import logs
    from freescale.runtime.stops import Stopped, stop_signal, stops_on_signals
    from freescale.launch import launcher

    monkeypatch.setenv(logs.LOG_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(launcher, "FORWARD_WAIT_S", 0.5)
    torchrun = [sys.executable, "-c", "import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))\ntime.sleep(60)"]
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    with stops_on_signals():
        timer.start()
        with pytest.raises(Stopped) as stopped:
            launcher.run_ranks(torchrun, 2, 1, None, None)
        assert stop_signal() == signal.SIGTERM
    timer.join()
    assert stopped.value.signum == signal.SIGTERM
    lines = capsys.readouterr().err.splitlines()
    assert [helpers.without_details(line) for line in lines] == ["freescale train: error: stopped by SIGTERM"]


@pytest.mark.spawns
def test_a_sigterm_to_the_launcher_is_passed_on_and_ends_the_job_stopped(capsys):
    from freescale.launch import launcher

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        assert launcher._wait(proc) == (-signal.SIGTERM, signal.SIGTERM)
        timer.join()
    finally:
        proc.kill()
        proc.wait()
    assert launcher.conclude_stop(signal.SIGTERM, None) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "freescale train: error: stopped by SIGTERM\n"
