"""`freescale calibrate`: exact fitting and form choice on synthetic data, a real quick calibration, rank speeds.

The fitting tests time nothing: batch times are computed from a known cost, so
they are deterministic. The end-to-end tests time a tiny model for real and only
hold the results to loose bounds (the machine is shared and noisy). The import
tests hold the layering: the fits and the rank-speeds file are read without torch,
and a bad argument is reported before torch is loaded. The job's options are
``freescale.training.calibration.calibrate_spec.CalibrateSpec``'s; `freescale pipeline` calls ``freescale.jobs.calibrate.run`` with one.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import GPU_MACHINE_LACKS  # what the GPU benchmarks refuse to have loaded
from freescale.jobs import calibrate, cli
from freescale.costs import rank_speeds
from freescale.costs.calibration import (
    compare_forms,
    fit_form,
    hat_weights,
    held_out_lengths,
    nonnegative_least_squares,
    prediction_quality,
    quadratic_features,
)
from freescale.costs.cost_model import CostModel
from freescale.runtime.errors import InputError
from freescale.costs.rank_speeds import estimate_rank_speeds
from freescale.training.calibration.calibrate import calibration_batches, probe_lengths
from tests.helpers import sqlite_store

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY_MODULES = ("torch", "torchrec", "pyspark")

GRID = [16, 25, 40, 64, 102, 161, 256, 406, 645, 1024]
TINY_MODEL = ["--model.hstu.num_layers", "1", "--model.hstu.embedding_dim", "16", "--model.hstu.num_heads", "1",
              "--model.hstu.attention_dim", "8", "--model.hstu.linear_dim", "8", "--loss.num_negatives", "16"]


def synthetic_times(batches, per_sample, step_constant: float = 0.0) -> np.ndarray:
    """Exact batch times for a known per-sample cost function."""
    return np.array([step_constant + float(per_sample(np.asarray(b, dtype=np.float64)).sum()) for b in batches])


def split_by_grid(batches, grid):
    on_grid = [b for b in batches if b.probe_length in grid]
    off_grid = [b for b in batches if b.probe_length not in grid]
    return [b.lengths for b in on_grid], [b.lengths for b in off_grid]


def brute_force_nnls(features: np.ndarray, target: np.ndarray) -> float:
    """Smallest residual over every support whose unconstrained solution is non-negative."""
    best = float(target @ target)
    for size in range(1, features.shape[1] + 1):
        for support in itertools.combinations(range(features.shape[1]), size):
            solution, *_ = np.linalg.lstsq(features[:, list(support)], target, rcond=None)
            if (solution >= 0).all():
                best = min(best, float(np.sum((features[:, list(support)] @ solution - target) ** 2)))
    return best


# ----------------------------------------------------------------------------- fitting


def test_nnls_matches_exhaustive_search() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, cols = int(rng.integers(3, 10)), int(rng.integers(1, 5))
        features = rng.normal(size=(rows, cols)) * rng.choice([1e-3, 1.0, 1e3], cols)
        target = rng.normal(size=rows)
        x = nonnegative_least_squares(features, target)
        assert (x >= 0).all()
        residual = float(np.sum((features @ x - target) ** 2))
        assert residual <= brute_force_nnls(features, target) * (1 + 1e-9) + 1e-12


def test_quadratic_fit_recovers_exact_coefficients() -> None:
    a, b, c, d = 4e-8, 6e-6, 5e-4, 1.5e-3
    batches = [x.lengths for x in calibration_batches(GRID, 16, 1024, replicates=2, seed=0)]
    times = synthetic_times(batches, lambda L: a * L * L + b * L + c, step_constant=d)
    form = fit_form("quadratic", batches, times)
    got = (form.model.a, form.model.b, form.model.c, form.step_constant)
    np.testing.assert_allclose(got, (a, b, c, d), rtol=1e-6)


def test_negative_coefficient_is_clipped_to_the_best_non_negative_fit() -> None:
    # Unconstrained least squares wants b < 0 here (the cost bends down at small L).
    batches = [x.lengths for x in calibration_batches(GRID, 16, 1024, replicates=2, seed=1)]
    times = synthetic_times(batches, lambda L: 1e-6 * L * L - 1e-4 * L + 0.05)
    features = quadratic_features(batches) / times[:, None]
    unconstrained, *_ = np.linalg.lstsq(features, np.ones(len(times)), rcond=None)
    assert unconstrained[1] < 0

    form = fit_form("quadratic", batches, times)
    coef = np.array([form.model.a, form.model.b, form.model.c, form.step_constant])
    assert form.model.b == 0.0 and (coef >= 0).all()
    residual = float(np.sum((features @ coef - 1.0) ** 2))
    assert residual == pytest.approx(brute_force_nnls(features, np.ones(len(times))), rel=1e-9)


def test_table_weights_reproduce_cost_model_predictions() -> None:
    knots, costs = [16.0, 40.0, 100.0, 400.0], [1.0, 2.0, 7.0, 40.0]
    model = CostModel(kind="table", lengths=knots, costs=costs)
    lengths = np.array([10, 16, 30, 40, 99, 250, 400, 600])  # inside, on the knots and beyond both ends
    np.testing.assert_allclose(hat_weights(lengths, knots) @ np.array(costs), model.predict(lengths))


def test_table_fit_recovers_knot_costs_and_never_decreases() -> None:
    knots = [16, 40, 100, 256, 1024]
    true_costs = np.array([1e-3, 1.5e-3, 4e-3, 1.2e-2, 9e-2])
    batches = [x.lengths for x in calibration_batches(knots, 16, 1024, replicates=3, seed=4)]
    exact = synthetic_times(batches, lambda L: hat_weights(L, knots) @ true_costs, step_constant=2e-3)
    form = fit_form("table", batches, exact, knots)
    np.testing.assert_allclose(form.model.costs, true_costs, rtol=1e-6)
    assert form.step_constant == pytest.approx(2e-3, rel=1e-6)
    # 5% noise on every batch: the knots may move, but never downwards with length.
    noisy = exact * np.random.default_rng(0).lognormal(0, 0.05, len(exact))
    assert np.all(np.diff(fit_form("table", batches, noisy, knots).model.costs) >= 0)


def test_chooser_picks_quadratic_on_quadratic_data() -> None:
    batches = calibration_batches(sorted(GRID + held_out_lengths(GRID)), 16, 1024, replicates=2, seed=2)
    fit, held = split_by_grid(batches, GRID)

    def cost(L):
        return 4e-8 * L * L + 6e-6 * L + 5e-4

    choice = compare_forms(fit, synthetic_times(fit, cost, 1e-3), GRID, held, synthetic_times(held, cost, 1e-3))
    assert choice.chosen == "quadratic", choice.reason
    assert choice.scores["quadratic"].cv_rms < 1e-6
    assert choice.scores["table"].cv_rms > choice.scores["quadratic"].cv_rms


def test_chooser_picks_table_when_cost_grows_faster_than_quadratic() -> None:
    batches = calibration_batches(sorted(GRID + held_out_lengths(GRID)), 16, 1024, replicates=2, seed=3)
    fit, held = split_by_grid(batches, GRID)

    def cost(L):
        return 1e-9 * L**2.6 + 1e-4

    choice = compare_forms(fit, synthetic_times(fit, cost), GRID, held, synthetic_times(held, cost))
    assert choice.chosen == "table", choice.reason
    assert choice.scores["table"].cv_rms < 0.5 * choice.scores["quadratic"].cv_rms


def test_probe_lengths_are_distinct_with_the_nominal_mean() -> None:
    for length in (2, 16, 25, 64, 1024):
        for count in (1, 2, 3, 9, 16, 40):
            probes = probe_lengths(length, count)
            assert len(set(probes)) == len(probes) <= count
            assert sum(probes) == length * len(probes)
            assert all(0.75 * length <= p <= 1.25 * length for p in probes)


def test_prediction_quality_compares_ratios_not_scale() -> None:
    measured = np.array([1.0, 2.0, 4.0, 8.0])
    exact = prediction_quality(measured * 1000, measured)
    assert exact.correlation == pytest.approx(1.0) and exact.median_abs_error == pytest.approx(0.0, abs=1e-12)
    flat = prediction_quality(np.ones(4), measured)
    assert flat.median_abs_error > 0.3


# ------------------------------------------------------------------------ rank speeds


def test_rank_speeds_real_difference_is_significant() -> None:
    rng = np.random.default_rng(0)
    load = rng.uniform(0.8, 1.5, size=(40, 1))  # machine load shared by both ranks in a repeat
    times = load * np.array([1.0, 1.10]) * rng.lognormal(0, 0.02, size=(40, 2))
    speeds = estimate_rank_speeds(times)
    assert speeds.significant, speeds.reason
    assert np.mean(speeds.capacities) == pytest.approx(1.0)
    assert speeds.capacities[0] > 1.0 > speeds.capacities[1]
    assert speeds.ci_low[0] > 1.0 and speeds.ci_high[1] < 1.0


def test_rank_speeds_noise_or_tiny_difference_is_not_significant() -> None:
    rng = np.random.default_rng(1)
    noise = estimate_rank_speeds(rng.lognormal(0, 0.1, size=(20, 2)))
    assert not noise.significant
    tiny = estimate_rank_speeds(np.array([1.0, 1.01]) * rng.lognormal(0, 0.001, size=(40, 2)))
    assert not tiny.significant and "not worth" in tiny.reason


def write_speeds(path: Path, capacities, **extra) -> Path:
    path.write_text(json.dumps({"format": rank_speeds.FORMAT, "capacities": capacities, **extra}))
    return path


@pytest.mark.parametrize("significant", [True, False])
def test_rank_speeds_file_round_trip(tmp_path, significant) -> None:
    speeds = rank_speeds.RankSpeeds(capacities=(1.1, 0.9), ci_low=(1.05, 0.85), ci_high=(1.15, 0.95),
                                    confidence=0.95, significant=significant, reason="test", spread=0.22)
    document = rank_speeds.rank_speeds_document(speeds, {"host": "h"})
    path = tmp_path / "sub" / "speeds.json"
    text = rank_speeds.write_rank_speeds(path, document)
    assert path.read_text() == text == json.dumps(document, indent=2) + "\n"
    assert list(path.parent.iterdir()) == [path]  # the temporary sibling was renamed, not left behind
    expected = (1.1, 0.9) if significant else (1.0, 1.0)  # no real difference: equal capacities
    assert rank_speeds.read_rank_speeds(path) == expected
    assert document["provenance"]["measured_capacities"] == [1.1, 0.9]
    assert document["provenance"]["min_difference"] == rank_speeds.MIN_SPEED_DIFFERENCE


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.spawns
def test_fits_and_rank_speeds_reader_load_no_torch(tmp_path) -> None:
    """The pure half is usable where the cost model is: balance reads rank speeds without torch."""
    path = write_speeds(tmp_path / "speeds.json", [1.05, 0.95])
    code = ("import sys; import freescale.costs.calibration; from freescale.costs.rank_speeds import read_rank_speeds; "
            f"print(read_rank_speeds({str(path)!r}), sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))")
    run = run_python(code)
    assert run.stdout.strip() == "(1.05, 0.95) []", (run.stdout, run.stderr)


def parse_capacities(text: str, world_size: int) -> tuple[float, ...]:
    """balance's --capacities, as its spec parses it."""
    from freescale.shards.balance_spec import parse_capacities as parse

    return parse(text, {"world_size": world_size})


def test_balance_capacities_accept_rank_speeds_file(tmp_path) -> None:
    speeds = write_speeds(tmp_path / "speeds.json", [1.05, 0.95], ci=[[1.0, 1.1], [0.9, 1.0]], significant=True)
    assert parse_capacities(f"@{speeds}", 2) == (1.05, 0.95)
    assert parse_capacities("1.0,0.9", 2) == (1.0, 0.9)  # the comma form still works


@pytest.mark.parametrize("content, words", [
    ("not json", ["not valid JSON"]),
    (json.dumps({"format": "other", "capacities": [1, 1]}), ["not a rank speeds file"]),
    (json.dumps({"format": rank_speeds.FORMAT, "capacities": [1.0, -1.0]}), ["positive numbers"]),
    (json.dumps({"format": rank_speeds.FORMAT, "capacities": [1.0, 1.0, 1.0]}), ["3 capacities", "2"]),
])
def test_balance_rejects_bad_rank_speeds_file_naming_it(tmp_path, content, words) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InputError) as err:
        parse_capacities(f"@{path}", 2)
    message = str(err.value)
    assert str(path) in message and "\n" not in message
    assert all(w in message for w in words), message
    with pytest.raises(InputError, match="does not exist"):
        parse_capacities(f"@{tmp_path / 'missing.json'}", 2)


# ------------------------------------------------------------------------- the job


@pytest.mark.parametrize("extra, message", [
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--lengths", "16,64"], "need at least 3 distinct lengths, got [16, 64]"),
    (["--model.hstu.num_layers", "0"], "command line: model.hstu: num_layers must be >= 1, got 0"),
    (["--world-size", "0"], "override '--world-size': expected --section.key VALUE"),
])
@pytest.mark.spawns
def test_bad_argument_is_reported_before_torch_is_loaded(tmp_path, extra, message) -> None:
    """Checked before the imports that load torch (seconds), as for balance."""
    argv = ["calibrate", "--output", str(tmp_path / "cm.json"), "--tracking-uri", "none", *extra]
    code = (f"import sys; from freescale.jobs import cli; rc = cli.main({argv!r}); "
            f"print(rc, sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))")
    run = run_python(code)
    assert run.stdout.split("\n")[0] == "2 []", (run.stdout, run.stderr)
    assert run.stderr.strip().splitlines() == [f"freescale calibrate: error: {message}"]


@pytest.mark.parametrize("extra, words", [
    (["--lengths", "16,abc,64"], ["--lengths", "'abc'"]),
    (["--lengths", "16,0,64"], ["--lengths", "0", "positive"]),
    (["--lengths", "16,-4,64"], ["-4", "positive"]),
    (["--lengths", "16,64"], ["at least 3"]),
    (["--repeats", "0"], ["--repeats"]),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, extra, words) -> None:
    rc = cli.main(["calibrate", "--output", str(tmp_path / "cm.json"), "--tracking-uri", "none", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("freescale calibrate: error:") and all(w in err for w in words), err
    assert not (tmp_path / "cm.json").exists()


def test_the_options_are_the_specs_and_its_typed_entry_checks_them(tmp_path, capsys, fresh_log) -> None:
    """The command line is derived from CalibrateSpec (plus the tracking options); the pipeline's entry,
    ``run`` with a spec built from values, reports a bad value as the command line does: one line, exit 2."""
    from freescale.runtime import options
    from freescale.training.calibration.calibrate_spec import CalibrateSpec
    from freescale.tracking.store import Tracking

    flags = {a.dest for a in calibrate.build_parser()._actions} - {"help", "tracking_uri", "experiment"}
    assert flags == {f.name for f in dataclasses.fields(CalibrateSpec)}
    values = {"output": str(tmp_path / "cm.json"), "held_out_batches": 2}
    rc = calibrate.run(lambda: options.from_values(CalibrateSpec, values), [], Tracking("none"))
    assert rc == 2 and capsys.readouterr().err.strip().splitlines() == [
        "freescale calibrate: error: --held-out-batches must be 0 or at least 3 (a correlation needs them), got 2"]
    spec = options.from_values(CalibrateSpec, {"output": str(tmp_path / "cm.json"), "lengths": "64, 16,16,32"})
    assert spec.length_grid == [16, 32, 64] and (spec.repeats, spec.device, spec.nproc_per_node) == (7, "auto", 2)


def test_existing_output_needs_overwrite(tmp_path, capsys) -> None:
    out = tmp_path / "cm.json"
    out.write_text("{}")
    rc = calibrate.main(["--output", str(out), "--tracking-uri", "none"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "already exists" in err and "--overwrite" in err and len(err.splitlines()) == 1
    assert out.read_text() == "{}"


@pytest.mark.spawns  # in process, but its record runs git (code_version) and uname -p (platform.processor)
def test_quick_calibration_end_to_end(tmp_path, capsys) -> None:
    """A real (tiny) calibration: a loadable model with provenance, and a held-out check that holds up."""
    out = tmp_path / "cost_model.json"
    tracking = sqlite_store(tmp_path / "mlflow.db")
    rc = calibrate.main(["--output", str(out), "--lengths", "16,64,256", "--repeats", "3",
                         "--held-out-batches", "12", "--tracking-uri", tracking, *TINY_MODEL])
    report = capsys.readouterr().out
    assert rc == 0, report
    model = CostModel.load(out)
    assert model.kind in ("quadratic", "table") and model.unit == "seconds" and model.per_id == 0.0
    prov = model.provenance
    for key in ("host", "platform", "torch", "torch_threads", "created", "config", "chosen", "reason", "fits",
                "validation", "settings"):
        assert key in prov, key
    assert prov["chosen"] == model.kind and prov["config"]["model"]["hstu"]["num_layers"] == 1
    assert prov["precision"] == "fp32" and prov["config"]["training"] == {"precision": "fp32", "cuda_graphs": "off"}
    assert prov["cuda_graphs"] == "off"
    cpu = prov["fits"]["cpu"]
    for kind in ("quadratic", "table"):
        # How well the fits predict is a measurement (full repeats, quiet machine: README table and
        # benchmarks/), not a test: under load a 3-round fit scored 0.45. Here: a fit was scored.
        assert np.isfinite(cpu[kind]["r2"]) and cpu[kind]["r2"] <= 1.0
        assert np.isfinite(cpu[kind]["cv_rms_relative_error"])
        assert set(cpu[kind]["relative_error_by_length"]) == {"16", "32", "64", "128", "256"}
    assert -1.0 <= prov["validation"][model.kind]["correlation"] <= 1.0, report
    assert "Held-out mixed batches" in report and "R^2" in report

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking)
    runs = client.search_runs([client.get_experiment_by_name("freescale").experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["freescale.job"] == "calibrate"
    assert "heldout_correlation" in runs[0].data.metrics
    assert runs[0].data.params["training.precision"] == "fp32"
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"cost_model.json", "calibration_report.txt"} <= artifacts


@pytest.mark.spawns  # in process, but its provenance runs uname -p (platform.processor)
def test_calibration_times_the_configs_precision(tmp_path, capsys, monkeypatch) -> None:
    """``training.precision`` reaches the timed model and is recorded (about a second)."""
    import freescale.training.calibration.calibrate

    built = []
    build = freescale.training.calibration.calibrate.build_dense_model

    def spy(*args, **kwargs):
        model, table = build(*args, **kwargs)
        built.append(model)
        return model, table

    monkeypatch.setattr(freescale.training.calibration.calibrate, "build_dense_model", spy)
    out = tmp_path / "cost_model.json"
    # Lengths up to 1024 and 3 rounds: with 4-16 and one round, the fit sometimes put every cost into the
    # step constant (exit 2: a model of zero costs), and on a loaded machine 16,64,256 did too for bf16.
    rc = calibrate.main(["--output", str(out), "--lengths", "16,256,1024", "--repeats", "3", "--warmup", "1",
                         "--replicates", "1", "--held-out-batches", "0", "--device", "cpu", "--tracking-uri", "none",
                         "--training.precision", "bf16", *TINY_MODEL])
    report, err = capsys.readouterr()
    assert rc == 0, report + err
    assert [model.precision for model in built] == ["bf16"]
    prov = CostModel.load(out).provenance
    assert prov["precision"] == "bf16" and prov["config"]["training"] == {"precision": "bf16", "cuda_graphs": "off"}
    assert "precision bf16" in report and "encoder in bf16" in report


@pytest.mark.spawns  # in process, but its provenance runs uname -p (platform.processor)
def test_failed_rank_speeds_keep_the_cost_model_and_exit_1(tmp_path, capsys, monkeypatch) -> None:
    """Ranks that fail end the job with its error line and exit 1 after the cost model was written."""
    from freescale.launch import rank_speed_launch

    def fail(spec, overrides):
        raise rank_speed_launch.RankSpeedsFailed("rank-speed ranks failed (exit 1):\nboom")

    monkeypatch.setattr(rank_speed_launch, "measure_rank_speeds", fail)
    out, speeds = tmp_path / "cost_model.json", tmp_path / "rank_speeds.json"
    rc = calibrate.main(["--output", str(out), "--lengths", "16,64,256", "--repeats", "3", "--warmup", "1",
                         "--replicates", "1", "--held-out-batches", "0", "--device", "cpu", "--tracking-uri", "none",
                         "--rank-speeds-output", str(speeds), *TINY_MODEL])
    err = capsys.readouterr().err
    assert rc == 1 and out.exists() and not speeds.exists()
    assert (f"freescale calibrate: error: rank-speed ranks failed (exit 1):\nboom\n(the cost model {out} was "
            "written; no rank speeds were)") in err


@pytest.mark.slow
def test_rank_speeds_with_two_ranks(tmp_path, capsys) -> None:
    out, speeds = tmp_path / "cost_model.json", tmp_path / "rank_speeds.json"
    rc = calibrate.main(["--output", str(out), "--lengths", "16,64,256", "--repeats", "1", "--warmup", "1",
                         "--held-out-batches", "0", "--rank-speeds-output", str(speeds), "--nproc-per-node", "2",
                         "--rank-speed-repeats", "8", "--tracking-uri", "none", *TINY_MODEL])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    document = json.loads(speeds.read_text())
    assert document["format"] == rank_speeds.FORMAT
    assert len(document["capacities"]) == 2 and np.mean(document["capacities"]) == pytest.approx(1.0)
    assert len(document["ci"]) == 2 and isinstance(document["significant"], bool)
    measured = document["provenance"]["measured_capacities"]
    assert np.mean(measured) == pytest.approx(1.0)
    if not document["significant"]:
        assert document["capacities"] == [1.0, 1.0]
    assert parse_capacities(f"@{speeds}", 2) == tuple(document["capacities"])
    with pytest.raises(InputError, match="--world-size is 3"):
        parse_capacities(f"@{speeds}", 3)
    assert "Rank speeds" in captured.out




@pytest.mark.spawns
def test_calibrate_times_the_model_with_torch_alone(tmp_path):
    """`freescale calibrate` on a machine with only torch, triton and numpy: the timing path (model
    without TorchRec tables, a plain item table) imports none of GPU_MACHINE_LACKS, which are made
    unimportable here, and a missing mlflow is one warning. On CPU: the CUDA path differs only in
    its clock (freescale/training/calibration/calibrate.py, _time_cuda_step), which needs a GPU to run."""
    probe = (
        "import importlib.abc, json, sys\n"
        f"lacks = {GPU_MACHINE_LACKS!r}\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in lacks:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Absent())\n"
        "from freescale.jobs.cli import main\n"
        f"rc = main(['calibrate', '--output', {str(tmp_path / 'cost.json')!r}, '--lengths', '16,64,256',\n"
        "            '--repeats', '1', '--held-out-batches', '0', '--device', 'cpu',\n"
        "            '--model.hstu.num_layers', '1'])\n"
        "print(json.dumps([rc, sorted({m.split('.')[0] for m in sys.modules} & set(lacks))]))\n")
    # A bare machine's environment: nothing an earlier test of the session left in os.environ.
    environ = __import__("os").environ
    env = {k: environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR", "TRITON_INTERPRET") if k in environ}
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**env, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "FREESCALE_PROGRESS": "0"})
    assert run.returncode == 0, run.stderr[-2000:]
    rc, loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert (rc, loaded) == (0, []), run.stderr[-3000:]
    assert CostModel.load(tmp_path / "cost.json").kind in ("quadratic", "table")
    warnings = [line for line in run.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "No module named 'mlflow'" in warnings[0], run.stderr
