"""The end-to-end tier, declared in one place: each scenario below is one real launch (or a few)
of the product -- 2 gloo ranks under torchrun, a comparison, a Spark standalone cluster, `make
dist` -- started once per test run, the first time a test asks for it, and read by the tests of
several packages. ``SCENARIOS`` lists them (name -> what it runs); a test that uses one is marked
``e2e`` (``pytest -m e2e`` runs the tier, ``-m "not e2e"`` the rest) and ``spawns`` (``--fast`` leaves
it out). conftest.py imports them, with the fixtures they build on (Spark, the MovieLens prepare and
shards, the mlflow server). The scenarios that mostly wait, or take one core, start in the
background (``helpers.Background``) as soon as what they need exists, when a selected test uses them:
those that need only a folder when the session starts (``AT_SESSION_START``), the hung run once
the MovieLens shards exist."""
from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

from tests import helpers

REPO_ROOT = Path(__file__).resolve().parents[1]
SCENARIOS: dict[str, str] = {}
"""Every end-to-end scenario: its fixture's name -> the first line of its docstring."""


def scenario(fixture):
    """Declares a session fixture as an end-to-end scenario (it launches the product)."""
    SCENARIOS[fixture.__name__] = " ".join((fixture.__doc__ or "").split("\n\n")[0].split())
    return pytest.fixture(scope="session")(helpers.spawns(fixture))


QUEUED: dict[str, Callable[[Path, Path], SimpleNamespace]] = {}
"""The trainings that need only the MovieLens shards and a folder (name -> body(shards, folder)): the
queue runs them in QUEUE_ORDER, since the tests that read them come late in the session and while the
Spark job tests run one core is mostly idle."""


QUEUE_ORDER = ("failed_launches", "restarted_run", "epochs_run", "resized_run", "table_run", "killed_run")
"""Their readers' order in the session (tests/jobs, then tests/training); tests/comm, the first, takes
table_run and killed_run itself, and waits for restarted_run."""


def queued(name: str):
    def declare(body):
        QUEUED[name] = body
        return body
    return declare


class LaunchQueue:
    """The selected QUEUED trainings, one after another in one background thread, started when the
    MovieLens shards exist (conftest.py). A test that asks for one the queue has not reached runs it
    itself, at once; one the queue is running it waits for."""

    def __init__(self, shards: Path, folder: Path, names: list[str]) -> None:
        self.shards, self.folder, self.lock = shards, folder, threading.Lock()
        self.entries = {name: SimpleNamespace(claimed=False, done=threading.Event(), value=None, error=None)
                        for name in names}
        self.closed = False
        self.thread = threading.Thread(target=lambda: [self._claim_and_run(name, queue=True) for name in names],
                                       name="launch-queue", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Start nothing more (the session ends), and wait for the run in progress."""
        with self.lock:
            self.closed = True
        self.thread.join(helpers.TIMEOUT_S)

    def _claim_and_run(self, name: str, queue: bool = False) -> None:
        entry = self.entries[name]
        with self.lock:
            if entry.claimed or (queue and self.closed):
                return
            entry.claimed = True
        try:
            entry.value = QUEUED[name](self.shards, self.folder)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test that reads the result
            entry.error = exc
        finally:
            entry.done.set()

    def result(self, name: str) -> SimpleNamespace:
        self._claim_and_run(name)  # not reached yet: run it here
        entry = self.entries[name]
        assert entry.done.wait(helpers.TIMEOUT_S), f"the queued run {name} did not finish"
        if entry.error is not None:
            raise entry.error
        return entry.value


QUEUE: list[LaunchQueue] = []


def start_queue(shards: Path, folder: Path) -> None:
    names = [name for name in QUEUE_ORDER if name in helpers.SELECTED_FIXTURES]
    if names and not QUEUE:
        QUEUE.append(LaunchQueue(shards, folder, names))


def queued_or_now(name: str, shards: Path | None, folder: Path) -> SimpleNamespace:
    """The scenario ``name``'s run: the queue's, or (no queue, or not in it) run now."""
    if QUEUE and name in QUEUE[0].entries:
        return QUEUE[0].result(name)
    return QUEUED[name](shards, folder)


@scenario
def movielens_comparison(spark, movielens_prepared, mlflow_server, tmp_path_factory):
    """One real `freescale compare` (freescale.jobs.compare.main) on MovieLens-100K: 2 ranks x 16 samples,
    one repeat of contiguous / balanced (kk) / mirror control (3 launches; how repeats alternate and
    are summarized is test_compare's in-process check), a few steps of a one-layer model
    (evaluated on 64 samples per rank),
    recorded on the session's mlflow server (its own experiment). Attributes: tracking_uri, experiment_id,
    parent_run_id, child_run_ids ({variant: [run id per repeat]}), summary (the --summary-json
    content), workdir."""
    import json
    from types import SimpleNamespace

    from freescale.jobs import compare

    root = tmp_path_factory.mktemp("comparison")
    tracking_uri = mlflow_server
    summary_json = root / "comparison.json"
    rc = compare.main(["--input", str(movielens_prepared), "--world-size", "2", "--local-batch-size", "16",
                       "--repeats", "1", "--control", "--max-steps", "8", "--workdir", str(root / "work"),
                       "--summary-json", str(summary_json), "--tracking-uri", tracking_uri,
                       "--model.hstu.num_layers", "1", "--loss.num_negatives", "32",
                       "--training.eval_max_samples", "64", "--training.log_every", "1000"])
    assert rc == 0, f"freescale compare exited {rc} (logs in {root / 'work'})"
    summary = json.loads(summary_json.read_text())
    return SimpleNamespace(
        tracking_uri=tracking_uri, experiment_id=summary["experiment_id"],
        parent_run_id=summary["parent_run_id"], workdir=root / "work", summary=summary,
        child_run_ids={variant: [run["run_id"] for run in runs] for variant, runs in summary["runs"].items()})


# ------------------------------------------------------------------ the session's 2-rank trainings
#
# Each fixture below is one launch of `freescale train` (2 gloo ranks under torchrun), started the
# first time a test asks for it. Between them they serve the resume, MLflow, comm-order,
# evaluation, signal and failure checks of test_train, test_comm, test_checkpoint,
# test_tracking, test_evaluation and test_failures.

STEPS = 8  # the reference runs' length


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@scenario
def row_run(movielens_shards, mlflow_server, e2e_dir):
    """Row-wise, prioritized, 8 steps, checkpointed at steps 4 and 8, recorded on the session's server
    (experiment e2e-row, run e2e), evaluated on every user by both protocols: the row-wise reference
    losses, and the checkpoints tests/training/test_export.py exports. Attributes: run, log (its
    --summary-json), uri, experiment, folder (the checkpoints)."""
    out, folder = e2e_dir / "row.json", e2e_dir / "row-ckpt"
    run = helpers.freescale_train(
        movielens_shards, "--max-steps", str(STEPS), "--comm-mode", "prioritized", "--parallel.sharding", "row_wise",
        "--tracking-uri", mlflow_server, "--tracking.experiment", "e2e-row", "--run-name", "e2e",
        "--checkpoint.folder", str(folder), "--checkpoint.every_steps", "4",
        "--summary-json", str(out), "--model.hstu.num_layers", "1", "--loss.num_negatives", "32",
        "--training.eval_max_samples", "0", "--evaluation.sampled_negatives", "100")
    assert run.returncode == 0, run.stderr[-3000:]
    return SimpleNamespace(run=run, log=helpers.read_summary(out), uri=mlflow_server, experiment="e2e-row",
                           folder=folder)


@scenario
def table_run(movielens_shards, e2e_dir):
    """Table-wise, overlap, 8 steps, untracked: the table-wise reference losses."""
    return queued_or_now("table_run", movielens_shards, e2e_dir)


@queued("table_run")
def run_table(movielens_shards: Path, e2e_dir: Path) -> SimpleNamespace:
    run = helpers.freescale_train(movielens_shards, "--max-steps", str(STEPS), "--comm-mode", "overlap",
                                  *helpers.small_run_args(e2e_dir, "table", "--parallel.sharding", "table_wise"))
    assert run.returncode == 0, run.stderr[-3000:]
    return SimpleNamespace(run=run, log=helpers.read_summary(e2e_dir / "table.json"))


@scenario
def stopped_run(movielens_shards, mlflow_server, e2e_dir):
    """Row-wise, plain, checkpointed every step, recorded on the session's server (experiment
    e2e-stopped), stopped with Ctrl-C (SIGINT to its process group) after step 3. While it ran: its
    MLflow run and steps so far, and a second training on its checkpoint folder (one rank, in this
    process), which must be refused."""
    folder = e2e_dir / "stopped-ckpt"
    proc = helpers.start_train(movielens_shards, "--max-steps", "100000", "--comm-mode", "plain",
                               "--parallel.sharding", "row_wise", "--tracking-uri", mlflow_server,
                               "--tracking.experiment", "e2e-stopped", "--training.log_every", "1",
                               "--checkpoint.folder", str(folder), "--checkpoint.every_steps", "1",
                               "--checkpoint.keep_last", "0", *helpers.SMALL_RUN)  # row_resume takes its step 3
    seen = SimpleNamespace(folder=folder, uri=mlflow_server, experiment="e2e-stopped")
    try:
        helpers.read_until_step(proc, 3)
        helpers.wait_for_logged_steps(mlflow_server, "e2e-stopped", 3)
        seen.alive = proc.poll() is None
        [run] = helpers.runs_of(mlflow_server, "e2e-stopped")
        seen.status_while_running = run.info.status
        seen.logged_while_running = helpers.logged_losses(mlflow_server, run.info.run_id)
        seen.holder = json.loads((folder / "LOCK").read_text())
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            seen.second_rc = helpers.train_in_process(*helpers.in_process_args(
                movielens_shards, "--training.max_steps", "2", "--checkpoint.folder", str(folder)))
        seen.second_err = err.getvalue()
        os.killpg(proc.pid, signal.SIGINT)  # a terminal signals the whole foreground group
        seen.output = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seen.returncode = proc.returncode
    [run] = helpers.runs_of(mlflow_server, "e2e-stopped")
    seen.run_id, seen.final_status = run.info.run_id, run.info.status
    seen.logged = helpers.logged_losses(mlflow_server, run.info.run_id)
    seen.timing_steps = helpers.artifact_timing_steps(mlflow_server, run.info.run_id, e2e_dir / "stopped-artifacts")
    return seen


@scenario
def row_resume(movielens_shards, stopped_run, e2e_dir):
    """The stopped run's checkpoint of step 3 (a copy holding that step only), resumed to step 8 in
    overlap mode, untracked."""
    folder = e2e_dir / "row-resume-ckpt"
    folder.mkdir()
    shutil.copytree(stopped_run.folder / "step_3", folder / "step_3")
    run = helpers.freescale_train(movielens_shards, "--max-steps", str(STEPS), "--comm-mode", "overlap",
                                  "--checkpoint.folder", str(folder),
                                  *helpers.small_run_args(e2e_dir, "row-resume", "--parallel.sharding", "row_wise"))
    assert run.returncode == 0, run.stderr[-3000:]
    return SimpleNamespace(run=run, log=helpers.read_summary(e2e_dir / "row-resume.json"), folder=folder)


@scenario
def killed_run(movielens_shards, e2e_dir):
    """Table-wise, prioritized, 8 steps, checkpointed every step, recorded in a sqlite store; rank
    1 is killed (kill -9) after step 2, and no restart is allowed: the job ends. (restarted_run
    resumes after a kill -9.) Attributes: returncode, output, status_after_kill, logged (the steps
    rank 0 recorded before the kill), folder, uri."""
    return queued_or_now("killed_run", movielens_shards, e2e_dir)


@queued("killed_run")
def run_killed(movielens_shards: Path, e2e_dir: Path) -> SimpleNamespace:
    folder, uri = e2e_dir / "killed-ckpt", helpers.sqlite_store(e2e_dir / "killed.db")
    proc = helpers.start_train(movielens_shards, "--comm-mode", "prioritized", "--training.log_every", "1",
                               "--max-steps", str(STEPS), "--parallel.sharding", "table_wise",
                               "--checkpoint.folder", str(folder), "--checkpoint.every_steps", "1",
                               "--tracking-uri", uri, *helpers.SMALL_RUN)
    seen = SimpleNamespace(folder=folder, uri=uri)
    try:
        helpers.read_until_step(proc, 2)
        os.kill(helpers.rank_process(1, str(folder)), signal.SIGKILL)
        seen.output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            helpers.kill_tree(proc.pid)
            proc.wait()
    seen.returncode = proc.returncode
    [run] = helpers.runs_of(uri)
    seen.status_after_kill = run.info.status
    seen.logged = helpers.logged_losses(uri, run.info.run_id)
    return seen


EPOCH_STEPS = 8  # the epochs run's steps per epoch


def short_last_step(rank: int, rows: list[dict]) -> None:
    """What the balance job's default `--leftover keep` makes: a short last step split over the ranks
    (3 samples: 2 on rank 0, 1 on rank 1)."""
    rows[:] = [r for r in rows if r["step"] < EPOCH_STEPS - 1 or r["slot"] < 2 - rank]


@scenario
def epochs_run(e2e_dir):
    """Two epochs on small synthetic shards (2 ranks x 4 samples, 8 steps, a short last step),
    checkpointed every 4 steps keeping the last 2; then a copy of its checkpoint of step 12 (epoch
    1, position 4) resumed to the end. Attributes: shards, folder, log and resumed (the summaries)."""
    return queued_or_now("epochs_run", None, e2e_dir)


@queued("epochs_run")
def run_epochs(_shards: Path | None, e2e_dir: Path) -> SimpleNamespace:
    shards = helpers.write_shards(e2e_dir / "epochs-shards", world_size=2, local_batch=4, num_steps=EPOCH_STEPS,
                                  max_len=30, alter=short_last_step)
    folder, copy = e2e_dir / "epochs-ckpt", e2e_dir / "epochs-resume-ckpt"
    common = ("--training.max_epochs", "2", "--training.log_every", "1000", "--model.embedding_dim", "16",
              "--loss.num_negatives", "8", "--model.hstu.num_layers", "1", "--training.eval_max_samples", "16")
    run = helpers.freescale_train(shards, *common, "--tracking-uri", "none", "--checkpoint.folder", str(folder),
                                  "--checkpoint.every_steps", "4", "--checkpoint.keep_last", "2",
                                  "--summary-json", str(e2e_dir / "epochs.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    copy.mkdir()
    shutil.copytree(folder / "step_12", copy / "step_12")
    resumed = helpers.freescale_train(shards, *common, "--tracking-uri", "none", "--checkpoint.folder", str(copy),
                                      "--summary-json", str(e2e_dir / "epochs-resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return SimpleNamespace(shards=shards, folder=folder, log=helpers.read_summary(e2e_dir / "epochs.json"),
                           resumed=helpers.read_summary(e2e_dir / "epochs-resumed.json"))


RESTART_STEPS, RESTART_EVERY, RESTART_KILL_AT = 25, 10, 15  # a kill between two checkpoints, 10 steps before the end


@scenario
def restarted_run(movielens_shards, e2e_dir):
    """Two launches at once of the same 25-step training (table-wise, plain), checkpointed every 10
    steps, each recorded in its own sqlite store, both with --max-restarts 1. One whose rank 1 is
    killed (kill -9) at step 15: torchrun restarts both ranks from the step-10 checkpoint. The other
    uninterrupted, then stopped by SIGTERM to its process group as soon as its summary line is out
    (its summary file is written by then): the reference losses, and a stop that lands on the run's
    last barrier. Attributes: `restarted` and `stopped`, each with folder, uri, output, returncode, log
    (its --summary-json), seconds; `restarted.launcher_pid` and `restarted.killed_pid`."""
    return queued_or_now("restarted_run", movielens_shards, e2e_dir)


@queued("restarted_run")
def run_restarted(movielens_shards: Path, e2e_dir: Path) -> SimpleNamespace:
    common = ("--max-steps", str(RESTART_STEPS), "--checkpoint.every_steps", str(RESTART_EVERY),
              "--parallel.sharding", "table_wise", "--comm-mode", "plain", "--training.log_every", "1",
              *helpers.SMALL_RUN)

    def launch(name: str, *extra: str) -> tuple[subprocess.Popen, SimpleNamespace]:
        seen = SimpleNamespace(folder=e2e_dir / f"{name}-ckpt", uri=helpers.sqlite_store(e2e_dir / f"{name}.db"),
                               summary=e2e_dir / f"{name}.json", started=time.monotonic())
        return helpers.start_train(movielens_shards, *common, "--checkpoint.folder", str(seen.folder),
                                   "--tracking-uri", seen.uri, "--summary-json", str(seen.summary), *extra), seen

    def stop_after_summary(proc: subprocess.Popen) -> list[str]:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("summary "):
                os.killpg(proc.pid, signal.SIGTERM)  # a scheduler stops the job's process group
                break
        lines += proc.communicate(timeout=120)[0].splitlines(True)
        stopped.seconds = time.monotonic() - stopped.started
        return lines

    procs = []
    try:
        stopped_proc, stopped = launch("restart-reference", "--max-restarts", "1")  # a stop is not restarted
        procs.append(stopped_proc)
        reading = helpers.Background("stopped-run", lambda: stop_after_summary(stopped_proc))
        restarted_proc, restarted = launch("restarted", "--max-restarts", "1")
        procs.append(restarted_proc)
        lines = helpers.read_until_step(restarted_proc, RESTART_KILL_AT)
        restarted.launcher_pid = restarted_proc.pid
        restarted.killed_pid = helpers.rank_process(1, str(restarted.folder))
        os.kill(restarted.killed_pid, signal.SIGKILL)
        restarted.output = "".join(lines) + restarted_proc.communicate(timeout=helpers.TIMEOUT_S)[0]
        restarted.seconds = time.monotonic() - restarted.started
        stopped.output = "".join(reading.result())
    finally:
        for proc in procs:
            if proc.poll() is None:
                helpers.kill_tree(proc.pid)
                proc.wait()
    for seen, proc in ((restarted, restarted_proc), (stopped, stopped_proc)):
        seen.returncode = proc.returncode
        seen.log = helpers.read_summary(seen.summary) if seen.summary.exists() else None
    return SimpleNamespace(restarted=restarted, stopped=stopped)


@scenario
def hung_run(movielens_shards, e2e_dir):
    """Row-wise, prioritized, recorded in a sqlite store, a 10 s collective timeout after the first
    step (set-up keeps init_timeout_s's 600 s: 10 s failed a loaded machine's set-up in CI); rank 1
    is stopped (SIGSTOP: alive but silent) after step 2, so rank 0's next collective times out.
    Mostly a wait: it starts in the background as soon as the MovieLens shards exist (conftest.py),
    when a selected test uses it."""
    return background_or_now("hung_run", lambda: run_hung(movielens_shards, e2e_dir))


def run_hung(shards: Path, folder: Path) -> SimpleNamespace:
    uri = helpers.sqlite_store(folder / "hung.db")
    marker = str(folder / "hung.json")
    proc = helpers.start_train(shards, "--max-steps", "100000", "--comm-mode", "prioritized",
                               "--parallel.sharding", "row_wise", "--training.log_every", "1",
                               "--parallel.collective_timeout_s", "10", "--tracking-uri", uri,
                               "--summary-json", marker, *helpers.SMALL_RUN)
    seen = SimpleNamespace(uri=uri)
    try:
        helpers.read_until_step(proc, 2)
        rank0, rank1 = helpers.rank_process(0, marker), helpers.rank_process(1, marker)
        os.kill(rank1, signal.SIGSTOP)
        # Once rank 0 has given up, the stopped rank is let go: it takes the SIGTERM torchrun sent
        # it at once, instead of torchrun waiting 30 s to kill it.
        helpers.wait_until_gone(rank0, timeout=120)
        os.kill(rank1, signal.SIGCONT)
        seen.output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            helpers.kill_tree(proc.pid)
            proc.wait()
    seen.returncode = proc.returncode
    [run] = helpers.runs_of(uri)
    seen.run_id, seen.final_status = run.info.run_id, run.info.status
    seen.logged = helpers.logged_losses(uri, run.info.run_id)
    return seen


BACKGROUND: dict[str, helpers.Background] = {}
"""The scenarios started in the background, by name."""
AT_SESSION_START: dict = {}
"""Scenario bodies that need only a folder (name -> body(folder)): started in the background when
the session starts (``start_background_at_session_start``)."""


def start_background(name: str, run) -> None:
    """``run()`` in a thread (``helpers.Background``), when a selected test uses the scenario ``name``
    (``helpers.SELECTED_FIXTURES``): its waits overlap the tests that run meanwhile."""
    if name in helpers.SELECTED_FIXTURES and name not in BACKGROUND:
        BACKGROUND[name] = helpers.Background(name, run)


def start_background_at_session_start(root: Path) -> None:
    for name, body in AT_SESSION_START.items():
        start_background(name, functools.partial(body, root / name))


def background_or_now(name: str, run):
    """The scenario ``name``'s background run's result, or (not started) ``run()`` now."""
    started = BACKGROUND.get(name)
    return started.result() if started else run()


def at_session_start(body):
    AT_SESSION_START[body.__name__.removeprefix("run_")] = body
    return body


@at_session_start
def run_lone_node(folder: Path) -> SimpleNamespace:
    """Node 0 of 2 alone at a free endpoint, --rdzv-timeout LONE_NODE_TIMEOUT_S, an empty shard folder
    (the ranks never start); its first stderr line and when, its end and output."""
    import time
    import uuid

    shards = folder / "shards"
    shards.mkdir(parents=True)
    seen = SimpleNamespace(endpoint=f"127.0.0.1:{helpers.free_port()}", marker=uuid.uuid4().hex, logs=folder / "logs")
    cmd = [sys.executable, "-m", "freescale.jobs.cli", "train", "--shards", str(shards), "--nproc-per-node", "1",
           "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", seen.endpoint,
           "--rdzv-timeout", str(LONE_NODE_TIMEOUT_S), "--tracking-uri", "none"]
    # The marker is in the environment of the launcher and all it starts.
    env = {**helpers.train_env(), "FREESCALE_LOG_DIR": str(seen.logs), "FREESCALE_TEST_RDZV": seen.marker}
    seen.started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=helpers.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        seen.first = proc.stderr.readline()
        seen.said_at = time.monotonic()
        seen.out, seen.rest = proc.communicate(timeout=LONE_NODE_TIMEOUT_S + 30)
    finally:
        if proc.poll() is None:
            helpers.kill_tree(proc.pid)
            proc.wait()
    seen.ended, seen.returncode = time.monotonic(), proc.returncode
    return seen


LONE_NODE_TIMEOUT_S = 5  # short: the run takes about this and torchrun's start


@scenario
def lone_node(tmp_path_factory):
    """`freescale train` as node 0 of 2 with node 1 never started, --rdzv-timeout 5: it waits, then
    gives up (a wait: started in the background with the session). Attributes: endpoint, marker,
    logs, first (its first stderr line), started, said_at, ended (monotonic), returncode, out, rest."""
    return background_or_now("lone_node", lambda: run_lone_node(tmp_path_factory.mktemp("lone_node")))


@at_session_start
def run_gpu_bench_smoke(folder: Path) -> tuple[subprocess.CompletedProcess, str]:
    folder.mkdir(parents=True, exist_ok=True)
    output = folder / "hstu_gpu.md"
    run = subprocess.run([sys.executable, "-m", "benchmarks.hstu_gpu_bench", "--smoke", "--output", str(output)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    return run, output.read_text() if output.exists() else ""


@scenario
def gpu_bench_smoke(tmp_path_factory):
    """`python -m benchmarks.hstu_gpu_bench --smoke`: the GPU check's every section at toy sizes on
    CPU, through the Triton interpreter (one process on one core, started in the background with the
    session). Returns the finished run and the markdown it wrote."""
    return background_or_now("gpu_bench_smoke", lambda: run_gpu_bench_smoke(tmp_path_factory.mktemp("gpu_bench_smoke")))


@scenario
def failed_launches(movielens_shards, e2e_dir):
    """Two failing launches, each gathered by the launcher into its last line: no manifest.json on
    either rank (--verbose), and a corrupt Parquet file on rank 1 only (rank 0 is stopped too)."""
    return queued_or_now("failed_launches", movielens_shards, e2e_dir)


@queued("failed_launches")
def run_failed_launches(movielens_shards: Path, e2e_dir: Path) -> SimpleNamespace:
    root = e2e_dir / "failed-launches"
    empty = root / "no-shards"
    empty.mkdir(parents=True)
    env = {k: v for k, v in helpers.train_env().items()
           if k not in ("FREESCALE_LOG_FILE", "FREESCALE_VERBOSE", "FREESCALE_DEBUG")}

    def freescale_train(shards: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "freescale.jobs.cli", "train", "--shards", str(shards), "--nproc-per-node", "2",
               "--max-steps", "2", "--tracking-uri", "none", *helpers.SMALL_RUN, *extra]
        return subprocess.run(cmd, cwd=helpers.REPO, env={**env, "FREESCALE_LOG_DIR": str(root / name / "logs")},
                              capture_output=True, text=True, timeout=helpers.TIMEOUT_S)

    corrupt = helpers.copy_shards(movielens_shards, root / "corrupt")
    victim = sorted((corrupt / "rank=1").glob("*.parquet"))[0]
    victim.write_bytes(b"\x00" * victim.stat().st_size)
    return SimpleNamespace(
        empty=empty, no_manifest=freescale_train(empty, "no-manifest", "--verbose"), no_manifest_logs=root / "no-manifest" / "logs",
        victim=victim, corrupt=freescale_train(corrupt, "corrupt"), corrupt_logs=root / "corrupt" / "logs")


@scenario
def dist(tmp_path_factory):
    """`make dist` into a temporary folder, with this venv as it is (its install step not rerun):
    the wheel and sdist `python -m build` made, and the executors' zip. Attributes: wheel, sdist,
    zip (paths)."""
    out = tmp_path_factory.mktemp("dist") / "dist"
    venv = Path(sys.prefix)
    run = subprocess.run(["make", "--no-print-directory", "-o", str(venv / ".installed-cpu"), "dist",
                          f"VENV={venv}", f"DIST={out}"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    [wheel], [sdist] = out.glob("freescale-*.whl"), out.glob("freescale-*.tar.gz")
    return SimpleNamespace(wheel=wheel, sdist=sdist, zip=out / "freescale.zip")


@scenario
def spark_cluster(tmp_path_factory):
    """A Spark standalone cluster, a master and two workers of 1 core each (tests/helpers.py's
    SparkCluster), stopped with nothing of it left running. A worker a test kills is not replaced."""
    cluster = helpers.SparkCluster(tmp_path_factory.mktemp("spark-cluster"))
    yield cluster
    cluster.stop()


@scenario
def resized_run(movielens_shards, e2e_dir):
    """A resume on another world size: 10 steps on 2 ranks with a checkpoint, then `--nproc-per-node
    3` on the same shards and checkpoint folder to the epoch's end. Attributes: first, second (the
    launches), first_log, second_log (their --summary-json), folder."""
    return queued_or_now("resized_run", movielens_shards, e2e_dir)


@queued("resized_run")
def run_resized(movielens_shards: Path, e2e_dir: Path) -> SimpleNamespace:
    folder = e2e_dir / "resize-ckpt"
    common = ("--checkpoint.folder", str(folder), "--checkpoint.every_steps", "10", "--training.log_every", "1000",
              "--tracking-uri", "none", *helpers.SMALL_RUN)
    first = helpers.freescale_train(movielens_shards, "--max-steps", "10", "--summary-json",
                                    str(e2e_dir / "resize-2.json"), *common)
    assert first.returncode == 0, first.stderr[-3000:]
    second = helpers.freescale_train(movielens_shards, "--summary-json", str(e2e_dir / "resize-3.json"), *common,
                                     nproc=3)
    assert second.returncode == 0, second.stderr[-3000:]
    return SimpleNamespace(first=first, second=second, folder=folder,
                           first_log=helpers.read_summary(e2e_dir / "resize-2.json"),
                           second_log=helpers.read_summary(e2e_dir / "resize-3.json"))


@scenario
def warm_run(movielens_shards, resized_run, mlflow_server, e2e_dir):
    """A warm start on 2 ranks: `--init-from` resized_run's checkpoint folder (one epoch of the MovieLens
    shards, its last steps on 3 ranks; the newest complete step is loaded), 8 steps of the same model and
    seed, recorded on the session's server (experiment e2e-warm). row_run is the same run's cold start.
    Attributes: run, log (its --summary-json), params (its MLflow params), source (the checkpoint folder)."""
    out, source = e2e_dir / "warm.json", resized_run.folder
    run = helpers.freescale_train(movielens_shards, "--max-steps", str(STEPS), "--init-from", str(source),
                                  "--tracking-uri", mlflow_server, "--tracking.experiment", "e2e-warm",
                                  "--summary-json", str(out), *helpers.SMALL_RUN)
    assert run.returncode == 0, run.stderr[-3000:]
    [recorded] = helpers.runs_of(mlflow_server, "e2e-warm")
    return SimpleNamespace(run=run, log=helpers.read_summary(out), params=recorded.data.params, source=source)
