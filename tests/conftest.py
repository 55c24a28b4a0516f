"""Shared fixtures: one local SparkSession, one MovieLens prepare, one mlflow server per test run,
and the session's end-to-end trainings (2 ranks under torchrun), each started once and read by the
tests of several modules. The terminal summary counts the multi-process launches (tests/helpers.py).

``pytest --fast`` (``make test-fast``) is the tier that needs no JVM and no second process: it
leaves out the tests marked ``slow`` or ``spawns`` (a test using a fixture declared ``@spawns`` is
marked here), and fails the run if a test it kept started a process or Spark anyway."""
from __future__ import annotations

import importlib.util
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

# The Triton kernel's CPU tests (tests/training/test_hstu_kernel.py) run in Triton's interpreter, which
# triton fixes when it is first imported in a process -- and torchrec imports it, so any test
# module could be first. Chosen here, before every import; a machine with a GPU runs the
# compiled kernel instead (tests/training/test_hstu_kernel_cuda.py). Jobs the tests launch inherit it:
# they run the grouped kernel on CPU, which it does not touch.
if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from tests import helpers  # noqa: E402
from tests.scenarios import *  # noqa: E402,F401,F403  (the end-to-end scenarios: fixtures of every test module)
from tests.scenarios import SCENARIOS  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
MOVIELENS_DIR = helpers.MOVIELENS_DIR

# Jobs' Spark progress lines (freescale/runtime/progress.py) off: tests count a job's stderr lines, and a
# loaded machine would make a stage long enough to print one. tests/runtime/test_progress.py turns it on.
os.environ.setdefault("FREESCALE_PROGRESS", "0")
# Every Spark driver the suite starts (the session's, the jobs', spark-submit's) runs helpers.TEST_JVM_OPTS.
os.environ.setdefault("SPARK_SUBMIT_OPTS", helpers.TEST_JVM_OPTS)


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: leave out the tests marked slow or spawns; fail if a kept one starts a "
                          "process or a JVM")


def pytest_configure(config):
    config.addinivalue_line("markers", "spawns: starts a JVM (Spark) or another process (by hand, or for a fixture "
                                       "declared @spawns); --fast leaves it out")
    config.addinivalue_line("markers", "e2e: uses an end-to-end scenario (tests/scenarios.py); -m e2e runs that tier")
    helpers.count_launches()


@pytest.hookimpl(tryfirst=True)  # before -m reads the marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if helpers.SPAWNING_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.spawns)
        if set(SCENARIOS) & set(item.fixturenames):
            item.add_marker(pytest.mark.e2e)
    if config.getoption("fast"):
        kept = [item for item in items if not any(item.iter_markers("slow")) and not any(item.iter_markers("spawns"))]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def pytest_collection_finish(session):
    helpers.SELECTED_FIXTURES.update(name for item in session.items for name in item.fixturenames)
    # In the background from the start (tests/helpers.py's DataJobsRun): the no-torch check's run of
    # the data jobs (`make spark-archive` writes the machine's Spark class archive with one more).
    # The fast tier starts no process.
    # The GPU machine has neither MLflow nor Spark (benchmarks/gpu_check.sh): its spawning tests need neither.
    data_jobs_can_run = all(importlib.util.find_spec(name) is not None for name in ("mlflow", "pyspark"))
    if (data_jobs_can_run and not session.config.getoption("fast") and not session.config.option.collectonly
            and any(item.get_closest_marker("spawns") for item in session.items)):
        # MLflow imported here first, before any background thread: two threads importing it at once
        # can see it partially initialized ("no attribute 'version'"), which failed 20 tests in one run.
        import mlflow.tracking  # noqa: F401
        helpers.DATA_JOBS.append(helpers.DataJobsRun().start())
        # And the scenarios that need only a folder, when a selected test uses them (tests/scenarios.py).
        import tempfile

        from tests.scenarios import start_background_at_session_start

        BACKGROUND_ROOT.append(Path(tempfile.mkdtemp(prefix="freescale-background-")))
        start_background_at_session_start(BACKGROUND_ROOT[0])


BACKGROUND_ROOT: list[Path] = []


def fast_tier_violations() -> list[str]:
    """What a fast run started: recorded processes, a Spark JVM, and -- for any the wrappers missed
    -- a child process this one has reaped or still has."""
    found = list(helpers.PROCESSES)
    pyspark = sys.modules.get("pyspark")
    if pyspark is not None and pyspark.SparkContext._gateway is not None:
        found.append("a Spark JVM (pyspark's gateway is up)")
    if not found and resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss:
        found.append("a child process, started by none of the wrapped calls, has run and exited")
    live = " ".join(Path(task, "children").read_text() for task in Path("/proc/self/task").iterdir()).split()
    if live:
        found.append(f"child processes still running: {', '.join(live)}")
    return found


def pytest_sessionfinish(session, exitstatus):
    import shutil

    from tests.scenarios import BACKGROUND, QUEUE

    for queue in QUEUE:  # a run cut short (-x) starts no more and leaves no launch behind
        queue.close()
    for started in BACKGROUND.values():
        started.thread.join(helpers.TIMEOUT_S)
    for root in BACKGROUND_ROOT:
        shutil.rmtree(root, ignore_errors=True)
    for data_jobs in helpers.DATA_JOBS:
        if data_jobs.background is not None:
            data_jobs.background.thread.join(60)
        shutil.rmtree(data_jobs.root, ignore_errors=True)
    for template in helpers.EMPTY_STORE:  # sqlite_store's template, made once per run
        shutil.rmtree(template.parent, ignore_errors=True)
    if session.config.getoption("fast") and fast_tier_violations() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    helpers.CURRENT_TEST[0] = item.nodeid
    yield


def pytest_terminal_summary(terminalreporter, config):
    launches = helpers.LAUNCHES
    terminalreporter.write_line(f"multi-process launches: {len(launches)}")
    for launch in launches:
        terminalreporter.write_line(f"  {launch}")
    if config.getoption("fast"):
        violations = fast_tier_violations()
        terminalreporter.write_line(f"fast tier: {len(violations)} processes or JVMs started (0 expected)",
                                    red=bool(violations), bold=bool(violations))
        for violation in violations:
            terminalreporter.write_line(f"  {violation}  (mark the test spawns, or declare its fixture @spawns)")


@pytest.fixture
def fresh_log(tmp_path, monkeypatch) -> Path:
    """In-process jobs log to tmp_path/logs, nothing verbose: an earlier in-process job of the session
    may have named a log, and its error lines would then end "(details: ...)"."""
    from freescale.runtime import job_errors
    from freescale.runtime import logs

    folder = tmp_path / "logs"
    monkeypatch.setenv(logs.LOG_DIR_ENV, str(folder))
    for name in (logs.LOG_FILE_ENV, logs.VERBOSE_ENV, logs.DEBUG_ENV, job_errors.STATUS_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(logs, "_log_file", None)
    monkeypatch.setattr(logs, "_verbose", False)
    return folder


@pytest.fixture(scope="module")
def single_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy shared
    2-core machine OpenMP threads waiting on each other made steps 10-50x slower."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
@helpers.spawns
def spark():
    from freescale.runtime.session import build_spark_session

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = build_spark_session(master="local[2]", app_name="freescale-tests")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def movielens_dir() -> Path:
    if not (MOVIELENS_DIR / "ratings.parquet").exists():
        pytest.fail(f"MovieLens-100K not found at {MOVIELENS_DIR} (expected ../shared/data/movielens-100k)")
    return MOVIELENS_DIR


@pytest.fixture(scope="session")
def movielens_prepared(spark, movielens_dir, tmp_path_factory) -> Path:
    """MovieLens-100K with its user features through the real prepare job (shared by the job
    and trainer tests)."""
    from freescale.jobs import prepare

    out = tmp_path_factory.mktemp("ml") / "prepared"
    assert prepare.main(["--input", str(movielens_dir / "ratings.parquet"), "--output", str(out),
                         "--user-features", str(movielens_dir / "users.parquet"), "--tracking-uri", "none"]) == 0
    return out


@pytest.fixture(scope="session")
def movielens_shards(spark, movielens_prepared, tmp_path_factory, e2e_dir) -> Path:
    """2-rank balanced shards of MovieLens-100K (kk, 16 samples per rank per step)."""
    from tests.scenarios import run_hung, start_background, start_queue

    shards = _balanced_shards(movielens_prepared, tmp_path_factory.mktemp("ml-shards") / "kk", world_size=2)
    # Mostly a wait: it overlaps the tests that run meanwhile.
    start_background("hung_run", lambda: run_hung(shards, tmp_path_factory.mktemp("hung")))
    # The selected trainings that need only these shards, one at a time, beside the tests that follow.
    start_queue(shards, e2e_dir)
    return shards


@pytest.fixture
@helpers.spawns
def other_process():
    """A live process that is not this one (the holder of someone else's lock)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture(scope="session")
@helpers.spawns
def mlflow_server(tmp_path_factory):
    """One real `mlflow server` on a fresh sqlite store for the session; its address. Each user
    records into an experiment of its own."""
    from tests.helpers import mlflow_server as serve

    root = tmp_path_factory.mktemp("mlflow-server")
    with serve(f"sqlite:///{root / 'server.db'}", root) as address:
        yield address


@pytest.fixture(scope="session")
def movielens_shards_1(spark, movielens_prepared, tmp_path_factory) -> Path:
    """1-rank balanced shards of MovieLens-100K (16 samples per step): the in-process trainer's."""
    return _balanced_shards(movielens_prepared, tmp_path_factory.mktemp("ml-shards-1") / "kk", world_size=1)


def _balanced_shards(prepared: Path, out: Path, world_size: int) -> Path:
    from freescale.jobs import balance

    assert balance.main(["--input", str(prepared), "--output", str(out), "--world-size", str(world_size),
                         "--local-batch-size", "16", "--leftover", "drop", "--tracking-uri", "none"]) == 0
    return out
