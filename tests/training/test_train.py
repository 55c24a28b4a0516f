"""The trainer end to end: 2 gloo ranks under torch's elastic launcher (the session's runs in
conftest.py), and one rank in this process for the refusals a rank makes on its own."""
from __future__ import annotations


import pytest

from freescale.shards.manifest import load_manifest
from tests.helpers import copy_shards, error_lines, in_process_args, reseal, train_in_process, without_details


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_exact_resume_matches_uninterrupted_run(sharding, request):
    """Sharded item table (either way), table-wise user feature tables, dense part and both
    optimizers come back exactly. Row-wise: the step-3 checkpoint of a run stopped by Ctrl-C, resumed
    in another comm mode than the reference (the modes compute the same bits); table-wise: the
    step-10 checkpoint torchrun's restart resumed from when one of the job's ranks was killed
    (restarted_run, against its uninterrupted twin). Table-wise puts whole tables on one rank, so the
    other rank restores tensors it holds no shard of."""
    if sharding == "row_wise":
        reference = request.getfixturevalue("row_run").log
        resumed = request.getfixturevalue("row_resume").log
        assert resumed["steps"] == [3, 4, 5, 6, 7]
    else:
        restarted = request.getfixturevalue("restarted_run")
        reference, resumed = restarted.stopped.log, restarted.restarted.log
        assert resumed["steps"] == list(range(10, len(reference["losses"]))), resumed["steps"]
    assert resumed["losses"] == reference["losses"][resumed["steps"][0]:]
    assert reference["losses"][-1] < reference["losses"][0]  # the model learned


def test_resume_in_other_shards_is_refused(movielens_shards_1, tmp_path, capsys):
    """The checkpoint's loader position means nothing in another shard set (one rank, in process)."""
    ckpt = str(tmp_path / "ckpt")
    assert train_in_process(*in_process_args(movielens_shards_1, "--training.max_steps", "1",
                                             "--checkpoint.folder", ckpt)) == 0
    other = copy_shards(movielens_shards_1, tmp_path / "other")
    reseal(other, lambda m: m.update(seed=m.get("seed", 0) + 1))
    capsys.readouterr()
    assert train_in_process(*in_process_args(other, "--training.max_steps", "2", "--checkpoint.folder", ckpt)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("freescale train (rank 0): error: checkpoint ") and \
        "was written for other shards" in err[-1], err


def test_world_size_mismatch_names_both_numbers(movielens_shards, capsys):
    assert train_in_process(*in_process_args(movielens_shards, "--training.max_steps", "2")) == 2
    line = without_details(capsys.readouterr().err.strip().splitlines()[-1])
    assert line == (f"freescale train (rank 0): error: {movielens_shards / 'manifest.json'} was written for world "
                    "size 2 but this launch has world size 1")


@pytest.mark.slow
def test_missing_manifest_is_one_line_on_every_rank(failed_launches):
    """Under --verbose each rank says it, then the launch's last line counts them."""
    run = failed_launches.no_manifest
    assert run.returncode == 2  # bad input (freescale/runtime/job_errors.py)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("freescale train")]
    for rank in (0, 1):
        [own] = [line for line in lines if line.startswith(f"freescale train (rank {rank}): error:")]
        assert f"no manifest.json in shard directory {failed_launches.empty}" in own, lines
    assert lines[-1].startswith("freescale train: error: ranks 0, 1 of 2 failed"), lines


@pytest.mark.slow
def test_corrupt_parquet_stops_every_rank_without_hanging(failed_launches):
    run = failed_launches.corrupt  # ended within the launch's timeout
    assert run.returncode == 2
    lines = error_lines(run)
    assert any(failed_launches.victim.name in line for line in lines), lines
    assert any("rank 0" in line for line in lines), lines  # the healthy rank stopped too


def test_item_id_beyond_table_names_the_id(movielens_shards_1, tmp_path, capsys):
    shards = copy_shards(movielens_shards_1, tmp_path / "s")
    reseal(shards, lambda m: m.update(num_items=50))
    assert train_in_process(*in_process_args(shards, "--training.max_steps", "2")) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("freescale train (rank 0): error: ") and "50" in line and "item" in line.lower(), line


def test_empty_rank_shard_is_refused(movielens_shards_1, tmp_path, capsys):
    shards = copy_shards(movielens_shards_1, tmp_path / "s")

    def empty(manifest: dict) -> None:
        manifest["ranks"][0]["rows"] = 0
        manifest["ranks"][0]["files"] = []

    reseal(shards, empty)
    assert train_in_process(*in_process_args(shards, "--training.max_steps", "2")) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "rank 0 has an empty shard" in line, line


@pytest.mark.slow
def test_two_rank_run_logs_to_mlflow_server(row_run, movielens_shards, tmp_path):
    from mlflow.tracking import MlflowClient

    from freescale.training.timing.bubbles import TIMING_FIELDS
    from tests.scenarios import STEPS

    client = MlflowClient(row_run.uri)
    runs = client.search_runs([client.get_experiment_by_name(row_run.experiment).experiment_id])
    assert len(runs) == 1
    logged = runs[0]
    assert logged.info.run_name == "e2e" and logged.info.status == "FINISHED"
    for name in ("loss", "step_time_s", "samples_per_s", "bubble_fraction", "imbalance",
                 "hr_at_10", "ndcg_at_10", "mrr"):
        assert name in logged.data.metrics, name
    assert logged.data.tags["freescale.strategy"] == "kk" and logged.data.tags["freescale.world_size"] == "2"
    assert "freescale.code_version" in logged.data.tags
    assert logged.data.params["training.max_steps"] == "8" and logged.data.params["model.hstu.num_layers"] == "1"
    history = client.get_metric_history(logged.info.run_id, "step/loss")
    assert sorted((m.step, m.value) for m in history) == list(enumerate(row_run.log["losses"]))
    artifacts = [a.path for a in client.list_artifacts(logged.info.run_id)]
    assert "rank_timelines.png" in artifacts
    # The whole timing table, one row per step and rank, as the run's Parquet artifact.
    import pyarrow.parquet as pq

    timings = pq.read_table(client.download_artifacts(logged.info.run_id, "timings/timings.parquet", str(tmp_path)))
    assert timings.num_rows == STEPS * 2 == len(row_run.log["steps"]) * 2
    assert timings.column("step").to_pylist() == [s for s in row_run.log["steps"] for _ in range(2)]
    assert timings.column("rank").to_pylist() == [0, 1] * STEPS
    assert timings.column("dense_compute_s").to_pylist() == [
        r[TIMING_FIELDS.index("dense_compute_s")] for step in row_run.log["timings"]["steps_ranks_fields"] for r in step]
    log = row_run.log
    summary = log["summary"]
    assert summary["eval_samples"] == 943 - 943 % 32
    # The summary's bubble is the per-step timings' (warm-up steps left out), and MLflow has it.
    import numpy as np

    from freescale.training.timing.bubbles import bubble_fraction
    table = np.array(log["timings"]["steps_ranks_fields"])[2:]
    fields = log["timings"]["fields"]
    expected = bubble_fraction(table[..., fields.index("dense_compute_s")],
                               table[..., fields.index("step_s")].max(axis=1))
    assert summary["bubble_fraction"] == pytest.approx(expected, rel=1e-9)
    assert logged.data.metrics["bubble_fraction"] == pytest.approx(expected, rel=1e-6)
    # The cost column's unit: the shards' cost model, which freescale simulate checks.
    assert log["cost_model"] == load_manifest(movielens_shards).cost_model


@pytest.mark.slow
def test_a_dead_rank_stops_the_others(killed_run):
    """kill -9 of rank 1 after step 2: the launch ends (within its 120 s wait) with a failure, and
    rank 0 ended its MLflow run rather than leaving it running."""
    assert killed_run.returncode != 0, killed_run.output[-3000:]
    assert killed_run.status_after_kill in ("KILLED", "FAILED")


@pytest.mark.slow
def test_a_hung_rank_hits_the_collective_timeout(hung_run):
    assert hung_run.returncode != 0
    output = hung_run.output
    assert "freescale train: error:" in output and ("Timed out" in output or "timeout" in output.lower()), \
        output[-3000:]
