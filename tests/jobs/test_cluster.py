"""prepare and balance on a Spark standalone cluster (a master and two workers, separate JVMs),
submitted as docs/cluster.md says: `spark-submit --master spark://... --py-files dist/freescale.zip
jobs/JOB.py ...`, the executors' Python an environment with the dependencies but not the project
(a packed environment's), so the project reaches them only through the zip. Their output is the
output of the same jobs on local Spark (the session's MovieLens prepare and 2-rank shards), row
for row; and a worker killed mid-job must not change it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests import helpers

pytestmark = pytest.mark.extended  # docs/testing.md: the extended tier

REPO = Path(__file__).resolve().parents[2]
BALANCE_ARGS = ("--world-size", "2", "--local-batch-size", "16", "--leftover", "drop")  # conftest's movielens_shards


@pytest.fixture(scope="module")
def executor_python(tmp_path_factory) -> Path:
    """The executors' interpreter: this venv's Python and its dependencies, without site
    processing, so neither its editable install of the project nor the repo is on the path.
    Each start appends a line to `<it>.starts`."""
    root = tmp_path_factory.mktemp("executor-env")
    script = root / "python"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$$" >> "{script}.starts"\n'
        f'PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{sysconfig.get_paths()["purelib"]}" '
        f'exec "{sys.executable}" -S "$@"\n')
    script.chmod(0o755)
    return script


def submit(cluster, executor_python: Path, dist, script: str, *args: str, conf: tuple[str, ...] = ()
           ) -> subprocess.Popen:
    """spark-submit of freescale/jobs/`script` to the cluster, the project shipped as the executors' zip."""
    env = {**os.environ, "PYSPARK_PYTHON": str(executor_python), "PYSPARK_DRIVER_PYTHON": sys.executable,
           "SPARK_LOCAL_IP": "127.0.0.1"}
    settings = [arg for setting in ("spark.ui.enabled=false", f"spark.executor.extraJavaOptions={helpers.TEST_JVM_OPTS}",
                                    *conf) for arg in ("--conf", setting)]
    cmd = [str(Path(sys.executable).parent / "spark-submit"), "--master", cluster.url, *settings,
           "--py-files", str(dist.zip), str(REPO / "freescale" / "jobs" / script), *args, "--tracking-uri", "none"]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            helpers.kill_tree(proc.pid)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def cluster_prepared(spark_cluster, executor_python, dist, movielens_dir, tmp_path_factory) -> Path:
    """prepare as docs/cluster.md runs it but without spark.checkpoint.dir: its intermediate tables
    stay in the executors' block stores (localCheckpoint), the path a cluster takes when nobody
    sets one (balance's test below sets one, and kills a worker)."""
    out = tmp_path_factory.mktemp("cluster-prepare") / "prepared"
    run = finish(submit(spark_cluster, executor_python, dist, "prepare.py",
                        "--input", str(movielens_dir / "ratings.parquet"), "--output", str(out),
                        "--user-features", str(movielens_dir / "users.parquet")))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "943 sequences" in run.stdout
    return out


def table(path: Path):
    """A Parquet folder's rows in file order."""
    return pq.read_table(path).to_pandas()


def portable(manifest: dict) -> dict:
    """A manifest less what names the run rather than the shards: when and from which path it was
    written, how long planning took, file names (a write's UUID) and file checksums (parquet-mr
    lists a column's encodings in hash-set order, so equal rows can differ in a footer byte; the
    rows are compared instead)."""
    ranks = [{**rank, "files": [{k: v for k, v in f.items() if k not in ("path", "sha256")} for f in rank["files"]]}
             for rank in manifest["ranks"]]
    stats = {k: v for k, v in manifest["stats"].items() if k != "plan_seconds"}
    return {**{k: v for k, v in manifest.items() if k not in ("created_unix_s", "content_sha256")},
            "input": manifest["input"]["samples"], "stats": stats, "ranks": ranks}


def assert_same_shards(ours: Path, local: Path) -> None:
    assert portable(helpers.load_manifest(ours)) == portable(helpers.load_manifest(local))
    for rank in range(helpers.load_manifest(local)["world_size"]):
        assert helpers.read_rank(ours, rank).equals(helpers.read_rank(local, rank)), f"rank {rank}"
    assert table(ours / "_steps").equals(table(local / "_steps"))


@pytest.mark.slow
def test_prepare_on_the_cluster_is_the_local_prepare(cluster_prepared, movielens_prepared):
    for part in ("sequences", "item_vocab", "user_feature_vocab"):
        cluster, local = table(cluster_prepared / part), table(movielens_prepared / part)
        assert len(cluster) > 0 and cluster.equals(local), part
    assert json.loads((cluster_prepared / "prepare.json").read_text()) == \
        json.loads((movielens_prepared / "prepare.json").read_text())


PIPELINE_ON_THE_CLUSTER = """
[pipeline]
workdir = "{workdir}"
tracking_uri = "none"
master = "{master}"
world_size = 1
local_batch_size = 8
[prepare]
synthetic_users = 200
synthetic_items = 100
max_seq_len = 32
[balance]
window_steps = 4
[train.overrides]
"model.hstu.embedding_dim" = 16
"model.hstu.num_layers" = 1
"model.hstu.num_heads" = 1
"loss.num_negatives" = 8
"training.max_steps" = 2
"training.eval_max_samples" = 16
"""


@pytest.mark.slow
def test_the_pipelines_spark_stages_run_on_the_cluster_its_master_names(spark_cluster, tmp_path):
    """`[pipeline] master = spark://...`: prepare and balance run on the cluster (an application whose
    executors are its workers'), the rest of the pipeline as with local Spark. The executors' Python is
    this environment's, where the project is installed."""
    apps_before = {app.name for worker in spark_cluster.worker_dirs for app in worker.glob("app-*")}
    config = tmp_path / "pipeline.toml"
    config.write_text(PIPELINE_ON_THE_CLUSTER.format(workdir=tmp_path / "work", master=spark_cluster.url))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
           "FREESCALE_LOG_DIR": str(tmp_path / "logs")}
    run = subprocess.run([sys.executable, "-m", "freescale.jobs.cli", "pipeline", "--config", str(config)], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = run.stdout.split("summary of", 1)[1]
    for stage in ("prepare", "balance", "train"):
        assert f"freescale pipeline: {stage:<9} ran" in summary, summary
    # One application (the stages share the pipeline's Spark session), its tasks run by the workers' executors.
    apps = [app for worker in spark_cluster.worker_dirs for app in worker.glob("app-*") if app.name not in apps_before]
    assert len({app.name for app in apps}) == 1, apps
    tasks = sum(log.read_text(errors="replace").count("Executor: Running task") for app in apps
                for log in app.glob("*/stderr"))
    assert tasks > 0
    assert helpers.load_manifest(tmp_path / "work" / "shards")["world_size"] == 1


# The worker is killed with a task in flight once its executor has finished this many: past the
# job's first three one-task stages (schema, counts), so it also holds results the rest of the job
# reads (shuffle output, the first checkpointed table).
KILL_AFTER_TASKS = 4


def tasks_of(worker_dir: Path, apps_before: set[str]) -> tuple[int, int]:
    """(started, finished) tasks of the executors of the applications after `apps_before` on this worker."""
    logs = [log.read_text(errors="replace") for app in worker_dir.glob("app-*") if app.name not in apps_before
            for log in app.glob("*/stderr")]
    return (sum(log.count("Executor: Running task") for log in logs),
            sum(log.count("Executor: Finished task") for log in logs))


@pytest.mark.slow
def test_balance_on_the_cluster_writes_the_local_shards_though_a_worker_is_killed(
        spark_cluster, executor_python, dist, cluster_prepared, movielens_shards, tmp_path):
    """balance on the cluster, its executors' Python the packed environment's with the project from
    the zip only; a worker killed mid-job: Spark runs its tasks again and the shards are still the
    local ones, row for row. (One run for both: a clean cluster run would only repeat its first
    half.) With spark.checkpoint.dir set, balance keeps its intermediate tables there
    (freescale.runtime.session's checkpoint) rather than in the executors' block stores (localCheckpoint),
    where the lost worker's blocks could not be recomputed (CHECKPOINT_RDD_BLOCK_ID_NOT_FOUND).
    Runs last in this module: the killed worker is not replaced."""
    starts = Path(f"{executor_python}.starts")
    before = len(starts.read_text().splitlines()) if starts.exists() else 0
    victim = 1
    apps_before = {app.name for app in spark_cluster.worker_dirs[victim].glob("app-*")}
    events, checkpoints, shards = tmp_path / "events", tmp_path / "checkpoints", tmp_path / "shards"
    events.mkdir()
    # A reliable checkpoint folder, which a cluster's jobs need to survive a lost executor.
    proc = submit(spark_cluster, executor_python, dist, "balance.py", "--input", str(cluster_prepared),
                  "--output", str(shards), *BALANCE_ARGS,
                  conf=("spark.eventLog.enabled=true", "spark.eventLog.compress=false",
                        f"spark.eventLog.dir={events.as_uri()}", f"spark.checkpoint.dir={checkpoints.as_uri()}"))
    deadline = time.monotonic() + 300
    while (tasks := tasks_of(spark_cluster.worker_dirs[victim], apps_before))[1] < KILL_AFTER_TASKS \
            or tasks[0] == tasks[1]:
        if proc.poll() is not None or time.monotonic() > deadline:
            finish(proc)
            pytest.fail(f"the job ended (status {proc.returncode}) before worker {victim} finished "
                        f"{KILL_AFTER_TASKS} tasks and started another")
        time.sleep(0.1)
    spark_cluster.kill_worker(victim)
    assert proc.poll() is None, "the job ended before the worker was killed"
    run = finish(proc)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # The windows are planned and the files checksummed in Python on the executors: the packed
    # environment's interpreter ran there, with the project from the zip only.
    assert len(starts.read_text().splitlines()) > before
    for work in spark_cluster.worker_dirs:
        assert list(work.glob("app-*/*/freescale.zip")), f"no executor of {work.name} fetched the zip"
    # Spark 4 writes an application's events as a folder of rolled files.
    logged = [json.loads(line) for log in sorted(events.rglob("events_*")) for line in log.read_text().splitlines()]
    assert any(e["Event"] == "SparkListenerExecutorRemoved" for e in logged)
    # What the worker ran or held was run again: a task lost with it or resubmitted for its output,
    # one whose shuffle input was gone, or a stage resubmitted.
    redone = [e for e in logged if (e["Event"] == "SparkListenerTaskEnd" and e["Task End Reason"]["Reason"]
                                    in ("ExecutorLostFailure", "FetchFailed", "Resubmitted"))
              or (e["Event"] == "SparkListenerStageSubmitted" and e["Stage Info"]["Stage Attempt ID"] > 0)]
    assert redone, "nothing of the killed worker's was run again"
    assert all(e["Job Result"]["Result"] == "JobSucceeded" for e in logged if e["Event"] == "SparkListenerJobEnd")
    # Its tables were read back from spark.checkpoint.dir (reliable checkpoints), and the job
    # removed them when it ended.
    assert "ReliableCheckpointRDD" in json.dumps(logged), "balance kept nothing in spark.checkpoint.dir"
    assert not list(checkpoints.rglob("*")), "balance left its checkpoints behind"
    assert_same_shards(shards, movielens_shards)
