"""Test helpers shared by the test modules (no test module imports another): starting trainings,
reading their output and MLflow record, a real mlflow server, reading a balance job's output
back, writing a shard set without Spark, and counting the suite's multi-process launches.

Launch counting: ``count_launches()`` (installed by conftest.py) wraps ``subprocess.Popen``,
multiprocessing's process start and torch's ``mp.spawn`` in the test process. A launch is a
process that starts several ranks: torch's elastic launcher (``torch.distributed.run``), a
``freescale train`` / ``freescale pipeline`` child (each starts torchrun itself), or ``mp.spawn``
of two or more processes. conftest prints the count in the terminal summary. Every other process
a test starts is recorded too (``PROCESSES``): the fast tier (``pytest --fast``) starts none.

The fast tier leaves out the tests marked ``slow`` or ``spawns``. A test is marked ``spawns`` by
hand when its own body starts a process, and by conftest when it uses a fixture declared with
``@spawns`` (directly or through other fixtures): Spark's session, an mlflow server, a launch."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
MOVIELENS_DIR = (REPO / ".." / "shared" / "data" / "movielens-100k").resolve()
TIMEOUT_S = 300


def _spark_class_archive() -> Path:
    """Where this machine's suite keeps its archive of Spark's loaded classes: one per pyspark
    install and JDK, kept across runs in the temporary folder."""
    import hashlib
    import importlib.util
    import shutil
    import tempfile

    spec = importlib.util.find_spec("pyspark")
    java = shutil.which("java")
    java = os.path.realpath(java) if java else ""
    key = f"{spec.origin if spec else ''}|{java}|{os.stat(java).st_mtime_ns if java else ''}"
    return Path(tempfile.gettempdir()) / f"freescale-tests-spark-{hashlib.sha1(key.encode()).hexdigest()[:12]}.jsa"


SPARK_CLASS_ARCHIVE = _spark_class_archive()
# The suite's JVMs live seconds to minutes, on 2 cores: the C1 compiler alone and the serial
# collector start them sooner than the server defaults, and the session's in-process jobs ran no
# slower. Each also maps the classes a Spark job loads from SPARK_CLASS_ARCHIVE (class data
# sharing) once DataJobsRun has written it; a JVM started before that, or one whose
# class path differs from the archive's, loads them from the jars as usual, and silently: its CDS
# log is off, since tests count a job's output lines. Drivers get the flags through
# SPARK_SUBMIT_OPTS (conftest.py), the cluster's daemons and executors through SparkCluster.
JVM_SPEED_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xlog:cds=off -Xlog:cds+dynamic=off"
TEST_JVM_OPTS = f"{JVM_SPEED_OPTS} -XX:SharedArchiveFile={SPARK_CLASS_ARCHIVE}"


HEAVY = ("torch", "torchrec", "pyspark")
"""The modules a data job must load only when it needs them (tests/jobs/test_jobs.py)."""


def loaded_after(code: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter, then print which of HEAVY it loaded (the last line of
    its stdout; ``heavy_loaded`` reads it)."""
    probe = f"{code}\nimport sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    return subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=env)


def heavy_loaded(run: subprocess.CompletedProcess) -> list[str]:
    return json.loads(run.stdout.strip().splitlines()[-1].replace("'", '"'))


class DataJobsRun:
    """A synthetic `freescale prepare` and a `balance` of its output, in one fresh interpreter with
    MLflow tracking (sqlite), as a user runs the data jobs: started in the background when the
    session starts (``start``), read by test_jobs' no-torch check (``result``).

    With ``dump`` (``make spark-archive``; the suite never dumps, since on a fresh clone writing the
    archive cost more than the JVMs after it saved: docs/testing.md), and when this machine has no
    SPARK_CLASS_ARCHIVE yet, its JVM writes the archive as it exits: the classes a prepare and a
    balance load, which every later Spark JVM of the suite then maps. The archive is written under
    a temporary name, then renamed once the JVM has exited: a JVM never maps half a file."""

    def __init__(self, dump: bool = False) -> None:
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix="freescale-data-jobs-"))
        self.background: Background | None = None
        self.dump = dump

    def code(self) -> str:
        out, db = self.root / "out", self.root / "mlflow.db"
        # Dumping: the JVM writes the archive as it exits, so this process waits for it to exit.
        wait_for_jvm = ("from pyspark import SparkContext\ngateway = SparkContext._gateway\n"
                        "gateway.proc.stdin.close(); gateway.proc.wait()\n") if self.dump else ""
        return ("from freescale.jobs.cli import main\n"
                f"tracking = ['--tracking-uri', 'sqlite:///{db}']\n"
                f"assert main(['prepare', '--output', '{out}/prepared', '--synthetic-users', '300', "
                "'--synthetic-items', '100', *tracking]) == 0\n"
                f"assert main(['balance', '--input', '{out}/prepared', '--output', '{out}/shards', '--world-size', '2', "
                "'--local-batch-size', '8', *tracking]) == 0\n" + wait_for_jvm)

    def start(self) -> "DataJobsRun":
        self.dump = dump = self.dump and not SPARK_CLASS_ARCHIVE.exists()  # an archive is never rewritten
        partial = SPARK_CLASS_ARCHIVE.with_name(f"{SPARK_CLASS_ARCHIVE.name}.{os.getpid()}.partial")
        opts = f"{JVM_SPEED_OPTS} -XX:ArchiveClassesAtExit={partial}" if dump else TEST_JVM_OPTS
        env = {**os.environ, "SPARK_SUBMIT_OPTS": opts, "FREESCALE_LOG_DIR": str(self.root / "logs")}

        def work() -> subprocess.CompletedProcess:
            try:
                run = loaded_after(self.code(), timeout=600, env=env)
                if dump and run.returncode == 0 and partial.exists():
                    os.replace(partial, SPARK_CLASS_ARCHIVE)
                return run
            finally:
                partial.unlink(missing_ok=True)

        self.background = Background("data-jobs-run", work)
        return self

    def result(self) -> subprocess.CompletedProcess:
        """The finished run (waiting for it)."""
        if self.background is None:
            self.start()
        return self.background.result()


class Background:
    """``run()`` in a thread, so that its waits overlap the tests that run meanwhile; ``result()``
    waits for it and re-raises what it raised."""

    def __init__(self, name: str, run: Callable[[], Any]) -> None:
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(run,), name=name, daemon=True)
        self.thread.start()

    def _run(self, run: Callable[[], Any]) -> None:
        try:
            self.value = run()
        except BaseException as exc:  # noqa: BLE001 -- handed to the test that reads the result
            self.error = exc

    def result(self):
        self.thread.join(TIMEOUT_S)
        if self.error is not None:
            raise self.error
        assert not self.thread.is_alive(), f"the background run {self.thread.name} did not finish"
        return self.value


DATA_JOBS: list[DataJobsRun] = []
"""The session's DataJobsRun, once started (conftest.py)."""

# ------------------------------------------------------------------ launch counting

LAUNCHES: list[str] = []
"""One entry per multi-process launch the suite started: the test's node id and the command's gist."""
PROCESSES: list[str] = []
"""One entry per process the suite started (launches and JVMs included): the test's node id and its gist."""
CURRENT_TEST = [""]
SELECTED_FIXTURES: set[str] = set()
"""Every fixture a selected test uses, directly or not (conftest.py, after collection)."""
SPAWNING_FIXTURES: set[str] = set()
"""The fixtures declared with ``@spawns``."""


def spawns(fixture):
    """Declares a fixture that starts a JVM or another process (under ``@pytest.fixture``): every
    test that uses it is marked ``spawns``, and ``pytest --fast`` leaves it out."""
    SPAWNING_FIXTURES.add(fixture.__name__)
    return fixture


def is_launch(cmd) -> bool:
    """Whether `cmd` (a Popen argv) starts several ranks."""
    if not isinstance(cmd, (list, tuple)):
        return False
    argv = [str(a) for a in cmd]
    if "torch.distributed.run" in argv or any(Path(a).name == "torchrun" for a in argv[:1]):
        return True
    if "freescale.jobs.cli" in argv:
        sub = argv[argv.index("freescale.jobs.cli") + 1:argv.index("freescale.jobs.cli") + 2]
        return sub in (["train"], ["pipeline"])
    return False


def count_launches() -> None:
    """Wrap Popen (subprocess.run goes through it), multiprocessing's start and mp.spawn to record
    every launch and every process."""
    original = subprocess.Popen.__init__
    if getattr(original, "_counts_launches", False):
        return

    def init(self, args, *rest, **kwargs):
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
        # A background thread's process is its own (helpers.Background), not the current test's.
        owner = CURRENT_TEST[0] if threading.current_thread() is threading.main_thread() else \
            f"(background) {threading.current_thread().name}"
        PROCESSES.append(f"{owner}: {' '.join(Path(a).name if i == 0 else a for i, a in enumerate(argv[:4]))}")
        if is_launch(args):
            LAUNCHES.append(f"{owner}: {' '.join(argv[1:4])}")
        return original(self, args, *rest, **kwargs)

    init._counts_launches = True
    subprocess.Popen.__init__ = init

    import multiprocessing.process

    start = multiprocessing.process.BaseProcess.start

    def counted_start(self):
        PROCESSES.append(f"{CURRENT_TEST[0]}: multiprocessing {self.name}")
        return start(self)

    multiprocessing.process.BaseProcess.start = counted_start

    import torch.multiprocessing as mp

    spawn = mp.spawn

    def counted_spawn(fn, args=(), nprocs=1, *rest, **kwargs):
        if nprocs > 1:
            LAUNCHES.append(f"{CURRENT_TEST[0]}: mp.spawn {getattr(fn, '__name__', fn)} x{nprocs}")
        return spawn(fn, args, nprocs, *rest, **kwargs)

    mp.spawn = counted_spawn


# ------------------------------------------------------------------ freescale train, launched

# A small model, and the end-of-run evaluation on 64 samples per rank (all 943 users, test and
# validation item, cost ~1 s per run): runs that measure evaluation pass --training.eval_max_samples 0.
SMALL_RUN = ("--model.hstu.num_layers", "1", "--loss.num_negatives", "32", "--training.eval_max_samples", "64")


def train_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def freescale_train(shards: Path, *args: str, nproc: int = 2, timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    """`freescale train` in a child process (one launch), run to its end."""
    cmd = [sys.executable, "-m", "freescale.jobs.cli", "train", "--shards", str(shards), "--nproc-per-node", str(nproc),
           *args]
    return subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=timeout)


def start_train(shards: Path, *args: str) -> subprocess.Popen:
    """`freescale train` with 2 ranks in its own process group (a terminal's or a scheduler's job),
    output merged on stdout."""
    cmd = [sys.executable, "-m", "freescale.jobs.cli", "train", "--shards", str(shards), "--nproc-per-node", "2", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def read_summary(path: Path) -> dict:
    """A `freescale train --summary-json` file with its timing file's table put in it
    (``timings.steps_ranks_fields``, ``[steps, ranks, fields]``: the tests' runs are small)."""
    from freescale.costs.run_summary import timing_table

    data = json.loads(Path(path).read_text())
    data["timings"]["steps_ranks_fields"] = timing_table(data, path).table().tolist()
    return data


def error_lines(run: subprocess.CompletedProcess) -> list[str]:
    """The launch's error lines: one, gathering the failed ranks' reasons (theirs are in the log)."""
    return [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("freescale train: error:")]


def small_run_args(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return ["--tracking-uri", "none", "--summary-json", str(tmp_path / f"{name}.json"), *SMALL_RUN, *extra]


def read_until_step(proc: subprocess.Popen, step: int) -> list[str]:
    """The output up to the line of training step `step` (0-based; the lines say "step DONE/TOTAL")."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) > step:
            return lines
    raise AssertionError(f"training ended before step {step}:\n" + "".join(lines[-40:]))


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
            if "freescale.jobs.train" in cmdline and marker in cmdline and f"RANK={rank}".encode() in environ:
                return int(proc.name)
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} worker found")


def environ_of(pid: int) -> dict[str, str]:
    """Process `pid`'s environment, as it was started."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def wait_until_gone(pid: int, timeout: float) -> None:
    """Until process `pid` has exited (gone, or a zombie its parent has not reaped yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still running after {timeout} s")


def kill_tree(root: int, signum: int = signal.SIGKILL) -> None:
    """Signal a process and all its descendants (torchrun starts each rank in its own session,
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
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def copy_shards(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def reseal(shards: Path, edit) -> None:
    """A deliberate edit of a shard set's manifest (`edit(dict)`), resealed so only the edit is wrong."""
    from freescale.shards.manifest import seal

    manifest = json.loads((shards / "manifest.json").read_text())
    edit(manifest)
    (shards / "manifest.json").write_text(json.dumps(seal(manifest)))


# ------------------------------------------------------------------ one rank, in this process


def train_in_process(*argv: str) -> int:
    """One training rank in this process (`freescale.jobs.train`'s job without torchrun): a FileStore
    process group of one, its log in a temporary folder. The environment, signal handlers, thread
    count, log, logger levels, warning filters and process group it sets are undone afterwards. Its stderr carries the rank's lines ("freescale train (rank 0): ...")."""
    import torch
    import torch.distributed as dist

    import logging
    import tempfile
    import warnings

    from freescale.jobs import train
    from freescale.runtime.job_errors import run_job
    from freescale.runtime import logs

    handlers = {s: signal.getsignal(s) for s in train.STOP_SIGNALS}
    threads = torch.get_num_threads()
    environ, log_file, verbose = dict(os.environ), logs._log_file, logs._verbose
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 logs.LOG_FILE_ENV, logs.VERBOSE_ENV, logs.DEBUG_ENV):
        os.environ.pop(name, None)
    os.environ[logs.LOG_DIR_ENV] = tempfile.mkdtemp(prefix="freescale-test-logs-")  # not the repo's out/logs
    logs._log_file, logs._verbose = None, False
    # A rank quiets third-party loggers and warnings for its process (freescale/training/parallel/sharding.py): in
    # this one, that would hide them from later tests.
    levels = {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
              if isinstance(logger, logging.Logger)}
    try:
        with warnings.catch_warnings():
            return run_job("train (rank 0)", lambda: train.train(list(argv)))
    finally:
        for name, logger in logging.root.manager.loggerDict.items():
            if isinstance(logger, logging.Logger):
                logger.setLevel(levels.get(name, logging.NOTSET))
        logs._log_file, logs._verbose = log_file, verbose
        os.environ.clear()
        os.environ.update(environ)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()


def without_details(line: str) -> str:
    """An error line without its closing " (details: LOG)"."""
    return line.split(" (details: ", 1)[0]


def in_process_args(shards: Path, *extra: str) -> list[str]:
    """A small 1-rank run's settings, as `freescale train` passes them to a rank."""
    return ["--data.shards", str(shards), "--tracking.uri", "none", *SMALL_RUN, *extra]


def without_torchrun(cmd):
    """torchrun's command for one rank on this machine -> the rank's own command (a group of one)."""
    argv = [str(a) for a in cmd] if isinstance(cmd, (list, tuple)) else cmd
    if isinstance(argv, list) and "torch.distributed.run" in argv and "--nproc-per-node=1" in argv:
        return [argv[0], *argv[argv.index("-m", argv.index("torch.distributed.run") + 1):]]
    return cmd


class _OneRankSubprocess:
    """`subprocess` as freescale.launch.launcher sees it once ``one_rank_without_torchrun`` is on."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(cmd, *args, **kwargs):  # noqa: N802 - subprocess's name
        return subprocess.Popen(without_torchrun(cmd), *args, **kwargs)


def one_rank_without_torchrun(monkeypatch=None) -> None:
    """`freescale train` of one rank starts that rank itself instead of torchrun (the pipeline tests'
    trainings: what they check is the stage engine, and a 1-rank torchrun launch is two processes
    and seconds more for nothing). With `monkeypatch`, undone after the test."""
    from freescale.launch import launcher

    if monkeypatch is None:
        launcher.subprocess = _OneRankSubprocess()
    else:
        monkeypatch.setattr(launcher, "subprocess", _OneRankSubprocess())


# ------------------------------------------------------------------ MLflow


def runs_of(uri: str, experiment: str = "freescale") -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def logged_losses(uri: str, run_id: str) -> list[tuple[int, float]]:
    """(step, loss) of a run's per-step record, in step order."""
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, "step/loss"))


def artifact_timing_steps(uri: str, run_id: str, folder: Path) -> list[int] | None:
    """The steps (one per row: step x rank) of a run's ``timings/timings.parquet``; None if it has none."""
    import pyarrow.parquet as pq
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    if "timings/timings.parquet" not in [a.path for a in client.list_artifacts(run_id, "timings")]:
        return None
    return pq.read_table(client.download_artifacts(run_id, "timings/timings.parquet", str(folder))).column(
        "step").to_pylist()


def wait_for_logged_steps(uri: str, experiment: str, count: int, timeout: float = 60) -> None:
    """Until the experiment's one run has `count` steps recorded (the sink sends in the background)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = runs_of(uri, experiment)
        if runs and len(logged_losses(uri, runs[0].info.run_id)) >= count:
            return
        time.sleep(0.5)


# ------------------------------------------------------------------ a real mlflow server
# One worker on a free local port, in its own process group so that stopping it also stops
# uvicorn's worker. conftest's session fixture `mlflow_server` serves a fresh store; the browser
# test serves the comparison's when it is not on that server.

SERVER_START_S = 120  # it imports all of MLflow twice (CLI, then uvicorn's worker): 56 s seen under load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM, then SIGKILL, to the process group the test started (the server's uvicorn child,
    Chromium's renderer and GPU processes)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


EMPTY_STORE: list[Path] = []
EMPTY_STORE_LOCK = threading.Lock()


def sqlite_store(path: Path) -> str:
    """`sqlite:///<path>`, an empty MLflow store: a copy of one whose tables MLflow made once in
    this run. Making them (every schema migration, one by one) costs each new store's first user a
    second or two; DataJobsRun and the session's server still start from no file."""
    import shutil
    import tempfile

    with EMPTY_STORE_LOCK:  # a background scenario may ask at the same time (tests/scenarios.py)
        if not EMPTY_STORE:
            from mlflow.tracking import MlflowClient

            template = Path(tempfile.mkdtemp(prefix="freescale-empty-store-")) / "mlflow.db"
            MlflowClient(f"sqlite:///{template}").search_experiments()
            EMPTY_STORE.append(template)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(EMPTY_STORE[0], path)
    return f"sqlite:///{path}"


@contextlib.contextmanager
def mlflow_server(store_uri: str, workdir: Path) -> Iterator[str]:
    """`mlflow server` on `store_uri`, its artifacts and log under `workdir`; its address."""
    port = free_port()
    log = workdir / "mlflow-server.log"
    # The job runner is a second process importing MLflow; no test needs it.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", store_uri,
             "--artifacts-destination", str(workdir / "mlartifacts"), "--host", "127.0.0.1",
             "--port", str(port), "--workers", "1"],
            cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"mlflow server exited {server.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{address}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not healthy after {SERVER_START_S} s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield address
    finally:
        stop_group(server)


# ------------------------------------------------------------------ a balance job's output, read back
# With pyarrow, independently of Spark.

def load_manifest(shards: Path) -> dict:
    return json.loads((shards / "manifest.json").read_text())


def read_rank(shards: Path, rank: int):
    """Rows of one rank in file order (the order the trainer will stream them), a DataFrame."""
    import pandas as pd
    import pyarrow.parquet as pq

    manifest = load_manifest(shards)
    files = manifest["ranks"][rank]["files"]
    frames = [pq.read_table(shards / f["path"]).to_pandas() for f in files]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    frame["rank"] = rank
    return frame


def read_all(shards: Path):
    import pandas as pd

    manifest = load_manifest(shards)
    return pd.concat([read_rank(shards, r) for r in range(manifest["world_size"])], ignore_index=True)


# ------------------------------------------------------------------ a shard set, hand-written
# With pyarrow in the balance job's layout (manifest.json + rank=<k>/part-*.parquet, rows in
# (step, slot) order), without Spark: small row groups and several files per rank, so steps
# straddle row-group and file boundaries.

Row = dict[str, Any]
"""One shard row, by column name."""


def step_counts(world_size: int, local_batch: int, num_steps: int, rng: np.random.Generator,
                empty_steps: dict[int, set[int]]) -> np.ndarray:
    """[steps, ranks] sample counts: every step holds a full global batch, split unevenly over
    the ranks as cost balancing does; a rank's empty steps give their share to the others."""
    counts = np.zeros((num_steps, world_size), dtype=np.int64)
    for step in range(num_steps):
        busy = [r for r in range(world_size) if step not in empty_steps.get(r, set())]
        if busy:
            picks = rng.choice(busy, size=world_size * local_batch)
            counts[step] = np.bincount(picks, minlength=world_size)
    return counts


def make_rows(rank: int, counts: np.ndarray, num_items: int, rng: np.random.Generator, max_len: int) -> list[Row]:
    rows = []
    for step, count in enumerate(counts[:, rank]):
        for slot in range(int(count)):
            n = int(rng.integers(1, max_len + 1))
            ts = np.sort(rng.integers(1_000_000, 2_000_000, n)).tolist()
            kind = rng.integers(0, 3)
            if kind == 0:
                ratings = [None] * n  # source without ratings
            else:
                ratings = [None if rng.random() < 0.2 else float(rng.choice([0.5, 1.0, 2.5, 3.0, 4.5, 5.0]))
                           for _ in range(n)]
            rows.append({
                "step": step, "slot": slot, "user_id": f"u{rank}-{step}-{slot}",
                "items": rng.integers(1, num_items + 1, n).tolist(), "timestamps": ts, "ratings": ratings,
                "length": n, "cost": float(n * n), "valid_item": int(rng.integers(1, num_items + 1)),
                "valid_timestamp": ts[-1] + 1, "valid_rating": None if kind == 0 else 4.5, "test_item": int(rng.integers(1, num_items + 1)),
                "test_timestamp": ts[-1] + 2, "origin_step": step, "step_targets": 1000 + step,
            })
    return rows


def write_shards(root: Path, *, world_size: int = 2, local_batch: int = 4, num_steps: int = 7,
                 num_items: int = 40, rows_per_file: int = 7, row_group_size: int = 3, max_len: int = 6,
                 empty_steps: dict[int, set[int]] | None = None, seed: int = 0,
                 alter: Callable[[int, list[Row]], None] | None = None,
                 user_features: list[tuple[str, int]] | None = None) -> Path:
    """Write a shard directory like the balance job's; returns it.

    ``user_features`` (name, table size) adds a ``user_features`` column of random
    ids and lists the features in the manifest, as a prepare run with a user table does.
    """
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from freescale.shards.manifest import seal
    from freescale.shards.schema import MANIFEST_FORMAT, arrow_schema

    rng = np.random.default_rng(seed)
    schema = arrow_schema(user_features=bool(user_features))
    root.mkdir(parents=True, exist_ok=True)
    ranks = []
    counts = step_counts(world_size, local_batch, num_steps, rng, empty_steps or {})
    for rank in range(world_size):
        rows = make_rows(rank, counts, num_items, rng, max_len)
        for row in rows if user_features else ():
            row["user_features"] = [int(rng.integers(0, size)) for _, size in user_features]
        if alter is not None:
            alter(rank, rows)
        rank_dir = root / f"rank={rank}"
        rank_dir.mkdir()
        files = []
        for part, start in enumerate(range(0, len(rows), rows_per_file)):
            chunk = rows[start:start + rows_per_file]
            rel = f"rank={rank}/part-{part:05d}-c000.snappy.parquet"
            pq.write_table(pa.Table.from_pylist(chunk, schema=schema), root / rel,
                           row_group_size=row_group_size, write_page_checksum=True)
            data = (root / rel).read_bytes()
            files.append({"path": rel, "rows": len(chunk), "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
        ranks.append({"rank": rank, "rows": len(rows), "tokens": sum(r["length"] for r in rows),
                      "cost": sum(r["cost"] for r in rows), "files": files})
    manifest = {
        "format": MANIFEST_FORMAT, "world_size": world_size, "local_batch_size": local_batch,
        "global_batch_size": world_size * local_batch, "num_steps": num_steps, "window_steps": 1,
        "strategy": "kk", "control": None, "seed": seed, "num_items": num_items,
        "num_samples": sum(r["rows"] for r in ranks), "leftover": {"policy": "drop", "samples": 0},
        "cost_model": {"kind": "quadratic"}, "stats": {}, "ranks": ranks,
        "user_features": [{"name": name, "num_ids": size} for name, size in user_features or []],
    }
    (root / "manifest.json").write_text(json.dumps(seal(manifest), indent=2))
    return root


# ------------------------------------------------------------------ a Spark standalone cluster
# A master and workers as separate JVMs, started from the `spark-class` that pyspark ships, on
# loopback only. Each daemon leads a process group of its own (a worker's executors join it);
# every process they start carries CLUSTER_ENV in its environment, so stopping the cluster can
# find and end whatever outlived its group (pyspark's daemon makes a group of its own).

CLUSTER_ENV = "FREESCALE_TEST_CLUSTER"
CLUSTER_START_S = 120  # a JVM's start on a loaded 2-core machine


def processes_with(name: str, value: str) -> list[int]:
    """PIDs of the live processes whose environment has `name`=`value`."""
    wanted = f"{name}={value}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if wanted in (proc / "environ").read_bytes().split(b"\0"):
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    found.append(int(proc.name))
        except (OSError, IndexError):
            continue
    return found


class SparkCluster:
    """`spark://127.0.0.1:PORT`: a master and `workers` workers of 1 core and 1 GiB each, logs and
    work folders under `root`."""

    def __init__(self, root: Path, workers: int = 2):
        import pyspark

        self.root = root
        self.spark_home = Path(pyspark.__file__).parent
        # Without PYTHONPATH: the executors' Python gets Spark's paths and the submitted --py-files only.
        inherited = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env = {**inherited, "SPARK_HOME": str(self.spark_home), "SPARK_LOCAL_IP": "127.0.0.1",
                    "SPARK_DAEMON_MEMORY": "256m", "SPARK_DAEMON_JAVA_OPTS": TEST_JVM_OPTS, CLUSTER_ENV: str(root),
                    # No REST submission server: it would listen on a fixed port (6066).
                    "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false"}
        self.daemons: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []
        self.worker_dirs: list[Path] = []
        port = free_port()
        self.url = f"spark://127.0.0.1:{port}"
        try:
            self._await(*self._spawn("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                                "--port", str(port), "--webui-port", "0"]),
                        "I have been elected leader")
            # The workers start side by side: each JVM's start is seconds of one core.
            started = [self._spawn_worker() for _ in range(workers)]
            for proc, log in started:
                self._await(proc, log, "Successfully registered with master")
        except BaseException:
            self.stop()
            raise

    def _spawn_worker(self) -> tuple[subprocess.Popen, Path]:
        index = len(self.workers)
        work = self.root / f"worker-{index}"
        work.mkdir()
        proc, log = self._spawn(f"worker-{index}", [
            "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
            "--webui-port", "0", "--work-dir", str(work), self.url])
        self.workers.append(proc)
        self.worker_dirs.append(work)
        return proc, log

    def _spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.root / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([str(self.spark_home / "bin" / "spark-class"), *args], env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.daemons.append(proc)
        return proc, log

    @staticmethod
    def _await(proc: subprocess.Popen, log: Path, ready: str) -> None:
        deadline = time.monotonic() + CLUSTER_START_S
        while ready not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"spark {log.stem} did not start: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)

    def kill_worker(self, index: int) -> None:
        """A worker's machine dies: SIGKILL to the worker and its executors, at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.workers[index].pid, signal.SIGKILL)
        self.workers[index].wait()

    def stop(self) -> None:
        """Workers, then the master; then anything still carrying the cluster's mark (pyspark
        daemons in groups of their own) is killed. Fails if something is left even so."""
        for proc in reversed(self.daemons):
            stop_group(proc, grace_s=30)
        deadline = time.monotonic() + 30
        while (left := processes_with(CLUSTER_ENV, str(self.root))) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        if left:
            pytest.fail(f"processes of the Spark cluster still running: {left}")


def write_spark_class_archive() -> int:
    """`make spark-archive`: write this machine's SPARK_CLASS_ARCHIVE (a DataJobsRun that dumps it),
    which later runs of the suite's Spark JVMs map. 0 when it exists after."""
    run = DataJobsRun(dump=True).result()
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
    print(f"{SPARK_CLASS_ARCHIVE}: {'written' if SPARK_CLASS_ARCHIVE.exists() else 'not written'}")
    return 0 if SPARK_CLASS_ARCHIVE.exists() else 1


if __name__ == "__main__":
    sys.exit(write_spark_class_archive())
