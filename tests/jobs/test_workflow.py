"""`freescale pipeline`: a rerun skips what is current, reruns what changed or is damaged and what is
downstream of it, refuses a second run on one working directory, resumes a killed training from its
checkpoints, and refuses a bad config in one line.

One small pipeline (300 synthetic users, 1 rank x 8 samples, a tiny model, 6 steps) runs once per
module; each test works on its own copy of that working directory. Its trainings start their one
rank without torchrun (tests/helpers.py, one_rank_without_torchrun): the launcher's torchrun path is
test_train's and test_failures'."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from freescale.jobs.workflow import run as workflow
from freescale.jobs.workflow import stages, table
from freescale.jobs.workflow.config import WorkflowConfig, override_argv
from freescale.runtime import logs
from tests.helpers import one_rank_without_torchrun, sqlite_store

REPO = Path(__file__).resolve().parents[2]
SUMMARY_LINE = re.compile(r"^freescale pipeline: (\S+) +(ran|skipped|failed|off|not run) +\((.*)\)$", re.M)

TRAIN_TOML = """
[model.hstu]
embedding_dim = 16
num_layers = 1
num_heads = 1
attention_dim = 8
linear_dim = 8
max_seq_len = 64
[loss]
num_negatives = 16
[training]
max_steps = 6
log_every = 2
eval_max_samples = 50
[checkpoint]
every_steps = 3
"""

PIPELINE_TOML = """
[pipeline]
workdir = "{workdir}"
tracking_uri = "none"
world_size = 1
local_batch_size = 8
[prepare]
synthetic_users = 300
synthetic_items = 200
max_seq_len = 64
[balance]
window_steps = 4
[export]
enabled = true
[recommend]
enabled = true
k = 5
[train]
config = "{train}"
"""


def write_config(folder: Path, workdir: Path, extra: str = "") -> Path:
    train = folder / "train.toml"
    if not train.exists():
        train.write_text(TRAIN_TOML)
    path = folder / f"pipeline-{workdir.name}.toml"
    path.write_text(PIPELINE_TOML.format(workdir=workdir, train=train) + extra)
    return path


def run(config: Path, *extra: str) -> int:
    from freescale.jobs import cli

    return cli.main(["pipeline", "--config", str(config), *extra])


def statuses(output: str) -> dict[str, tuple[str, str]]:
    """stage -> (status, why) from the summary lines after ``summary of``."""
    summary = output.split("freescale pipeline: summary of", 1)[1]
    return {m.group(1): (m.group(2), m.group(3)) for m in SUMMARY_LINE.finditer(summary)}


@pytest.fixture(scope="module")
def first_run(spark, tmp_path_factory):
    """The pipeline's first run; returns its folder (config, train.toml, work/) and its output."""
    folder = tmp_path_factory.mktemp("workflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(logs.LOG_DIR_ENV, str(folder / "logs"))
        one_rank_without_torchrun(mp)
        config = write_config(folder, folder / "work")
        import io
        from contextlib import redirect_stdout

        out = io.StringIO()
        with redirect_stdout(out):
            rc = run(config)
    assert rc == 0, out.getvalue()
    return folder, out.getvalue()


@pytest.fixture
def copy(first_run, tmp_path, monkeypatch):
    """A copy of the first run's working directory and a config pointing at it."""
    folder, _ = first_run
    monkeypatch.setenv(logs.LOG_DIR_ENV, str(tmp_path / "logs"))
    one_rank_without_torchrun(monkeypatch)
    work = tmp_path / "work"
    shutil.copytree(folder / "work", work)
    shutil.copy2(folder / "train.toml", tmp_path / "train.toml")  # the same modification time: the same identity
    return work, write_config(tmp_path, work)


@pytest.mark.slow
def test_first_run_runs_every_stage_and_a_rerun_skips_them(first_run, copy, capsys):
    _, output = first_run
    assert statuses(output) == {"prepare": ("ran", "no earlier run"),
                                "calibrate": ("off", "[calibrate] enabled = false; balance uses the built-in cost model"),
                                "balance": ("ran", "upstream prepare ran"), "train": ("ran", "upstream balance ran"),
                                "compare": ("off", "[compare] enabled = false"),
                                "export": ("ran", "upstream train ran"),
                                "promote": ("off", "[pipeline] incremental = false"),
                                "recommend": ("ran", "upstream prepare, export ran")}
    # a scheduled run ends with every prepared user's recommendations, from the exported model
    import pyarrow.parquet as pq

    folder, _ = first_run
    top = pq.read_table(folder / "work" / "recommendations").to_pydict()
    users = pq.read_table(folder / "work" / "prepared" / "sequences", columns=["user_id"]).num_rows
    assert len(top["user_id"]) == users > 0 and {len(items) for items in top["items"]} == {5}
    work, config = copy
    record = json.loads((work / "balance.fingerprint.json").read_text())
    assert record["status"] == "done" and record["params"]["window_steps"] == 4
    assert run(config) == 0
    seen = statuses(capsys.readouterr().out)
    assert json.loads((work / "model" / "model.json").read_text())  # the model, exported at the end
    for stage in ("prepare", "balance", "train", "export", "recommend"):
        assert seen[stage][0] == "skipped", seen
        assert seen[stage][1].startswith("fingerprint matches ")


@pytest.mark.slow
def test_a_changed_balance_parameter_reruns_balance_and_train_not_prepare(copy, capsys):
    work, config = copy
    assert (work / "checkpoints").is_dir()
    assert run(config, "--balance.window_steps", "2") == 0
    seen = statuses(capsys.readouterr().out)
    assert seen["prepare"][0] == "skipped"
    assert seen["balance"] == ("ran", "parameters changed: window_steps 4 -> 2")
    # A checkpoint of the old shards must not continue in the new ones.
    assert seen["train"] == ("ran", "upstream balance ran; old checkpoints removed")
    assert json.loads((work / "shards" / "manifest.json").read_text())["window_steps"] == 2
    summary = json.loads((work / "train_summary.json").read_text())
    assert summary["steps"][0] == 0  # trained from the start


@pytest.mark.slow
@pytest.mark.extended
def test_a_deleted_shard_file_reruns_balance_and_train(copy, capsys):
    work, config = copy
    victim = next((work / "shards").glob("rank=0/*.parquet"))
    victim.unlink()
    assert run(config) == 0
    seen = statuses(capsys.readouterr().out)
    assert seen["prepare"][0] == "skipped"
    assert seen["balance"][0] == "ran"
    assert seen["balance"][1].startswith("output damaged: shard file ") and "is missing" in seen["balance"][1]
    assert seen["train"][0] == "ran"
    assert victim.parent.is_dir() and any(victim.parent.glob("*.parquet"))


@pytest.fixture
def failing(tmp_path, monkeypatch):
    """A working directory and a config whose first stage fails at once (a missing input): enough
    to see what happens around the stages without Spark."""
    monkeypatch.setenv(logs.LOG_DIR_ENV, str(tmp_path / "logs"))
    work, missing = tmp_path / "work", tmp_path / "absent.parquet"
    config = write_config(tmp_path, work)
    config.write_text(config.read_text().replace("[prepare]", f'[prepare]\ninput = "{missing}"'))
    return work, config, missing


def test_a_second_run_on_the_same_workdir_is_refused_in_one_line(failing, other_process, capsys):
    import socket

    work, config, _ = failing
    work.mkdir()
    lock = work / workflow.LOCK
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": other_process, "start": None}))
    assert run(config) == 3
    captured = capsys.readouterr()
    assert captured.out == ""  # no stage looked at
    assert captured.err.strip().splitlines() == [
        f"freescale pipeline: error: workdir {work} is in use by PID {other_process} on {socket.gethostname()} "
        f"(lock {lock}): wait for that run, or use another [pipeline] workdir"]
    assert json.loads(lock.read_text())["pid"] == other_process  # not ours: left alone
    assert sorted(p.name for p in work.iterdir()) == [workflow.LOCK]  # no record written


@pytest.mark.spawns
def test_a_stale_lock_is_taken_over_and_released(failing, capsys):
    import socket

    work, config, _ = failing
    work.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (work / workflow.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "start": None}))
    assert run(config) == 2  # the stages ran (the first one failed, as the config says)
    captured = capsys.readouterr()
    assert f"taking over the stale lock of PID {dead.pid} on {socket.gethostname()}" in captured.err
    assert statuses(captured.out)["prepare"][0] == "failed"
    assert not (work / workflow.LOCK).exists()


PIPELINE_ONE_RANK = """
import sys
from tests.helpers import one_rank_without_torchrun
one_rank_without_torchrun()
from freescale.jobs.cli import main
sys.exit(main(["pipeline", *sys.argv[1:]]))
"""


@pytest.mark.slow
@pytest.mark.extended
def test_a_killed_run_resumes_training_from_its_checkpoint(copy, capsys):
    """Killed (SIGKILL, the whole process group) once the first checkpoint of a longer training is
    complete; the rerun skips prepare and balance and continues the training after that step."""
    work, config = copy
    longer = ["--train.overrides.training.max_steps", "40", "--train.overrides.checkpoint.every_steps", "4"]
    shutil.rmtree(work / "checkpoints")  # the first run's: wait for this run's own
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-c", PIPELINE_ONE_RANK, "--config", str(config), *longer],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while not list((work / "checkpoints").glob("step_*/COMPLETE")):
            assert proc.poll() is None, proc.stdout.read()
            if time.monotonic() > deadline:  # a hang guard, not a speed check
                pytest.fail("the pipeline wrote no checkpoint within 240 s")
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0]
    assert "train: running (parameters changed: training.max_steps" in output
    assert json.loads((work / "train.fingerprint.json").read_text())["status"] == "running"
    saved = max(int(p.parent.name.split("_")[1]) for p in (work / "checkpoints").glob("step_*/COMPLETE"))

    assert run(config, *longer) == 0
    seen = statuses(capsys.readouterr().out)
    assert seen["prepare"][0] == seen["balance"][0] == "skipped"
    assert seen["train"] == ("ran", "the last run stopped before finishing; resuming from its checkpoints")
    summary = json.loads((work / "train_summary.json").read_text())
    assert summary["steps"][0] == saved and summary["steps"][-1] == 39  # continued, not restarted


def test_a_bad_config_key_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(logs.LOG_DIR_ENV, str(tmp_path / "logs"))
    work = tmp_path / "work"
    config = write_config(tmp_path, work, extra="window = 3\n")  # lands in [train]
    assert run(config) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"freescale pipeline: error: {config}: unknown key 'train.window' "
                                               "(known: config, max_steps, overrides, run_name)")
    assert not work.exists()
    config.write_text(config.read_text().replace("window = 3", ""))
    assert run(config, "--balance.strategy", "greedy") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("freescale pipeline: error: command line: balance.strategy must be one of ")
    assert "'greedy'" in err and "\n" not in err


def test_a_failing_stage_stops_the_pipeline_with_its_own_status_and_line(failing, capsys):
    work, config, missing = failing
    assert run(config) == 2
    captured = capsys.readouterr()
    seen = statuses(captured.out)
    assert seen["prepare"] == ("failed", f"exit 2: {missing}: path does not exist")
    assert seen["balance"] == ("not run", "prepare failed") and seen["train"] == ("not run", "prepare failed")
    assert captured.err.strip().splitlines()[-1].startswith(
        f"freescale pipeline: error: stage prepare failed (exit 2: {missing}: path does not exist)")
    assert not (work / workflow.LOCK).exists()
    assert json.loads((work / "prepare.fingerprint.json").read_text())["status"] == "running"


def test_every_stage_calls_its_job_with_its_own_arguments(tmp_path):
    """What the pipeline hands each job is the job's own: its values make the job's spec; compare and
    calibrate are too slow to run here."""
    from freescale.jobs import compare
    from freescale.jobs.launch import LaunchSpec
    from freescale.runtime import options
    from freescale.prepare.prepare_spec import PrepareSpec
    from freescale.shards.balance_spec import BalanceSpec
    from freescale.training.calibration.calibrate_spec import CalibrateSpec

    config = write_config(tmp_path, tmp_path / "work", extra='[train.overrides]\n"model.hstu.num_layers" = 1\n'
                                                              '"training.precision" = "bf16"\n"training.seed" = 3\n')
    text = config.read_text().replace("[balance]", "[calibrate]\nenabled = true\nrank_speeds = true\n[balance]")
    config.write_text(text + "[compare]\nenabled = true\ncontrol = true\n")
    loaded = workflow.load_workflow_config(str(config), ["--export.register", "m"])
    assert [s.name for s in workflow.build_stages(loaded) if s.off is not None] == ["promote"]  # incremental only
    work = table.Workdir(tmp_path / "work")
    prepared = options.from_values(PrepareSpec, table.prepare_values(loaded, work))
    assert (prepared.input, prepared.synthetic_users, prepared.output) == (None, 300, str(work.prepared))
    cal = CalibrateSpec(**table.calibrate_values(loaded, work))  # not checked: rank speeds of world_size 1 are refused
    # calibrate times the trained model (shape, loss, precision); the seed is the training's only.
    overrides = override_argv(table.timed_overrides(loaded, work))
    assert overrides == ["--model.hstu.num_layers", "1", "--training.precision", "bf16"] and cal.rank_speeds_output
    assert (cal.nproc_per_node, cal.repeats, cal.overwrite, cal.config) == (1, 7, True, str(tmp_path / "train.toml"))
    values = table.balance_values(loaded, work)
    assert values["cost_model"] == cal.output and values["capacities"] == f"@{cal.rank_speeds_output}"
    spec = options.from_values(BalanceSpec, {**values, "capacities": None})  # the speeds file is calibrate's to write
    assert (spec.window_steps, spec.token_cap, spec.time_limit, spec.world_size) == (4, None, None, 1)
    trained = options.from_values(LaunchSpec, table.train_values(loaded, work))
    assert (trained.shards, trained.nproc_per_node, trained.max_steps) == (str(work.shards), 1, None)
    overrides = override_argv(table.train_overrides(loaded, work))
    assert overrides[:2] == ["--checkpoint.folder", str(work.checkpoints)] and "--model.hstu.num_layers" in overrides
    compared = options.from_values(compare.CompareSpec, table.compare_values(loaded, work))
    assert compared.control and compared.input == str(work.prepared) and compared.repeats == 1
    assert compared.cost_model == cal.output and compared.balanced == {"strategy": "kk", "window_steps": 4}
    from freescale.training.export.spec import ExportSpec

    exported = options.from_values(ExportSpec, table.export_values(loaded, work))
    assert (exported.checkpoint, exported.output, exported.register) == (str(work.checkpoints), str(work.model), "m")


def test_taste_groups_reach_prepare_and_its_fingerprint(tmp_path):
    """[prepare] synthetic_groups and synthetic_group_share reach the prepare job and its fingerprint (a
    change reruns prepare)."""
    from freescale.runtime import options
    from freescale.prepare.prepare_spec import PrepareSpec

    config = write_config(tmp_path, tmp_path / "work")
    off = workflow.load_workflow_config(str(config), [])
    on = workflow.load_workflow_config(str(config), ["--prepare.synthetic_groups", "10",
                                                     "--prepare.synthetic_group_share", "0.5"])
    params = workflow.build_stages(on)[0].params
    assert (params["synthetic_groups"], params["synthetic_group_share"]) == (10, 0.5)
    assert _fingerprints(on)["prepare"] != _fingerprints(off)["prepare"]
    spec = options.from_values(PrepareSpec, table.prepare_values(on, table.Workdir(tmp_path / "work")))
    assert (spec.synthetic_groups, spec.synthetic_group_share) == (10, 0.5)


# ------------------------------------------------------------------ fingerprints, derived


def _fingerprints(config) -> dict[str, str]:
    return {name: fp for name, (fp, _) in stages.fingerprints(workflow.build_stages(config)).items()}


def _every_stage_on(tmp_path: Path):
    config = write_config(tmp_path, tmp_path / "work", extra='[train.overrides]\n"model.hstu.num_layers" = 1\n')
    config.write_text(config.read_text() + "[calibrate]\nenabled = true\nrank_speeds = true\n"
                                           "[compare]\nenabled = true\n")
    loaded = workflow.load_workflow_config(str(config), ["--pipeline.incremental", "true"])  # promote too
    assert all(stage.off is None for stage in workflow.build_stages(loaded))
    return loaded


def _another(section, key: str):
    """A value of ``key`` other than ``section``'s (any of its type: a fingerprint does not check it)."""
    import typing

    value, hint = getattr(section, key), typing.get_type_hints(type(section))[key]
    if typing.get_origin(hint) is typing.Literal:
        return next(choice for choice in typing.get_args(hint) if choice != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, dict):
        return {**value, "training.seed": 5}
    return value + 1 if isinstance(value, (int, float)) else value + "/other"


def _downstream(name: str) -> set[str]:
    graph = {stage.name: stage.upstream for stage in table.STAGES}
    return {other for other in graph if name in stages.all_upstream(other, graph)}


SECTION_KEYS = [(stage.name, key) for stage in table.STAGES
                for key in (f.name for f in dataclasses.fields(getattr(WorkflowConfig(), stage.section)))
                if key not in ("enabled", "run_name", "cost_model")]  # on/off; MLflow's; see the cost-model test
READ_UPSTREAM = {("train", "config"): {"calibrate"}}
"""The section keys a stage upstream reads too: calibrate times the training config's model."""


@pytest.mark.parametrize("stage, key", SECTION_KEYS)
def test_a_changed_section_key_changes_its_stage_and_downstream_fingerprints(tmp_path, stage, key):
    """Every key of a stage's section reaches its fingerprint and, through it, every downstream one;
    the upstream stages' fingerprints stay (their work is current) unless they read that key too."""
    config = _every_stage_on(tmp_path)
    before = _fingerprints(config)
    section = getattr(config, next(s.section for s in table.STAGES if s.name == stage))
    setattr(section, key, _another(section, key))
    after = _fingerprints(config)
    changed = {name for name in before if before[name] != after[name]}
    graph = {s.name: s.upstream for s in table.STAGES}
    assert {stage} | _downstream(stage) <= changed
    readers, upstream = READ_UPSTREAM.get((stage, key), set()), stages.all_upstream(stage, graph)
    assert changed & upstream == {name for name in upstream if readers & ({name} | stages.all_upstream(name, graph))}


def test_shared_values_and_input_files_reach_the_stages_that_read_them(tmp_path):
    config = _every_stage_on(tmp_path)
    before = _fingerprints(config)
    config.pipeline.local_batch_size = 16
    changed = {n for n in before if before[n] != _fingerprints(config)[n]}
    assert changed == {"balance", "compare"} | _downstream("balance")
    config.train.overrides["training.seed"] = 5  # the training's own: not calibrate's timed model
    changed = {n for n in before if before[n] != _fingerprints(config)[n]}
    assert "calibrate" not in changed and {"train", "compare"} <= changed
    config.train.overrides["model.hstu.num_layers"] = 2  # the timed model
    after = _fingerprints(config)
    assert {n for n in before if before[n] != after[n]} == {"calibrate"} | _downstream("calibrate") | changed
    config.calibrate.enabled = config.calibrate.rank_speeds = False
    config.calibrate.cost_model = str(tmp_path / "cm.json")  # a given cost model: its identity, too
    (tmp_path / "cm.json").write_text("{}")
    given = _fingerprints(config)
    assert "calibrate" not in given and {"balance", "compare"} <= {n for n in given if given[n] != after[n]}
    os.utime(tmp_path / "cm.json", ns=(0, 0))
    touched = _fingerprints(config)
    assert {n for n in given if given[n] != touched[n]} == {"balance", "compare"} | _downstream("balance")


def test_tracking_and_the_workdir_s_place_are_in_no_fingerprint(tmp_path):
    """Where runs are logged and where the working directory is (a copy stays current) rerun nothing."""
    config = _every_stage_on(tmp_path)
    before = _fingerprints(config)
    config.pipeline.tracking_uri, config.pipeline.experiment = "sqlite:///other.db", "other"
    config.pipeline.workdir, config.train.run_name = str(tmp_path / "moved"), "named"
    assert _fingerprints(config) == before


def test_stage_params_are_the_job_s_arguments_with_workdir_paths_relative(tmp_path):
    raw, work = tmp_path / "raw.csv", tmp_path / "work"
    raw.write_text("u,i,t\n")
    values = {"input": str(raw), "output": str(work / "out"), "capacities": f"@{work / 'speeds.json'}",
              "near": str(tmp_path / "work2" / "x"), "cost_model": str(work / "cm.json"), "tracking_uri": "x",
              "run_name": "r", "balanced": {"seed": 1}}
    params = stages.stage_params(values, {"tracking.experiment": "e", "model.hstu.num_layers": "1"}, work,
                                 inputs=("input", "cost_model"))
    assert params == {"input identity": stages.file_identity(str(raw)),
                      "output": "<workdir>/out", "capacities": "@<workdir>/speeds.json",
                      "near": str(tmp_path / "work2" / "x"), "cost_model": "<workdir>/cm.json",
                      "balanced.seed": 1, "model.hstu.num_layers": "1"}


# ------------------------------------------------------------------ stopped and killed runs


def _fake_prepare(uri: str, then) -> object:
    """A prepare job that opens its MLflow run, as the job does, then calls ``then()`` (no Spark)."""
    def run(spec_of, tracking) -> int:
        from freescale.tracking.runs import job_run

        with job_run("prepare", tracking_uri=uri, experiment="pipeline-test"):
            then()
        return 0
    return run


def _runs(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name("pipeline-test").experiment_id])


@pytest.mark.spawns  # in process, but its records run git (code_version)
def test_a_stop_signal_ends_the_stage_killed_and_releases_the_lock(tmp_path, monkeypatch, capsys):
    """SIGTERM to `freescale pipeline` left its lock, a record saying running and a RUNNING run
    (and staging, which the jobs' own handling removes once the stop is an exception: see
    test_job_io). Now the stage's run ends KILLED, tagged with the workdir, the record says
    killed, the lock is gone, and the pipeline ends with one line and 128 + 15."""
    from freescale.jobs import prepare

    monkeypatch.setenv(logs.LOG_DIR_ENV, str(tmp_path / "logs"))
    uri = sqlite_store(tmp_path / "mlflow.db")
    work = tmp_path / "work"
    config = write_config(tmp_path, work)
    monkeypatch.setattr(prepare, "run", _fake_prepare(uri, lambda: (os.kill(os.getpid(), signal.SIGTERM),
                                                                     time.sleep(30))))
    before = signal.getsignal(signal.SIGTERM)
    assert run(config) == 128 + signal.SIGTERM
    captured = capsys.readouterr()
    assert "prepare   uses synthetic data ([prepare] has no input: 300 users, 200 items, seed 0)" in captured.out
    assert captured.err.strip().splitlines()[-1] == (
        "freescale pipeline: error: stopped by signal 15 in stage prepare: its MLflow run ended KILLED, its output "
        "left as it was, its record says killed")
    assert not (work / workflow.LOCK).exists()
    record = json.loads((work / "prepare.fingerprint.json").read_text())
    assert (record["status"], record["why"]) == ("killed", "stopped by signal 15")
    [stopped] = _runs(uri)
    assert stopped.info.status == "KILLED" and stopped.data.tags["freescale.pipeline"] == str(work.resolve())
    assert signal.getsignal(signal.SIGTERM) is before  # the pipeline's handler is its own business
    assert "FREESCALE_PIPELINE_WORKDIR" not in os.environ


def _stop_replaced_by_a_cleanup_error() -> None:
    """SIGTERM, then a cleanup on the way out raises its own error in place of the stop: what a
    cleanup's JVM call did when the signal had landed inside a Spark action (KeyError: 'c' from the
    call's unread answer)."""
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    finally:
        raise KeyError("c")


@pytest.mark.spawns  # in process, but its records run git (code_version)
def test_a_stop_that_a_cleanup_error_replaced_still_ends_the_stage_killed(tmp_path, monkeypatch, capsys):
    """The job (in run_job, as every job is) sees a KeyError, not the stop: it must still end as the
    stop (no error line of its own, its trace in the log), its run KILLED, the stage's record killed,
    the pipeline's one line and 128 + 15."""
    from freescale.jobs import prepare
    from freescale.runtime.job_errors import run_job

    monkeypatch.setenv(logs.LOG_DIR_ENV, str(tmp_path / "logs"))
    monkeypatch.setattr(logs, "_log_file", None)
    uri = sqlite_store(tmp_path / "mlflow.db")
    work = tmp_path / "work"
    fake = _fake_prepare(uri, _stop_replaced_by_a_cleanup_error)
    monkeypatch.setattr(prepare, "run", lambda spec_of, tracking: run_job("prepare", lambda: fake(spec_of, tracking)))
    assert run(write_config(tmp_path, work)) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if ": error: " in line] == [
        "freescale pipeline: error: stopped by signal 15 in stage prepare: its MLflow run ended KILLED, its output "
        "left as it was, its record says killed"]
    assert json.loads((work / "prepare.fingerprint.json").read_text())["status"] == "killed"
    assert [r.info.status for r in _runs(uri)] == ["KILLED"]
    assert "KeyError: 'c'" in logs.log_file("prepare").read_text()
    assert not (work / workflow.LOCK).exists()
    from freescale.runtime.stops import stop_signal

    assert stop_signal() is None  # the stop is the pipeline's: forgotten when it ends


@pytest.mark.spawns  # in process, but its records run git (code_version)
def test_a_rerun_ends_the_runs_a_killed_run_left_running_failed(tmp_path, monkeypatch, capsys):
    """kill -9 leaves a stage's run RUNNING forever; the next run of the same workdir (which holds
    the lock, so none of its stages runs) ends it FAILED. Runs of other workdirs, and ended runs,
    are left alone."""
    from mlflow.tracking import MlflowClient

    from freescale.jobs import prepare

    monkeypatch.setenv(logs.LOG_DIR_ENV, str(tmp_path / "logs"))
    uri = sqlite_store(tmp_path / "mlflow.db")
    work = tmp_path / "work"
    config = write_config(tmp_path, work)
    client = MlflowClient(uri)
    experiment = client.create_experiment("pipeline-test")
    tags = {"freescale.job": "balance"}
    orphan = client.create_run(experiment, tags={**tags, "freescale.pipeline": str(work.resolve())})
    elsewhere = client.create_run(experiment, tags={**tags, "freescale.pipeline": str(tmp_path / "other")})
    finished = client.create_run(experiment, tags={**tags, "freescale.pipeline": str(work.resolve())})
    client.set_terminated(finished.info.run_id, "FINISHED")
    monkeypatch.setattr(prepare, "run", _fake_prepare(uri, lambda: None))
    assert run(config, "--pipeline.tracking_uri", uri) == 2  # then balance fails: the fake wrote no output
    err = capsys.readouterr().err
    assert (f"freescale pipeline: note: 1 MLflow run(s) of a killed run of this workdir were still RUNNING: "
            f"ended FAILED (balance {orphan.info.run_id})") in err
    status = {r.info.run_id: r.info.status for r in _runs(uri)}
    assert status[orphan.info.run_id] == "FAILED"
    assert status[elsewhere.info.run_id] == "RUNNING" and status[finished.info.run_id] == "FINISHED"
    assert [r.data.tags["freescale.job"] for r in _runs(uri) if r.info.status == "FINISHED"
            and r.info.run_id != finished.info.run_id] == ["prepare"]  # this run's own stage ran


@pytest.mark.parametrize("status, continues", [("running", True), ("killed", True), ("done", True),
                                               ("stale", False)])
def test_a_stage_continues_its_last_run_when_its_record_says_it_started(tmp_path, status, continues):
    """A stage whose run a stop signal ended (record ``killed``, as run_stage writes it) continues from
    its checkpoints like one a kill -9 left ``running``; a stale record (an upstream stage reran)
    and a changed fingerprint start over."""
    from freescale.jobs.workflow import stages

    summary = tmp_path / "summary.json"
    seen: list[bool] = []

    def stage(params: dict) -> stages.Stage:
        return stages.Stage("train", lambda: 0, params, summary, stages.json_damage(summary, "summary"),
                            before_run=lambda continuable: seen.append(continuable) or "")

    fp = stages.fingerprint({"steps": 40}, {})
    stages.write_record(tmp_path, stage({"steps": 40}), status, fp, {}, "why")
    lines: list[str] = []
    for params in ({"steps": 40}, {"steps": 50}):
        ran, failed = stages.run_stages([stage(params)], tmp_path, fresh=False, run_stage=lambda s: (0, "", False),
                                        say=lines.append)
        assert (ran, failed) == (["train"], None)
        stages.write_record(tmp_path, stage({"steps": 40}), status, fp, {}, "why")  # as before the next run
    assert seen == [continues, False]  # the same work continues, other work does not
    stages.run_stages([stage({"steps": 40})], tmp_path, fresh=True, run_stage=lambda s: (0, "", False),
                      say=lines.append)
    assert seen[-1] is False  # --fresh starts over


def test_demo_runs_the_shipped_pipeline_with_its_sizes(tmp_path, monkeypatch):
    """`freescale demo` is the pipeline of configs/demo_pipeline.toml (and configs/demo.toml), its sizes and
    workdir from its own options: the config it hands the pipeline, with the run stubbed out."""
    from freescale.jobs import cli

    seen = []
    monkeypatch.setattr(workflow, "run", lambda config, fresh=False: seen.append((config, fresh)) or 7)
    assert cli.demo(["--workdir", str(tmp_path / "demo"), "--world-size", "3", "--fresh"]) == 7
    [(config, fresh)] = seen
    assert fresh and (config.pipeline.workdir, config.pipeline.world_size, config.pipeline.local_batch_size) == (
        str(tmp_path / "demo"), 3, 32)
    assert config.train.config == str(REPO / "configs" / "demo.toml") and config.balance.window_steps == 32
