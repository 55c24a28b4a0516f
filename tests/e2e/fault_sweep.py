"""Reliability sweep: bad inputs, bad values and kills, tried as a new user would.

Every case runs a real `freescale` command in a fresh process on small synthetic
data (and MovieLens-100K where a case needs real files), then records its exit code,
the lines it printed on stderr, what it left at the output, and whether the inputs
are intact. A case passes when it either succeeds and its output checks out, or fails
with exit 2 (bad input) or 3 (environment) and a single `freescale <job>: error:` line
last, having left nothing at its output and no temporary folder behind; a case that stops
a job with SIGTERM expects 128 + 15 and the same single line. At the end, no MLflow run
may be left RUNNING, and no lock.

Usage (from the repository root): python -m tests.e2e.fault_sweep [--workdir out/fault-sweep] [--only NAME ...]
(`make fault-sweep`). The end-to-end tier's long sweep: about 16 minutes on a 2-core machine, so
not part of `make test`; tests/e2e/test_fault_sweep.py checks its table of cases there.

Prints a markdown table; exits 1 when any case misses its target.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tests.helpers import MOVIELENS_DIR, REPO, kill_tree

FREESCALE = str(Path(sys.executable).parent / "freescale")  # the console script of this interpreter's venv

UNREACHABLE = "http://127.0.0.1:9/"  # the discard port: nothing listens there
READ_ONLY = "sqlite:////sys/mlflow.db"  # a system folder no process may create files in
# Spark's progress lines (freescale/runtime/progress.py) are not errors: off, as in the test suite, so a
# case's stderr is the lines that matter.
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "FREESCALE_PROGRESS": "0"}


@dataclass
class Outcome:
    code: int
    stderr: list[str]
    seconds: float


@dataclass
class Case:
    name: str
    expect: str  # "ok", "fail" or "stopped" (SIGTERM: exit 128 + 15)
    run: Callable[["Sweep"], Outcome]
    output: Callable[["Sweep"], Path | None] = lambda s: None
    """The case's output path: must be absent after a failure (nothing half-written)."""
    check: Callable[["Sweep", Outcome], str] = lambda s, o: ""
    """Extra check (on a success, and on a failure or stop that met its target): "" when fine, else what
    is wrong."""
    guarded: list[Path] = field(default_factory=list)


class Sweep:
    def __init__(self, work: Path):
        self.work = work
        self.db = work / "mlflow.db"
        self.tracking = f"sqlite:///{self.db}"
        self.stdout = ""  # the last command's
        self.orphans: list[str] = []  # RUNNING runs a kill -9 left (pipeline case)
        self.endpoint = ""  # the lone node's rendezvous endpoint (multi-node case)
        self.prepare_stage_s: float | None = None  # an uninterrupted prepare stage (SIGTERM timings)
        self.killed_before = self.failed_before = 0  # prepare runs KILLED / FAILED before a stop
        self.left_on_disk: list[str] = []  # what balance left on the full disk

    def path(self, name: str) -> Path:
        return self.work / name

    def freescale(self, *args: str, timeout: float = 300) -> Outcome:
        """Run one command; every run records to the sweep's own MLflow database."""
        tracked = "--tracking-uri" in args or args[0] == "pipeline"  # a pipeline's is in its config
        argv = [FREESCALE, *args, *(() if tracked else ("--tracking-uri", self.tracking))]
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=self.work, env=ENV, capture_output=True, text=True, timeout=timeout)
        self.stdout = done.stdout
        return Outcome(done.returncode, done.stderr.strip().splitlines(), time.perf_counter() - start)


def digest(path: Path) -> str:
    """A content hash of a file or a directory tree (names and bytes)."""
    h = hashlib.sha256()
    for p in sorted([path] if path.is_file() else path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path.parent)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def leftovers(sweep: Sweep) -> list[str]:
    """Temporary siblings and locks (a pipeline's, a checkpoint folder's) any job left anywhere in the
    work folder; the lock the sweep itself holds for a case is not one."""
    def foreign_lock(p: Path) -> bool:
        try:
            return json.loads(p.read_text()).get("pid") != os.getpid()
        except (OSError, ValueError):
            return True
    return sorted(str(p.relative_to(sweep.work)) for p in sweep.work.rglob("*")
                  if ".tmp-" in p.name or ".old-" in p.name or (p.name == "LOCK" and foreign_lock(p)))


def running_runs(sweep: Sweep) -> int:
    return len(runs_of(sweep, "RUNNING"))


def runs_of(sweep: Sweep, status: str, job: str | None = None) -> list[str]:
    """Run ids in the sweep's MLflow database with ``status`` (and tag freescale.job = ``job``)."""
    if not sweep.db.exists():
        return []
    import sqlite3

    with sqlite3.connect(sweep.db) as db:
        rows = db.execute("select r.run_uuid, t.value from runs r left join tags t on t.run_uuid = r.run_uuid "
                          "and t.key = 'freescale.job' where r.status = ?", (status,)).fetchall()
    return [run for run, tag in rows if job is None or tag == job]


# ------------------------------------------------------------------- set-up


def setup(s: Sweep) -> None:
    """One small prepared dataset and its shards, shared by the cases that need valid inputs."""
    ok = s.freescale("prepare", "--output", str(s.path("prepared")), "--synthetic-users", "400",
                     "--synthetic-items", "200", "--max-seq-len", "200")
    assert ok.code == 0, ok.stderr[-5:]
    ok = s.freescale("balance", "--input", str(s.path("prepared")), "--output", str(s.path("shards")),
                     "--world-size", "2", "--local-batch-size", "8")
    assert ok.code == 0, ok.stderr[-5:]
    raw = s.path("raw")
    raw.mkdir()
    shutil.copy(MOVIELENS_DIR / "ratings.parquet", raw / "ratings.parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    ratings = pq.read_table(raw / "ratings.parquet")
    pq.write_table(pa.concat_tables([ratings, ratings.slice(0, 20_000), ratings.slice(0, 20_000)]),
                   s.path("duplicated.parquet"))
    s.path("not-prepared").mkdir()
    s.path("not-prepared/notes.txt").write_text("not a dataset\n")
    zero = {"format": "freescale.cost_model/1", "kind": "quadratic", "a": 0, "b": 0, "c": 0}
    s.path("zero_cost.json").write_text(json.dumps(zero))
    # prepare's inputs of issue 17: a folder whose files spell the item column two ways, gzip CSV
    # (whole and cut short), CSV without rows or with other columns.
    import gzip

    spelt = s.path("spelt-two-ways")
    spelt.mkdir()
    half = ratings.num_rows // 2
    pq.write_table(ratings.slice(0, half), spelt / "part-0.parquet")  # user_id, movie_id, rating, timestamp
    pq.write_table(ratings.slice(half).rename_columns(["user_id", "item", "rating", "timestamp"]),
                   spelt / "part-1.parquet")
    packed = gzip.compress(ratings.to_pandas().to_csv(index=False).encode())
    s.path("ratings.csv.gz").write_bytes(packed)
    s.path("trunc.csv.gz").write_bytes(packed[:len(packed) // 2])
    s.path("empty.csv").write_text("")
    s.path("header-only.csv").write_text("user_id,movie_id,rating,timestamp\n")
    s.path("wrong-columns.csv").write_text("who,what,when\n1,2,3\n")
    s.path("pipeline.toml").write_text(PIPELINE_TOML.format(work=s.path("pipeline"), tracking=s.tracking,
                                                            train=REPO / "configs" / "demo.toml"))


def copy_shards(s: Sweep, name: str, edit: Callable[[dict], None] | None = None, reseal: bool = False) -> Path:
    """A copy of the sweep's shards, its manifest edited: by hand (not resealed, so refused as
    edited), or resealed as if balance had written it."""
    dst = s.path(name)
    shutil.copytree(s.path("shards"), dst)
    if edit is not None:
        manifest = json.loads((dst / "manifest.json").read_text())
        edit(manifest)
        if reseal:
            from freescale.shards.manifest import seal

            manifest = seal(manifest)
        (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def train(s: Sweep, shards: Path, *extra: str, timeout: float = 300) -> Outcome:
    return s.freescale("train", "--shards", str(shards), "--nproc-per-node", "2", "--max-steps", "4",
                       "--config", str(REPO / "configs" / "demo.toml"), *extra, timeout=timeout)


def kill_balance_then_rerun(s: Sweep) -> Outcome:
    """kill -9 a balance once its staging folder exists; the rerun must succeed and clean up."""
    out = s.path("killed-shards")
    argv = [FREESCALE, "balance", "--input", str(s.path("prepared")), "--output", str(out),
            "--world-size", "2", "--local-batch-size", "8", "--tracking-uri", s.tracking]
    proc = subprocess.Popen(argv, cwd=s.work, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not list(s.work.glob("killed-shards.tmp-*")):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    s.orphans = runs_of(s, "RUNNING", "balance")
    return s.freescale("balance", "--input", str(s.path("prepared")), "--output", str(out),
                       "--world-size", "2", "--local-batch-size", "8")


SOAK_KILLS, SOAK_STEPS = 5, 8


def kill_training_soak(s: Sweep) -> Outcome:
    """kill -9 of a whole training (launcher, torchrun and ranks) at a random step, five times.
    Each resume must give the uninterrupted run's losses, take over the stale lock, and continue
    its MLflow run -- not a new one -- to FINISHED with every step's loss exactly once. (The test
    suite does this once, killing one rank: tests/training/test_tracking.py.)"""
    import random

    from mlflow.tracking import MlflowClient

    start = time.perf_counter()
    small = ("--model.hstu.num_layers", "1", "--loss.num_negatives", "16", "--training.eval_max_samples", "64")
    base = ("train", "--shards", str(s.path("shards")), "--nproc-per-node", "2", "--max-steps", str(SOAK_STEPS),
            *small)
    whole = s.freescale(*base, "--tracking-uri", "none", "--summary-json", str(s.path("soak-whole.json")))
    if whole.code:
        return whole
    reference = json.loads(s.path("soak-whole.json").read_text())["losses"]
    problems = []
    env = ENV
    for trial, kill_step in enumerate(random.Random(8).choices(range(1, SOAK_STEPS - 1), k=SOAK_KILLS)):
        folder, uri = s.path(f"soak-ckpt{trial}"), f"sqlite:///{s.path(f'soak{trial}.db')}"
        common = ("--checkpoint.folder", str(folder), "--checkpoint.every_steps", "1", "--tracking-uri", uri)
        proc = subprocess.Popen([FREESCALE, *base, *common, "--training.log_every", "1"], cwd=s.work, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            for line in proc.stdout:
                if line.startswith("step ") and int(line.split()[1].split("/")[0]) > kill_step:
                    break
        finally:
            kill_tree(proc.pid)
            proc.wait(timeout=60)
        if not (folder / "LOCK").exists():
            problems.append(f"trial {trial}: no lock left by the killed job")
        resumed = s.freescale(*base, *common, "--summary-json", str(s.path(f"soak{trial}.json")))
        if resumed.code:
            problems.append(f"trial {trial}: resume exit {resumed.code}: {resumed.stderr[-1:]}")
            continue
        if not any("taking over the stale lock" in line for line in resumed.stderr):
            problems.append(f"trial {trial}: no stale-lock note")
        log = json.loads(s.path(f"soak{trial}.json").read_text())
        first = log["steps"][0]
        if not (1 <= first <= kill_step + 1 and log["steps"] == list(range(first, SOAK_STEPS))):
            problems.append(f"trial {trial} (kill after step {kill_step}): resumed steps {log['steps']}")
        if log["losses"] != reference[first:]:
            problems.append(f"trial {trial} (kill after step {kill_step}): losses differ from the whole run's")
        client = MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("freescale").experiment_id])
        if len(runs) != 1 or runs[0].info.status != "FINISHED":
            problems.append(f"trial {trial}: {len(runs)} MLflow runs, status {[r.info.status for r in runs]}")
        else:
            logged = sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "step/loss"))
            if logged != list(enumerate(reference)):
                problems.append(f"trial {trial}: MLflow step/loss is not every step once with the whole run's loss")
        if (folder / "LOCK").exists():
            problems.append(f"trial {trial}: the resumed job left its lock")
    return Outcome(1 if problems else 0, problems, time.perf_counter() - start)


# A pipeline without a [prepare] section: synthetic data (its default 20,000 users, made smaller
# here by the command line where a case needs to get past prepare).
PIPELINE_TOML = """
[pipeline]
workdir = "{work}"
tracking_uri = "{tracking}"
world_size = 2
local_batch_size = 8
[train]
config = "{train}"
max_steps = 4
"""
SMALL_PIPELINE = ("--prepare.synthetic_users", "400", "--prepare.synthetic_items", "200",
                  "--prepare.max_seq_len", "200")


def start_pipeline(s: Sweep, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([FREESCALE, "pipeline", "--config", str(s.path("pipeline.toml")), *extra], cwd=s.work,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for(s: Sweep, proc: subprocess.Popen, pattern: str, timeout: float = 240) -> None:
    """Until a file matching ``pattern`` exists in the work folder (a job's staging folder)."""
    deadline = time.monotonic() + timeout
    while not list(s.work.glob(pattern)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {pattern} appeared (exit {proc.poll()})")
        time.sleep(0.1)


def sigterm_pipeline_mid_prepare(s: Sweep) -> Outcome:
    """SIGTERM to `freescale pipeline` (the process alone, as a scheduler sends it) once prepare's
    staging folder exists, with no [prepare] section: the default synthetic data."""
    start = time.perf_counter()
    proc = start_pipeline(s)
    wait_for(s, proc, "pipeline/prepared.tmp-*")
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    s.stdout = out
    return Outcome(proc.returncode, err.strip().splitlines(), time.perf_counter() - start)


def stopped_pipeline_ok(s: Sweep, o: Outcome) -> str:
    work = s.path("pipeline")
    record = json.loads((work / "prepare.fingerprint.json").read_text())
    problems = [what for what, bad in (
        ("no line says synthetic data", "uses synthetic data ([prepare] has no input: 20000 users" not in s.stdout),
        (f"the record says {record['status']}", record["status"] != "killed"),
        ("LOCK left", (work / "LOCK").exists()),
        ("staging left", bool(list(s.work.glob("pipeline/*.tmp-*")))),
        ("prepare's run not KILLED", len(runs_of(s, "KILLED", "prepare")) != 1)) if bad]
    return "; ".join(problems)


def kill_pipeline_mid_balance_then_rerun(s: Sweep) -> Outcome:
    """kill -9 of the whole pipeline (process group: the JVM too) once balance's staging folder
    exists; the rerun must finish and end the killed balance's RUNNING run FAILED."""
    shutil.rmtree(s.path("pipeline"), ignore_errors=True)
    before = set(runs_of(s, "RUNNING", "balance"))  # the sweep's store is shared by every case
    proc = start_pipeline(s, *SMALL_PIPELINE)
    wait_for(s, proc, "pipeline/shards.tmp-*")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    s.orphans = [run for run in runs_of(s, "RUNNING", "balance") if run not in before]
    return s.freescale("pipeline", "--config", str(s.path("pipeline.toml")), *SMALL_PIPELINE, timeout=600)


def orphans_failed(s: Sweep, o: Outcome) -> str:
    if len(s.orphans) != 1:
        return f"{len(s.orphans)} RUNNING balance runs after the kill (expected 1)"
    if s.orphans[0] not in runs_of(s, "FAILED", "balance"):
        return "the killed balance's run was not ended FAILED"
    if not any("were still RUNNING: ended FAILED" in line for line in o.stderr):
        return "no note of the ended run"
    return ""


def killed_run_ended(s: Sweep, o: Outcome) -> str:
    """The rerun of a balance killed with -9 ends the run the kill left RUNNING, and says so."""
    if len(s.orphans) != 1:
        return f"{len(s.orphans)} RUNNING balance runs after the kill (expected 1)"
    if s.orphans[0] not in runs_of(s, "FAILED", "balance"):
        return "the killed balance's run was not ended FAILED"
    if not any(f"ended FAILED ({s.orphans[0]})" in line for line in o.stderr):
        return "no note of the ended run"
    return ""


def half_written_checkpoint_resume(s: Sweep) -> Outcome:
    """A training saved steps 2 and 4; a folder step_6 without COMPLETE (a save cut short) sits
    beside them. The resume must continue from step 4 and name step_6 as skipped in one line."""
    folder = s.path("half-ckpt")
    first = train(s, s.path("shards"), "--checkpoint.folder", str(folder), "--checkpoint.every_steps", "2")
    if first.code:
        return first
    (folder / "step_6").mkdir()
    (folder / "step_6" / "CONFIG").write_text("{}\n")  # begun, never finished
    return train(s, s.path("shards"), "--checkpoint.folder", str(folder), "--checkpoint.every_steps", "2",
                 "--max-steps", "8")


RDZV_TIMEOUT_S = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lone_node_0(s: Sweep) -> Outcome:
    """Node 0 of a 2-node training whose node 1 never starts: it must give up at --rdzv-timeout."""
    s.endpoint = f"127.0.0.1:{free_port()}"
    return s.freescale("train", "--shards", str(s.path("shards")), "--nnodes", "2", "--node-rank", "0",
                       "--rdzv-endpoint", s.endpoint, "--rdzv-timeout", str(RDZV_TIMEOUT_S),
                       timeout=RDZV_TIMEOUT_S + 60)


def gave_up_naming_the_endpoint(s: Sweep, o: Outcome) -> str:
    if not any(line.startswith(f"freescale train: waiting for 2 nodes at {s.endpoint}") for line in o.stderr):
        return "no waiting line"
    wanted = f"rendezvous at {s.endpoint} timed out after {RDZV_TIMEOUT_S} s: 1 of 2 nodes joined"
    if wanted not in o.stderr[-1]:
        return f"last line: {o.stderr[-1]}"
    return within(RDZV_TIMEOUT_S + 30)(s, o)


def tampered_rank_file_resume(s: Sweep) -> Outcome:
    """A training saved step 4; its rank_0.pt is then replaced by a pickle whose __reduce__ creates a
    marker file when unpickled. The resume must refuse the file in one line naming it, exit 2, and
    the payload must never run."""
    folder, marker = s.path("tampered-ckpt"), s.path("tampered-payload-ran")
    first = train(s, s.path("shards"), "--checkpoint.folder", str(folder))
    if first.code:
        return first
    payload = ("import sys, torch\n"
               "class Payload:\n"
               "    def __reduce__(self):\n"
               "        return open, (sys.argv[2], 'w')\n"
               "torch.save({'trainer': Payload()}, sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", payload, str(folder / "step_4" / "rank_0.pt"), str(marker)], check=True,
                   env=ENV)
    return train(s, s.path("shards"), "--checkpoint.folder", str(folder), "--max-steps", "6")


def payload_never_ran(s: Sweep, o: Outcome) -> str:
    if s.path("tampered-payload-ran").exists():
        return "the payload ran"
    return one_line_naming("step_4/rank_0.pt names")(s, o)


def one_line_naming(fragment: str) -> Callable[[Sweep, Outcome], str]:
    def check(s: Sweep, o: Outcome) -> str:
        lines = [line for line in o.stderr if fragment in line]
        return "" if len(lines) == 1 else f"{len(lines)} stderr lines name {fragment!r}"
    return check


def within(seconds: float) -> Callable[[Sweep, Outcome], str]:
    return lambda s, o: "" if o.seconds < seconds else f"took {o.seconds:.1f} s (target {seconds:g} s)"


def manifest_ok(s: Sweep, out: Path, world_size: int = 2) -> str:
    from freescale.shards.manifest import ShardError, load_manifest

    try:
        load_manifest(out, world_size)
    except ShardError as exc:
        return str(exc)
    return ""


def prepared_meta(s: Sweep, name: str) -> dict:
    return json.loads((s.path(name) / "prepare.json").read_text())


# ---------------------------------------------------------- issue 23: stops mid-action, cluster, storage

# SIGTERMs spread across one prepare stage, from the JVM's start to its last writes: timed from the
# stage's "prepare: running" line, as fractions of how long the stage ran uninterrupted.
PREPARE_STOP_FRACTIONS = [round(0.03 + 0.095 * i, 3) for i in range(10)]


def read_until(proc: subprocess.Popen, pattern: str) -> list[str]:
    """The lines `proc` printed up to the first that matches `pattern` (all of them if none does)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if re.match(pattern, line):
            break
    return seen


PREPARE_RUNNING = r"freescale pipeline: prepare: running"
NEXT_STAGE_RUNNING = r"freescale pipeline: (?!prepare)\w+: running"


def prepare_stage_seconds(s: Sweep) -> float:
    """How long the pipeline's prepare stage (its synthetic default: 20,000 users) runs uninterrupted,
    measured once per sweep in a workdir of its own: from its "prepare: running" line to the next
    stage's, when that pipeline is stopped."""
    if s.prepare_stage_s is None:
        toml = s.path("pipeline-timed.toml")
        toml.write_text(s.path("pipeline.toml").read_text().replace(str(s.path("pipeline")),
                                                                    str(s.path("pipeline-timed"))))
        proc = subprocess.Popen([FREESCALE, "pipeline", "--config", str(toml)], cwd=s.work, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        read_until(proc, PREPARE_RUNNING)
        start = time.perf_counter()
        seen = read_until(proc, NEXT_STAGE_RUNNING)
        s.prepare_stage_s = time.perf_counter() - start
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=180)
        assert seen and re.match(NEXT_STAGE_RUNNING, seen[-1]), seen[-3:]
    return s.prepare_stage_s


def sigterm_pipeline_into_prepare(fraction: float) -> Callable[[Sweep], Outcome]:
    """SIGTERM to `freescale pipeline` (the process alone, as a scheduler sends it) `fraction` of the way
    through its prepare stage: wherever it lands (Spark starting, a Spark action, the driver between
    actions, the staging writes) the run must end as stopped."""
    def run(s: Sweep) -> Outcome:
        delay = fraction * prepare_stage_seconds(s)
        s.killed_before = len(runs_of(s, "KILLED", "prepare"))
        s.failed_before = len(runs_of(s, "FAILED", "prepare"))
        start = time.perf_counter()
        proc = start_pipeline(s, "--fresh")  # prepare runs even when a stop came too late for it last time
        seen = read_until(proc, PREPARE_RUNNING)
        if not seen or not re.match(PREPARE_RUNNING, seen[-1]):
            proc.communicate(timeout=600)
            return Outcome(proc.returncode, ["prepare did not run"], time.perf_counter() - start)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
        s.stdout = "".join(seen) + out
        return Outcome(proc.returncode, err.strip().splitlines(), time.perf_counter() - start)
    return run


def stopped_in_prepare_ok(s: Sweep, o: Outcome) -> str:
    """stopped_pipeline_ok's checks for one more stop of the same workdir: the line names prepare, one
    more prepare run ended KILLED, none FAILED; the output is absent, or whole when the stop came
    after it was renamed into place (the record says killed all the same: a rerun redoes it)."""
    work = s.path("pipeline")
    record = json.loads((work / "prepare.fingerprint.json").read_text())
    prepared = work / "prepared"
    problems = [what for what, bad in (
        ("prepared left, not whole", prepared.exists() and not ((prepared / "sequences").is_dir()
                                                               and (prepared / "prepare.json").is_file())),
        ("the line does not name stage prepare", "stopped by signal 15 in stage prepare" not in o.stderr[-1]),
        ("no line says synthetic data", "uses synthetic data ([prepare] has no input: 20000 users" not in s.stdout),
        (f"the record says {record['status']}", record["status"] != "killed"),
        ("LOCK left", (work / "LOCK").exists()),
        ("staging left", bool(list(s.work.glob("pipeline/*.tmp-*")))),
        ("prepare's run not KILLED", len(runs_of(s, "KILLED", "prepare")) != s.killed_before + 1),
        ("a prepare run ended FAILED", len(runs_of(s, "FAILED", "prepare")) != s.failed_before)) if bad]
    return "; ".join(problems)


# What spark-submit prints before the job's Python starts, whatever the job does: the JVM's note on
# its incubator modules, Spark's note on its default log4j profile (again when the SparkContext
# starts) and the host name's loopback warning. A spark-submit case counts the other lines.
LAUNCHER_LINES = ("WARNING: Using incubator modules", "Using Spark's default log4j profile",
                  "resolves to a loopback address", "Set SPARK_LOCAL_IP if you need")


def spark_submit(s: Sweep, script: str, *args: str, master: str = "local[2]", timeout: float = 300) -> Outcome:
    """`spark-submit --master MASTER jobs/SCRIPT ARGS` with the venv's spark-submit (pyspark's own Spark).
    spark-submit's Python runner sends the job's stderr to stdout, the JVM's log goes to stderr: the
    Outcome's lines are the JVM's, then the job's (its last line last), less LAUNCHER_LINES."""
    submit = str(Path(sys.executable).parent / "spark-submit")
    env = {**ENV, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    start = time.perf_counter()
    done = subprocess.run([submit, "--master", master, str(REPO / "freescale" / "jobs" / script), *args, "--tracking-uri",
                           s.tracking], cwd=s.work, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stderr.splitlines() + done.stdout.splitlines()
             if line.strip() and not any(marker in line for marker in LAUNCHER_LINES)]
    return Outcome(done.returncode, lines, time.perf_counter() - start)


def quiet_spark_submit(s: Sweep, o: Outcome) -> str:
    """Spark says nothing once its SparkContext runs (spark.log.level): the few lines it prints while
    starting, its note of the setting, then only the job's own lines."""
    setting = [i for i, line in enumerate(o.stderr) if line.startswith("Setting Spark log level")]
    if not setting:
        return "no spark.log.level note: Spark's own level"
    spark = [line for line in o.stderr[setting[0] + 1:] if not line.startswith("freescale ")]
    if spark:
        return f"{len(spark)} Spark lines after its start, e.g. {spark[0][:80]}"
    return "" if len(o.stderr) <= 8 else f"{len(o.stderr)} lines"


FULL_DISK_SIZE = "128k"  # far less than the sweep's shards


def full_disk_balance(s: Sweep) -> Outcome:
    """balance --output on a tmpfs of FULL_DISK_SIZE, mounted for the case (needs root: otherwise the
    case says so and misses). What the job left on that disk is kept for the check: the disk goes away
    with the case."""
    disk = s.path("full-disk")
    disk.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FULL_DISK_SIZE}", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:
        return Outcome(1, [f"no tmpfs for the case: {mounted.stderr.strip()}"], 0.0)
    try:
        outcome = s.freescale("balance", "--input", str(s.path("prepared")), "--output", str(disk / "shards"),
                              "--world-size", "2", "--local-batch-size", "8")
        s.left_on_disk = sorted(p.name for p in disk.iterdir())
        return outcome
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def disk_full_named(s: Sweep, o: Outcome) -> str:
    if s.left_on_disk:
        return f"left {s.left_on_disk} on the full disk"
    if "the disk is full" not in o.stderr[-1] or str(s.path("full-disk") / "shards") not in o.stderr[-1]:
        return "the line does not say the disk under the output is full"
    return "" if o.code == 3 else f"exit {o.code}, not 3"


NO_MASTER = "spark://127.0.0.1:1"  # a port nothing listens on

ISSUE_23_CASES = [
    *[Case(f"pipeline without [prepare], SIGTERM {fraction:.3f} into prepare", "stopped",
           sigterm_pipeline_into_prepare(fraction), check=stopped_in_prepare_ok)
      for fraction in PREPARE_STOP_FRACTIONS],
    Case("prepare --master spark://127.0.0.1:1 (no master there)", "fail",
         lambda s: s.freescale("prepare", "--master", NO_MASTER, "--output", str(s.path("nomaster-out")),
                               "--synthetic-users", "100"),
         output=lambda s: s.path("nomaster-out"),
         check=lambda s, o: within(10)(s, o) or one_line_naming(NO_MASTER)(s, o)),
    Case("spark-submit --master spark://127.0.0.1:1 freescale/jobs/prepare.py (no master there)", "fail",
         lambda s: spark_submit(s, "prepare.py", "--output", str(s.path("nomaster-submit")), "--synthetic-users",
                                "100", master=NO_MASTER),
         output=lambda s: s.path("nomaster-submit"),
         check=lambda s, o: within(30)(s, o) or one_line_naming(NO_MASTER)(s, o)),
    Case("balance --input s3a://bucket/prep without hadoop-aws", "fail",
         lambda s: s.freescale("balance", "--input", "s3a://bucket/prep", "--output", str(s.path("s3a-out")),
                               "--world-size", "2", "--local-batch-size", "8"),
         output=lambda s: s.path("s3a-out"),
         check=lambda s, o: "" if o.code == 3 and all(w in o.stderr[-1] for w in (
             "s3a://", "org.apache.hadoop:hadoop-aws:", "spark-submit --packages")) else "scheme, package or flag not named"),
    Case("balance --output on a full disk (tmpfs)", "fail", full_disk_balance,
         output=lambda s: s.path("full-disk/shards"), check=disk_full_named),
    Case("spark-submit freescale/jobs/prepare.py on local Spark, quiet", "ok",
         lambda s: spark_submit(s, "prepare.py", "--output", str(s.path("submit-prep")), "--synthetic-users", "400",
                                "--synthetic-items", "200", "--max-seq-len", "200"),
         output=lambda s: s.path("submit-prep"), check=quiet_spark_submit),
    Case("spark-submit freescale/jobs/balance.py on local Spark, quiet", "ok",
         lambda s: spark_submit(s, "balance.py", "--input", str(s.path("prepared")), "--output",
                                str(s.path("submit-shards")), "--world-size", "2", "--local-batch-size", "8"),
         output=lambda s: s.path("submit-shards"),
         check=lambda s, o: quiet_spark_submit(s, o) or manifest_ok(s, s.path("submit-shards"))),
]


CASES = [
    # 1. data loss: the output is the input folder
    Case("prepare --output = its --input folder, --overwrite", "fail",
         lambda s: s.freescale("prepare", "--input", str(s.path("raw")), "--output", str(s.path("raw")), "--overwrite"),
         guarded=[Path("raw")]),
    Case("prepare --output inside its --input folder", "fail",
         lambda s: s.freescale("prepare", "--input", str(s.path("raw")), "--output", str(s.path("raw/out"))),
         output=lambda s: s.path("raw/out"), guarded=[Path("raw")]),
    Case("balance --output = its --input", "fail",
         lambda s: s.freescale("balance", "--input", str(s.path("prepared")), "--output", str(s.path("prepared")),
                               "--world-size", "2", "--local-batch-size", "8", "--overwrite"),
         guarded=[Path("prepared")]),
    # 2. paths that need quoting
    *[Case(f"balance --output with {what}", "ok",
           lambda s, d=name: s.freescale("balance", "--input", str(s.path("prepared")), "--output", str(s.path(d)),
                                         "--world-size", "2", "--local-batch-size", "8"),
           output=lambda s, d=name: s.path(d), check=lambda s, o, d=name: manifest_ok(s, s.path(d)))
      for what, name in (("a space", "with space"), ("a non-ASCII character", "shards-ä"),
                         ("a percent sign", "shards-100%"))],
    # 3. duplicate interactions
    Case("prepare, 40,000 duplicated interactions", "ok",
         lambda s: s.freescale("prepare", "--input", str(s.path("duplicated.parquet")), "--output",
                               str(s.path("dedup"))),
         output=lambda s: s.path("dedup"),
         check=lambda s, o: "" if prepared_meta(s, "dedup").get("duplicates_dropped") == 40_000
         else f"duplicates_dropped = {prepared_meta(s, 'dedup').get('duplicates_dropped')}"),
    # 4. tracking unreachable
    Case("balance, MLflow unreachable", "ok",
         lambda s: s.freescale("balance", "--input", str(s.path("prepared")), "--output", str(s.path("untracked")),
                               "--world-size", "2", "--local-batch-size", "8", "--tracking-uri", UNREACHABLE),
         output=lambda s: s.path("untracked"),
         check=lambda s, o: "" if o.seconds < 90 else f"took {o.seconds:.0f} s"),
    Case("train, MLflow unreachable", "ok",
         lambda s: train(s, s.path("shards"), "--tracking-uri", UNREACHABLE),
         check=lambda s, o: "" if o.seconds < 120 else f"took {o.seconds:.0f} s"),
    # 5. checkpoints
    Case("train, checkpoint folder locked by a live job", "fail",
         lambda s: (s.path("locked").mkdir(exist_ok=True),
                    # the sweep's own live process holds the lock, as a running job would
                    (s.path("locked") / "LOCK").write_text(json.dumps({"pid": os.getpid(),
                                                                        "host": socket.gethostname()})),
                    train(s, s.path("shards"), "--checkpoint.folder", str(s.path("locked"))))[-1]),
    Case("train resumed with another embedding_dim", "fail",
         lambda s: (train(s, s.path("shards"), "--checkpoint.folder", str(s.path("ckpt"))),
                    train(s, s.path("shards"), "--checkpoint.folder", str(s.path("ckpt")),
                          "--max-steps", "6", "--model.hstu.embedding_dim", "48"))[-1]),  # demo.toml has 32
    # 6. silent values
    Case("train --max-steps 0", "fail", lambda s: s.freescale("train", "--shards", str(s.path("shards")),
                                                              "--max-steps", "0")),
    Case("train --max-steps -3", "fail", lambda s: s.freescale("train", "--shards", str(s.path("shards")),
                                                               "--max-steps", "-3")),
    Case("balance, all-zero cost model", "fail",
         lambda s: s.freescale("balance", "--input", str(s.path("prepared")), "--output", str(s.path("zero-out")),
                               "--world-size", "2", "--local-batch-size", "8",
                               "--cost-model", str(s.path("zero_cost.json"))),
         output=lambda s: s.path("zero-out")),
    Case("balance --world-size 5000 --leftover keep", "fail",
         lambda s: s.freescale("balance", "--input", str(s.path("prepared")), "--output", str(s.path("wide")),
                               "--world-size", "5000", "--local-batch-size", "1", "--leftover", "keep"),
         output=lambda s: s.path("wide")),
    Case("train, manifest local_batch_size edited", "fail",
         lambda s: train(s, copy_shards(s, "edited-batch", lambda m: m.update(local_batch_size=9)))),
    Case("train, manifest file sha256 edited", "fail",
         lambda s: train(s, copy_shards(s, "edited-sha", lambda m: m["ranks"][0]["files"][0].update(sha256="0" * 64)))),
    # 7. errors that used to be buried
    Case("train, no manifest", "fail",
         lambda s: train(s, (lambda d: ((d / "manifest.json").unlink(), d)[1])(copy_shards(s, "no-manifest")))),
    Case("balance --input: a folder that is not a prepared dataset", "fail",
         lambda s: s.freescale("balance", "--input", str(s.path("not-prepared")), "--output", str(s.path("np-out")),
                               "--world-size", "2", "--local-batch-size", "8"),
         output=lambda s: s.path("np-out")),
    Case("balance, infeasible --token-cap", "fail",
         lambda s: s.freescale("balance", "--input", str(s.path("prepared")), "--output", str(s.path("capped")),
                               "--world-size", "2", "--local-batch-size", "32", "--equal-counts",
                               "--token-cap", "201"),
         output=lambda s: s.path("capped")),
    Case("train --comm.backend nccl on a CPU machine", "fail",
         lambda s: train(s, s.path("shards"), "--comm.backend", "nccl")),
    # 8. fast failure
    Case("prepare, missing input file", "fail",
         lambda s: s.freescale("prepare", "--input", str(s.path("absent.parquet")), "--output", str(s.path("p-out"))),
         output=lambda s: s.path("p-out"),
         check=lambda s, o: ""),
    # 9. kill -9, then rerun
    Case("balance killed with -9, then rerun", "ok", kill_balance_then_rerun,
         output=lambda s: s.path("killed-shards"),
         check=lambda s, o: manifest_ok(s, s.path("killed-shards")) or killed_run_ended(s, o)),
    Case("training killed with -9 at random steps (5 times), each resumed", "ok", kill_training_soak),
    # 10. issue 17: tracking on a store that cannot be written
    Case("simulate, read-only sqlite store", "ok",
         lambda s: s.freescale("simulate", "--lengths", "lognormal:4.2,0.9", "--world-sizes", "8",
                               "--tracking-uri", READ_ONLY),
         check=lambda s, o: within(10)(s, o) or (
             "" if len(o.stderr) == 1 and "cannot be written" in o.stderr[0] else f"{len(o.stderr)} stderr lines")),
    Case("train, read-only sqlite store", "ok",
         lambda s: train(s, s.path("shards"), "--tracking-uri", READ_ONLY),
         check=lambda s, o: within(60)(s, o) or one_line_naming("cannot be written")(s, o) or (
             "" if not any("SQLAlchemy" in line for line in o.stderr) else "SQLAlchemy warnings")),
    # 11. issue 17: compare's shard sets
    Case("compare --shards, the same folder as contiguous and balanced", "fail",
         lambda s: s.freescale("compare", "--shards", f"contiguous={s.path('shards')},balanced={s.path('shards')}",
                               "--workdir", str(s.path("cmp-same"))),
         output=lambda s: s.path("cmp-same"), check=within(5)),
    Case("compare --shards, a kk set labelled contiguous", "fail",
         lambda s: s.freescale("compare", "--shards", f"contiguous={s.path('shards')},balanced="
                               f"{copy_shards(s, 'shards-lpt', lambda m: m.update(strategy='lpt'), reseal=True)}",
                               "--workdir", str(s.path("cmp-label"))),
         output=lambda s: s.path("cmp-label"), check=within(5)),
    # 12. issue 17: the pipeline's synthetic default, a stop signal and kill -9
    Case("pipeline without [prepare], SIGTERM mid-prepare", "stopped", sigterm_pipeline_mid_prepare,
         output=lambda s: s.path("pipeline/prepared"), check=stopped_pipeline_ok),
    Case("pipeline killed with -9 mid-balance, then rerun", "ok", kill_pipeline_mid_balance_then_rerun,
         output=lambda s: s.path("pipeline/train_summary.json"), check=orphans_failed),
    # 13. issue 17: simulate's memory bound
    Case("simulate --world-sizes 10000000", "fail",
         lambda s: s.freescale("simulate", "--lengths", "lognormal:4.2,0.9", "--world-sizes", "10000000",
                               "--json", str(s.path("sim-huge.json"))),
         output=lambda s: s.path("sim-huge.json"), check=lambda s, o: within(5)(s, o) or (
             "" if "K=10000000" in o.stderr[-1] and "GiB" in o.stderr[-1] else "K or the memory not named")),
    # 14. issue 17: prepare's inputs
    Case("prepare, a folder whose files spell the item column two ways", "fail",
         lambda s: s.freescale("prepare", "--input", str(s.path("spelt-two-ways")), "--output", str(s.path("sp-out"))),
         output=lambda s: s.path("sp-out"), check=lambda s, o: within(5)(s, o) or (
             "" if all(w in o.stderr[-1] for w in ("part-0.parquet", "part-1.parquet", "'movie_id'", "'item'"))
             else "the files or spellings not named")),
    Case("prepare, gzip CSV (ratings.csv.gz)", "ok",
         lambda s: s.freescale("prepare", "--input", str(s.path("ratings.csv.gz")), "--output", str(s.path("gz-out"))),
         output=lambda s: s.path("gz-out"),
         check=lambda s, o: "" if prepared_meta(s, "gz-out").get("input_interactions") == 100_000
         else f"input_interactions = {prepared_meta(s, 'gz-out').get('input_interactions')}"),
    Case("prepare, truncated gzip CSV", "fail",
         lambda s: s.freescale("prepare", "--input", str(s.path("trunc.csv.gz")), "--output", str(s.path("tr-out"))),
         output=lambda s: s.path("tr-out"), check=within(5)),
    *[Case(f"prepare, {what} CSV", "fail",
           lambda s, f=file: s.freescale("prepare", "--input", str(s.path(f)), "--output", str(s.path(f"{f}-out"))),
           output=lambda s, f=file: s.path(f"{f}-out"), check=within(5))
      for what, file in (("an empty", "empty.csv"), ("a header-only", "header-only.csv"),
                         ("a wrong-columns", "wrong-columns.csv"))],
    # 15. fixed by others for issue 17 (freescale/jobs/launch.py; freescale/training/checkpoint/resume.py, freescale/training/checkpoint/checkpointer.py)
    Case("train --shards /nonexistent", "fail", lambda s: s.freescale("train", "--shards", "/nonexistent"),
         check=within(1)),
    Case("train resumed beside a half-written checkpoint folder", "ok", half_written_checkpoint_resume,
         check=one_line_naming("step_6")),
    # 16. issue 23's holes
    Case("train --nnodes 2, node 1 never started", "fail", lone_node_0, check=gave_up_naming_the_endpoint),
    Case("train resumed from a tampered rank_0.pt", "fail", tampered_rank_file_resume, check=payload_never_ran),
    Case("train, attention_kernel triton on a CPU machine", "fail",
         lambda s: train(s, s.path("shards"), "--model.hstu.attention_kernel", "triton"),
         check=lambda s, o: within(2)(s, o) or one_line_naming("attention_kernel = 'triton' cannot run")(s, o)),
    *ISSUE_23_CASES,
]


# A multi-node training's notes before its last line (waiting for the nodes, all joined) are not errors.
NOTE = re.compile(r"freescale train: (waiting for \d+ nodes at |all \d+ nodes joined at )")


def judge(s: Sweep, case: Case, outcome: Outcome, intact: bool) -> str:
    """'' when the case met its target, else why not."""
    if not intact:
        return "input changed"
    if case.expect == "ok":
        if outcome.code != 0:
            return f"exit {outcome.code}: {outcome.stderr[-1] if outcome.stderr else ''}"
        return case.check(s, outcome)
    if outcome.code not in ((128 + signal.SIGTERM,) if case.expect == "stopped" else (2, 3)):
        return f"exit {outcome.code}"
    lines = [line for line in outcome.stderr if not NOTE.match(line)]
    if len(lines) != 1 or ": error: " not in lines[-1]:
        return f"{len(lines)} stderr lines"
    out = case.output(s)
    if out is not None and out.exists():
        return f"left {out.name}"
    return case.check(s, outcome)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=str(REPO / "out" / "fault-sweep"))
    parser.add_argument("--only", nargs="*", help="run only cases whose name contains one of these words")
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sweep = Sweep(work)
    started = time.perf_counter()
    setup(sweep)
    rows, misses = [], 0
    for case in CASES:
        if args.only and not any(w in case.name for w in args.only):
            continue
        before = {p: digest(work / p) for p in case.guarded}
        outcome = case.run(sweep)
        intact = all(digest(work / p) == d for p, d in before.items())
        verdict = judge(sweep, case, outcome, intact)
        misses += bool(verdict)
        out = case.output(sweep)
        rows.append((case.name, case.expect, outcome.code, len(outcome.stderr), f"{outcome.seconds:.1f}",
                     "yes" if out is not None and out.exists() else "no", "yes" if intact else "NO",
                     verdict or "met", outcome.stderr[-1] if outcome.stderr else ""))
        print(f"{case.name}: exit {outcome.code}, {verdict or 'met'}", file=sys.stderr, flush=True)
    left, running = leftovers(sweep), running_runs(sweep)
    print("| case | expected | exit | stderr lines | seconds | output left | data intact | target | last stderr line |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        last = row[-1].replace("|", "\\|")
        last = last if len(last) <= 110 else last[:107] + "..."
        print("| " + " | ".join(str(x) for x in row[:-1]) + f" | {last} |")
    print(f"\n{len(rows)} cases, {len(rows) - misses} met their target; temporary folders left: "
          f"{len(left)}{' ' + str(left) if left else ''}; MLflow runs left RUNNING: {running}; "
          f"total {time.perf_counter() - started:.0f} s")
    return 1 if misses or left or running else 0


if __name__ == "__main__":
    sys.exit(main())
