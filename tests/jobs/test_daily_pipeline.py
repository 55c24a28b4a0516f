"""`freescale pipeline` in incremental mode ([pipeline] incremental = true): a folder of day partitions,
each day prepared on top of the day before, its samples balanced, trained from the day before's
checkpoint, exported, registered and promoted; a day that is done is skipped.

MovieLens-100K cut at its 80th-percentile timestamp into two days. The first run sees day 1 only; the
second, with day 2 added, runs only day 2's stages; a third runs nothing. Runs in-process on the
suite's Spark session, one rank without torchrun (tests/helpers.py), a tiny model, 6 steps a day."""
from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest

from freescale.jobs.workflow import days
from freescale.jobs.workflow.config import WorkflowConfig
from freescale.runtime import logs
from freescale.runtime.errors import InputError
from tests.helpers import one_rank_without_torchrun, sqlite_store
from tests.jobs.test_workflow import TRAIN_TOML  # the pipeline tests' tiny model, 6 steps

MODEL_NAME = "daily"


PIPELINE_TOML = """
[pipeline]
workdir = "{workdir}"
tracking_uri = "{uri}"
world_size = 1
local_batch_size = 8
incremental = true
[prepare]
input = "{logs}"
max_seq_len = 64
[balance]
window_steps = 4
[export]
register = "{name}"
[promote]
max_users = 200
[train]
config = "{train}"
"""


# ------------------------------------------------------------------ units


def test_day_partitions_are_listed_in_name_order_without_their_prefix(tmp_path):
    for name in ("day=2026-12-02", ".hidden"):
        (tmp_path / name).mkdir()
    for name in ("2026-12-01.parquet", "_SUCCESS"):
        (tmp_path / name).touch()
    found = days.day_partitions(str(tmp_path))
    assert [(d.name, d.path.name) for d in found] == [("2026-12-01", "2026-12-01.parquet"),
                                                      ("2026-12-02", "day=2026-12-02")]


@pytest.mark.parametrize("layout, named", [
    ((), "no day partitions"), (("2026-12-01.parquet", "day=2026-12-01"), "are both day 2026-12-01")])
def test_bad_day_folders_are_one_line(tmp_path, layout, named):
    for name in layout:
        (tmp_path / name).touch() if name.endswith(".parquet") else (tmp_path / name).mkdir()
    with pytest.raises(InputError, match=named):
        days.day_partitions(str(tmp_path))
    with pytest.raises(InputError, match="a local folder of day partitions"):
        days.day_partitions(str(tmp_path / "missing"))


def test_a_day_runs_in_its_own_workdir_on_its_own_logs_and_is_exported(tmp_path):
    config = WorkflowConfig()
    config.pipeline.workdir, config.pipeline.incremental = str(tmp_path / "work"), True
    day = days.Day("2026-12-01", tmp_path / "logs" / "2026-12-01.parquet")
    found = days.day_config(config, day)
    assert found.pipeline.workdir == str(tmp_path / "work" / "days" / "2026-12-01")
    assert found.prepare.input == str(day.path) and found.export.enabled
    assert config.pipeline.workdir == str(tmp_path / "work") and not config.export.enabled  # a copy


def test_incremental_mode_needs_a_registered_model(tmp_path):
    config = WorkflowConfig()
    config.pipeline.incremental, config.prepare.input = True, str(tmp_path)
    with pytest.raises(InputError, match=r"needs \[export\] register"):
        days.check_incremental(config)


def test_the_day_before_is_in_the_chained_stages_fingerprints(tmp_path):
    from freescale.jobs.workflow.table import Workdir, build_stages

    config = WorkflowConfig()
    config.pipeline.workdir, config.pipeline.incremental = str(tmp_path / "d2"), True
    config.prepare.input = str(tmp_path / "d2.parquet")
    before = Workdir(tmp_path / "d1")
    stages = {s.name: s for s in build_stages(config, before)}
    assert stages["prepare"].params["previous"] == str(before.prepared)
    assert stages["train"].params["training.init_from"] == str(before.checkpoints)
    assert "day before" in stages["prepare"].params and "day before" in stages["train"].params
    assert "day before" not in stages["balance"].params and stages["promote"].off is None
    config.pipeline.master = "spark://h:7077"  # where it computes, not what: no fingerprint moves
    assert {s.name: s.params for s in build_stages(config, before)} == {n: s.params for n, s in stages.items()}


# ------------------------------------------------------------------ two days, three runs


def split_movielens(movielens_dir: Path, logs_dir: Path):
    """ratings.parquet cut at its 80th-percentile timestamp into logs_dir/2026-12-0{1,2}.parquet."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(movielens_dir / "ratings.parquet")
    cut = float(np.percentile(table["timestamp"].to_numpy(), 80))
    logs_dir.mkdir()
    pq.write_table(table.filter(pc.less_equal(table["timestamp"], cut)), logs_dir / "2026-12-01.parquet")
    return cut, table.filter(pc.greater(table["timestamp"], cut))


def pipeline(config: Path, *extra: str) -> tuple[int, str]:
    from freescale.jobs import cli

    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli.main(["pipeline", "--config", str(config), *extra])
    return rc, out.getvalue()


@pytest.fixture(scope="module")
def two_days(spark, movielens_dir, tmp_path_factory):
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("incremental")
    logs_dir = folder / "logs"
    _, day2 = split_movielens(movielens_dir, logs_dir)
    (folder / "train.toml").write_text(TRAIN_TOML)
    uri = sqlite_store(folder / "mlflow.db")
    config = folder / "pipeline.toml"
    config.write_text(PIPELINE_TOML.format(workdir=folder / "work", uri=uri, logs=logs_dir, name=MODEL_NAME,
                                           train=folder / "train.toml"))
    runs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(logs.LOG_DIR_ENV, str(folder / "job-logs"))
        one_rank_without_torchrun(mp)
        runs.append(pipeline(config))
        pq.write_table(day2, logs_dir / "2026-12-02.parquet")
        runs.append(pipeline(config))
        runs.append(pipeline(config))
    for rc, out in runs:
        assert rc == 0, out
    return SimpleNamespace(folder=folder, work=folder / "work" / "days", uri=uri, outputs=[out for _, out in runs])


def ran(output: str) -> list[str]:
    """The stages the summary says ran."""
    summary = output.split("freescale pipeline: summary of", 1)[1]
    return [line.split()[2] for line in summary.splitlines() if line.split()[3:4] == ["ran"]]


@pytest.mark.slow
@pytest.mark.extended
def test_the_second_run_runs_only_the_new_day_and_the_third_nothing(two_days):
    first, second, third = two_days.outputs
    assert ran(first) == ["prepare", "balance", "train", "export", "promote"]
    assert ran(second) == ["prepare", "balance", "train", "export", "promote"]  # day 2's: day 1's are skipped
    assert "freescale pipeline: day 2026-12-01 done: kept as it is" in second
    assert ran(third) == [] and "0 stage(s) ran" in third
    d1, d2 = (two_days.work / day for day in ("2026-12-01", "2026-12-02"))
    prepared = json.loads((d2 / "prepared" / "prepare.json").read_text())
    assert prepared["users"] < json.loads((d1 / "prepared" / "prepare.json").read_text())["users"] + 943
    record = json.loads((d2 / "train.fingerprint.json").read_text())
    assert record["params"]["training.init_from"] == str(d1 / "checkpoints")


@pytest.mark.slow
@pytest.mark.extended
def test_each_day_is_a_registered_version_and_the_alias_says_which_serves(two_days):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(two_days.uri)
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{MODEL_NAME}'"))
    assert versions == [1, 2]
    d1, d2 = (json.loads((two_days.work / day / "promotion.json").read_text())
              for day in ("2026-12-01", "2026-12-02"))
    assert d1["alias_moved"] and d1["champion"] is None and d1["version"] == 1
    assert d2["version"] == 2 and d2["champion"]["version"] == 1
    assert d2["alias_moved"] == (d2["new"]["ndcg_at_10"] >= d2["champion"]["ndcg_at_10"])
    assert int(client.get_model_version_by_alias(MODEL_NAME, "champion").version) == d2["alias_points_at"]
    assert d2["held_out_users"] == 200


@pytest.mark.slow
@pytest.mark.extended
def test_each_day_is_one_parent_run_naming_its_logs(two_days):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(two_days.uri)
    experiment = client.get_experiment_by_name("freescale")
    all_runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = {r.info.run_name: r for r in all_runs if r.data.tags.get("freescale.job") == "pipeline"}
    assert sorted(parents) == ["day 2026-12-01", "day 2026-12-02"]  # the third run opened none
    for name, parent in parents.items():
        assert parent.info.status == "FINISHED"
        [dataset] = parent.inputs.dataset_inputs
        assert dataset.dataset.name == f"logs:{name.split()[1]}.parquet"
        children = {r.data.tags["freescale.job"] for r in all_runs
                    if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
        assert {"prepare", "balance", "train", "promote"} <= children, children


@pytest.mark.slow
@pytest.mark.extended
def test_day_two_starts_from_day_one_below_a_cold_start_on_its_shards(two_days, tmp_path):
    from tests.helpers import train_in_process

    d2 = two_days.work / "2026-12-02"
    warm = json.loads((d2 / "train_summary.json").read_text())["losses"]
    cold_log = tmp_path / "cold.json"
    assert train_in_process("--config", str(two_days.folder / "train.toml"), "--data.shards", str(d2 / "shards"),
                            "--training.max_steps", "1", "--tracking.uri", "none",
                            "--checkpoint.folder", str(tmp_path / "ckpt"), "--summary-json", str(cold_log)) == 0
    cold = json.loads(cold_log.read_text())["losses"]
    assert warm[0] < cold[0], (warm[0], cold[0])
