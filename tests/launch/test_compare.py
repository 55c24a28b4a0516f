"""`freescale compare` and MLflow runs that line up: one parent run per comparison with its
training runs nested, its numbers recomputed from theirs, and job runs that span their job."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers import sqlite_store

REPO = Path(__file__).resolve().parents[2]
VARIANT_TAGS = {"contiguous": ("contiguous", "none"), "balanced": ("kk", "none"), "control": ("contiguous", "mirror")}


def client_of(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def span_s(run) -> float:
    return (run.info.end_time - run.info.start_time) / 1000


@pytest.mark.slow
def test_the_parent_run_holds_the_training_runs(movielens_comparison):
    cmp = movielens_comparison
    client = client_of(cmp.tracking_uri)
    parent = client.get_run(cmp.parent_run_id)
    comparison = cmp.summary["comparison"]
    assert parent.info.status == "FINISHED" and parent.info.run_name == "compare-k2-b16"
    assert parent.info.experiment_id == cmp.experiment_id
    assert client.get_experiment(cmp.experiment_id).name == "freescale-movielens-100k"  # from prepare.json's input
    assert {k: parent.data.tags[k] for k in ("freescale.job", "freescale.strategy", "freescale.control",
                                             "freescale.comparison")} == {
        "freescale.job": "compare", "freescale.strategy": "kk", "freescale.control": "mirror",
        "freescale.comparison": comparison}

    nested = client.search_runs([cmp.experiment_id], f"tags.mlflow.parentRunId = '{cmp.parent_run_id}'")
    assert len(nested) == 3  # one repeat of each variant
    assert sorted(r.info.run_id for r in nested) == sorted(i for ids in cmp.child_run_ids.values() for i in ids)
    for variant, ids in cmp.child_run_ids.items():
        assert len(ids) == 1
        for repeat, run_id in enumerate(ids):
            run = client.get_run(run_id)
            assert run.info.status == "FINISHED" and run.info.run_name == f"compare-k2-b16-{variant}-r{repeat}"
            assert (run.data.tags["freescale.strategy"], run.data.tags["freescale.control"]) == VARIANT_TAGS[variant]
            assert run.data.tags["freescale.comparison"] == comparison and run.data.tags["freescale.job"] == "train"
            assert run.data.params["training.seed"] == str(repeat)
    ordered = sorted(nested, key=lambda r: r.info.start_time)
    assert [r.info.run_name.rsplit("-", 2)[1] for r in ordered] == ["contiguous", "balanced", "control"]


@pytest.mark.slow
def test_mlflow_shows_the_comparison_and_the_data_each_run_used(movielens_comparison):
    """The parent's description holds the table and the verdict on the floor; the experiment opens in
    MLflow's training-runs view; nested runs carry variant and repeat; every run names its shards by
    the manifest's digest, the same digest on the balance run that wrote them."""
    import hashlib

    cmp = movielens_comparison
    client = client_of(cmp.tracking_uri)
    note = client.get_run(cmp.parent_run_id).data.tags["mlflow.note.content"]
    assert "| shards | bubble |" in note and "| contiguous |" in note and "| control |" in note
    assert "- bubble_reduction:" in note and "- signal:" in note and "comparison_timelines.png" in note
    assert client.get_experiment(cmp.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    digests = {v: hashlib.sha256((Path(d) / "manifest.json").read_bytes()).hexdigest()[:32]
               for v, d in cmp.summary["shards"].items()}
    assert len(set(digests.values())) == 3
    for variant, (run_id,) in cmp.child_run_ids.items():
        run = client.get_run(run_id)
        assert (run.data.tags["variant"], run.data.tags["repeat"]) == (variant, "0")
        (used,) = run.inputs.dataset_inputs
        assert used.dataset.digest == digests[variant] and used.tags[0].value == "training"
    parent_inputs = {i.tags[0].value: i.dataset.digest for i in client.get_run(cmp.parent_run_id).inputs.dataset_inputs}
    assert parent_inputs == digests
    comparison = cmp.summary["comparison"]
    balance_runs = client.search_runs([cmp.experiment_id], f"tags.`freescale.job` = 'balance' and "
                                      f"tags.`freescale.comparison` = '{comparison}'")
    written = {next(i.dataset.digest for i in r.inputs.dataset_inputs if i.tags[0].value == "output")
               for r in balance_runs}
    assert written == set(digests.values())


def test_the_verdict_on_the_floor_reads_the_repeats_ranges():
    from freescale.launch.comparison import floor_verdict

    def runs(**bubbles):
        return {v: [{"summary": {"bubble_fraction": b}} for b in values] for v, values in bubbles.items()}

    assert floor_verdict(runs(contiguous=[0.2, 0.3], balanced=[0.1, 0.12])).startswith("unknown: no control")
    assert floor_verdict(runs(contiguous=[0.2, 0.3], balanced=[0.05, 0.06], control=[0.04, 0.05])).startswith(
        "above the floor")
    assert floor_verdict(runs(contiguous=[0.04, 0.3], balanced=[0.05, 0.06], control=[0.04, 0.05])).startswith(
        "within the noise floor")
    assert "overlap" in floor_verdict(runs(contiguous=[0.2, 0.3], balanced=[0.1, 0.25], control=[0.04, 0.05]))
    assert "1 repeat" in floor_verdict(runs(contiguous=[0.2], balanced=[0.1], control=[0.04]))


def test_repeats_alternate_the_variants_with_one_seed_per_repeat(tmp_path, monkeypatch):
    """Three repeats, in process with the trainings stubbed out (train_once records its settings):
    the variants alternate, every variant of a repeat gets the repeat's seed, and the summaries
    come back per variant in repeat order."""
    import argparse

    from freescale.launch import comparison

    calls = []

    def fake_train_once(shards: Path, out: Path, settings: list[str]) -> dict:
        seed = int(settings[settings.index("--training.seed") + 1])
        calls.append((shards.name, settings[settings.index("--run-name") + 1], seed))
        return {"summary": {"bubble_fraction": 0.1 * len(calls), "idle_fraction": 0.0, "step_time_s": 0.01,
                            "hr_at_10": 0.0}, "mlflow_run_id": f"run{len(calls)}"}

    monkeypatch.setattr(comparison, "train_once", fake_train_once)
    sets = {"contiguous": tmp_path / "c", "balanced": tmp_path / "b", "control": tmp_path / "m"}
    monkeypatch.setattr("freescale.shards.manifest.load_manifest", lambda path: argparse.Namespace(world_size=2))
    args = argparse.Namespace(repeats=3, seed=5, config=None, comm_mode=None)
    runs = comparison.run_trainings(args, [], sets, 8, tmp_path / "work", "none", "exp", "cmp", "cmp-id", None)
    assert [run_name.rsplit("-", 2)[1] for _, run_name, _ in calls] == ["contiguous", "balanced", "control"] * 3
    assert [seed for _, _, seed in calls] == [5, 5, 5, 6, 6, 6, 7, 7, 7]
    assert [name for name, _, _ in calls] == ["c", "b", "m"] * 3
    assert {v: [(r["repeat"], r["seed"], r["run_id"]) for r in rows] for v, rows in runs.items()} == {
        "contiguous": [(0, 5, "run1"), (1, 6, "run4"), (2, 7, "run7")],
        "balanced": [(0, 5, "run2"), (1, 6, "run5"), (2, 7, "run8")],
        "control": [(0, 5, "run3"), (1, 6, "run6"), (2, 7, "run9")]}
    medians = comparison.medians(runs)
    assert medians["balanced"]["bubble_fraction"] == pytest.approx(0.5)  # runs 2, 5, 8: 0.2, 0.5, 0.8


@pytest.mark.slow
def test_the_parent_numbers_are_recomputed_from_the_training_runs(movielens_comparison):
    cmp = movielens_comparison
    client = client_of(cmp.tracking_uri)
    parent = client.get_run(cmp.parent_run_id).data.metrics

    def median(variant: str, key: str) -> float:
        return statistics.median(client.get_run(i).data.metrics[key] for i in cmp.child_run_ids[variant])

    def removed(key: str) -> float | None:
        removable = median("contiguous", key) - median("control", key)
        return (median("contiguous", key) - median("balanced", key)) / removable if removable > 0 else None

    for metric, key in (("bubble_reduction", "bubble_fraction"), ("idle_reduction", "idle_fraction")):
        expected = removed(key)
        if expected is None:  # a noisy run where the control waited as long: recorded as nothing, not as a number
            assert metric not in parent and cmp.summary["metrics"][metric] is None
        else:
            assert parent[metric] == pytest.approx(expected, rel=1e-6)
    assert parent["speedup"] == pytest.approx(median("balanced", "samples_per_s") / median("contiguous", "samples_per_s"),
                                              rel=1e-6)
    for key in ("hr_at_10", "ndcg_at_10", "mrr"):
        assert parent[f"delta_{key}"] == pytest.approx(median("balanced", key) - median("contiguous", key), abs=1e-9)
    for variant in cmp.child_run_ids:
        assert parent[f"{variant}/bubble_fraction"] == pytest.approx(median(variant, "bubble_fraction"), rel=1e-6)
    # The planner's work shows in what the ranks measured: contiguous shards wait more than balanced.
    assert median("contiguous", "predicted_bubble") > median("balanced", "predicted_bubble")
    # The --summary-json numbers are the parent run's.
    recorded = {k: v for k, v in cmp.summary["metrics"].items() if v is not None}
    assert recorded == pytest.approx(parent)

    artifacts = {a.path: a for a in client.list_artifacts(cmp.parent_run_id)}
    assert {"comparison_timelines.png", "comparison.json"} <= set(artifacts)
    local = Path(client.download_artifacts(cmp.parent_run_id, "comparison_timelines.png", str(cmp.workdir / "dl")))
    assert local.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and local.stat().st_size > 20_000


@pytest.mark.slow
def test_the_balance_runs_span_their_job(movielens_comparison):
    cmp = movielens_comparison
    client = client_of(cmp.tracking_uri)
    runs = client.search_runs([cmp.experiment_id], "tags.`freescale.job` = 'balance'")
    assert sorted((r.data.tags["freescale.strategy"], r.data.tags["freescale.control"]) for r in runs) == \
        sorted(VARIANT_TAGS.values())
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.tags["freescale.comparison"] == cmp.summary["comparison"]
        # Opened before the work started, ended after it: the run is at least as long as the work
        # it timed (before, runs were logged after the job and lasted ~60 ms).
        assert run.data.metrics["job_seconds"] > 0
        assert span_s(run) >= run.data.metrics["job_seconds"]


@pytest.mark.slow
def test_prepare_run_spans_the_job_and_a_failing_balance_ends_failed(spark, movielens_prepared, tmp_path, capsys):
    from freescale.jobs import balance, prepare

    uri = sqlite_store(tmp_path / "mlflow.db")
    assert prepare.main(["--output", str(tmp_path / "prepared"), "--synthetic-users", "300",
                         "--synthetic-items", "100", "--tracking-uri", uri, "--experiment", "spans"]) == 0
    # The token cap is checked on the data, inside the job's run: the run must end FAILED.
    assert balance.main(["--input", str(movielens_prepared), "--output", str(tmp_path / "shards"),
                         "--world-size", "2", "--local-batch-size", "16", "--token-cap", "5",
                         "--tracking-uri", uri, "--experiment", "spans"]) == 2
    assert "--token-cap 5 is below" in capsys.readouterr().err and not (tmp_path / "shards").exists()
    client = client_of(uri)
    runs = {r.data.tags["freescale.job"]: r
            for r in client.search_runs([client.get_experiment_by_name("spans").experiment_id])}
    assert runs["prepare"].info.status == "FINISHED" and runs["balance"].info.status == "FAILED"
    assert span_s(runs["prepare"]) >= runs["prepare"].data.metrics["job_seconds"] > 0
    assert runs["balance"].info.end_time > runs["balance"].info.start_time
    assert (runs["balance"].data.tags["freescale.strategy"], runs["balance"].data.tags["freescale.control"]) == \
        ("kk", "none")


ARGUMENT_ERRORS = {
    "neither input": ([], "give --input PREPARED"),
    "repeats 0": (["--input", "IN", "--world-size", "2", "--local-batch-size", "16", "--repeats", "0"],
                  "--repeats must be a positive integer, got 0"),
    "no world size": (["--input", "IN", "--local-batch-size", "16"], "--input needs --world-size"),
    "not prepared": (["--input", "NOWHERE", "--world-size", "2", "--local-batch-size", "16"],
                     "no prepare.json"),
    "bad shards": (["--shards", "contiguous=A,fast=B"], "'fast=B' is not VARIANT=DIR"),
    "shards lack balanced": (["--shards", "contiguous=A"], "--shards lacks balanced"),
    "contiguous strategy": (["--input", "IN", "--world-size", "2", "--local-batch-size", "16", "--strategy",
                             "contiguous"], "--strategy 'contiguous'"),
    "flops_kk with a window": (["--input", "IN", "--world-size", "2", "--local-batch-size", "16", "--strategy",
                                "flops_kk", "--window-steps", "8"], "--window-steps must be 1, got 8"),
    "bad config key": (["--input", "IN", "--world-size", "2", "--local-batch-size", "16", "--model.nope", "1"],
                       "model.nope"),
}


@pytest.mark.spawns
def test_argument_errors_are_one_line_before_anything_heavy(tmp_path):
    """Each bad argument: exit 2, one `freescale compare: error:` line, and no torch, pyspark or
    mlflow loaded (all cases in one fresh interpreter, so the check covers every path)."""
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "prepare.json").write_text("{}")
    cases = {name: [str(prepared) if a == "IN" else str(tmp_path / a) if a in ("NOWHERE", "A", "B") else a
                    for a in argv] for name, (argv, _) in ARGUMENT_ERRORS.items()}
    probe = (
        "import contextlib, io, json, sys\n"
        "from freescale.jobs.cli import main\n"
        f"cases = {cases!r}\n"
        "out = {}\n"
        "for name, argv in cases.items():\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        rc = main(['compare', *argv])\n"
        "    out[name] = [rc, err.getvalue()]\n"
        "out['heavy'] = sorted(m for m in ('torch', 'pyspark', 'mlflow', 'torchrec') if m in sys.modules)\n"
        "print(json.dumps(out))\n")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result.pop("heavy") == []
    for name, (_, expected) in ARGUMENT_ERRORS.items():
        rc, err = result[name]
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("freescale compare: error:"), (name, err)
        assert expected in lines[0], (name, lines[0])


def test_shard_sets_of_another_shape_are_refused(movielens_shards, tmp_path, capsys):
    from freescale.jobs import compare

    rc = compare.main(["--shards", f"contiguous={movielens_shards},balanced={movielens_shards}", "--world-size", "4",
                       "--tracking-uri", "none", "--workdir", str(tmp_path / "work")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("freescale compare: error: --shards were balanced for --world-size 2 "
                             "--local-batch-size 16")
    assert not (tmp_path / "work").exists()  # refused before anything was written


def fake_shard_set(folder: Path, strategy: str, control: str | None = None, seed: int = 0) -> Path:
    """A sealed manifest for 2 ranks x 1 step x 1 sample over files of the bytes it names: enough
    for the checks of `--shards`, which read manifests only."""
    from freescale.shards.manifest import MANIFEST_FORMAT, seal

    ranks = []
    for rank in range(2):
        data = folder / f"rank={rank}" / "part-0.parquet"
        data.parent.mkdir(parents=True)
        data.write_bytes(b"x" * (10 + seed))
        ranks.append({"rank": rank, "rows": 1, "files": [{"path": f"rank={rank}/part-0.parquet", "rows": 1,
                                                         "bytes": 10 + seed, "sha256": None}]})
    manifest = {"format": MANIFEST_FORMAT, "world_size": 2, "local_batch_size": 1, "num_steps": 1, "num_items": 5,
                "strategy": strategy, "control": control, "seed": seed, "ranks": ranks}
    (folder / "manifest.json").write_text(json.dumps(seal(manifest)))
    return folder


def compare_refusal(*argv: str) -> list[str]:
    """`freescale compare ARGV` in a fresh interpreter: its stderr lines after exit status 2."""
    run = subprocess.run([sys.executable, "-m", "freescale.jobs.cli", "compare", *argv, "--tracking-uri", "none"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    return run.stderr.splitlines()


@pytest.mark.spawns
def test_shard_sets_are_checked_against_their_labels_and_each_other(tmp_path):
    """The issue's command (the same folder twice) printed a -326% bubble reduction. Each set must
    be planned as its label says (its manifest's strategy and control) and no set may be given
    twice, as the same folder or a copy: one line naming the sets, before any training."""
    import shutil

    contiguous = fake_shard_set(tmp_path / "contiguous", "contiguous")
    kk = fake_shard_set(tmp_path / "kk", "kk", seed=1)
    mirror = fake_shard_set(tmp_path / "mirror", "contiguous", "mirror", seed=2)
    copy = shutil.copytree(contiguous, tmp_path / "copy")
    other = fake_shard_set(tmp_path / "other", "contiguous", seed=3)
    work = tmp_path / "work"
    cases = {
        f"contiguous={kk},balanced={kk}": f"--shards: contiguous={kk} and balanced={kk} are the same folder",
        f"contiguous={contiguous},balanced={copy}":
            f"--shards: contiguous={contiguous} and balanced={copy} are copies of one shard set",
        f"contiguous={kk},balanced={contiguous}":
            f"--shards: contiguous={kk} was planned with strategy kk (its manifest.json), not as the contiguous set",
        f"contiguous={contiguous},balanced={mirror}":
            f"--shards: balanced={mirror} was planned with the mirror control",
        f"contiguous={contiguous},balanced={kk},control={kk}":
            f"--shards: balanced={kk} and control={kk} are the same folder",
        f"contiguous={contiguous},balanced={kk},control={other}":
            f"--shards: control={other} was planned with strategy contiguous (its manifest.json), not as the control",
    }
    for shards, message in cases.items():
        [line] = compare_refusal("--shards", shards, "--workdir", str(work))
        assert line.startswith(f"freescale compare: error: {message}"), (shards, line)
    assert not work.exists()
    # Sets planned as labelled pass these checks (the run then fails later, on the fake files).
    from freescale.shards.shard_sets import check_shard_sets

    sets = {"contiguous": contiguous, "balanced": kk, "control": mirror}
    assert {v: m.strategy for v, m in check_shard_sets(sets, 2, None).items()} == {
        "contiguous": "contiguous", "balanced": "kk", "control": "contiguous"}


def test_given_shard_sets_run_in_variant_order_with_their_own_strategy(tmp_path):
    """--shards in any order: the comparison takes its strategy from the balanced set's manifest and
    its variants in contiguous, balanced, control order (the order the runs alternate in)."""
    from freescale.jobs import compare
    from freescale.shards.shard_sets import check_shard_sets, parse_shard_sets
    from freescale.launch.comparison import describe
    from freescale.tracking.store import Tracking

    sets = {"control": fake_shard_set(tmp_path / "mirror", "contiguous", "mirror", seed=2),
            "balanced": fake_shard_set(tmp_path / "lpt", "lpt", seed=1),
            "contiguous": fake_shard_set(tmp_path / "contiguous", "contiguous")}
    args, _ = compare.build_parser().parse_known_args(
        ["--shards", ",".join(f"{v}={d}" for v, d in sets.items()), "--workdir", str(tmp_path / "work")])
    spec = compare.spec_of_args(args)
    manifests = check_shard_sets(parse_shard_sets(spec.shards, spec.control), None, None)
    cmp = describe(spec, manifests, Tracking("none", None))
    assert list(cmp.given_sets) == ["contiguous", "balanced", "control"] and cmp.control == "mirror"
    assert (cmp.strategy, cmp.world_size, cmp.local_batch_size, cmp.work) == ("lpt", 2, 1, tmp_path / "work")
    assert cmp.name == "compare-k2-b1" and cmp.experiment == "freescale-shards"  # no prepared folder to name it


def test_the_timelines_read_each_runs_timing_file(tmp_path):
    """The plot takes the chosen runs' timings from the timing files beside their summaries."""
    import numpy as np

    from freescale.costs.run_summary import timings_beside, write_run_summary
    from freescale.costs.run_timings import TimingFile
    from freescale.launch.comparison import plot_comparison
    from freescale.training.timing.bubbles import TIMING_FIELDS

    runs = {}
    for variant in ("contiguous", "balanced"):
        out = tmp_path / f"{variant}-0.json"
        timing_file = TimingFile(timings_beside(out), TIMING_FIELDS, 2)
        timing_file.append([0, 1, 2], np.random.default_rng(0).random((3, 2, len(TIMING_FIELDS))))
        write_run_summary(out, summary={"bubble_fraction": 0.1}, run_id=None, losses=[1.0, 0.9, 0.8], steps=[0, 1, 2],
                          comm=None, comm_issue_order=[], cost_model=None, fields=list(TIMING_FIELDS),
                          timings_file=timing_file.close())
        runs[variant] = [{"repeat": 0, "summary": {"bubble_fraction": 0.1}, "summary_json": str(out)}]
    assert plot_comparison(runs, tmp_path / "timelines.png", "t").stat().st_size > 0
