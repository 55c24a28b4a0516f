"""`freescale simulate` and its model (freescale/balancing/simulate.py): the trainer's bubble definitions,
noise that costs more on more ranks, balancing that pays on heavy tails, the comm term, the fits
from measured runs, and the command's output and one-line errors."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from freescale.balancing.metrics import bubble
from freescale.balancing.simulate import (Noise, TimeModel, fit_comm, fit_seconds_per_cost, lognormal_lengths,
                                rank_noise, simulate)
from freescale.balancing.window import plan
from freescale.costs.cost_model import CostModel, default_cost_model
from tests.helpers import sqlite_store

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_JSON = default_cost_model().to_json()


def heavy_costs(n: int, seed: int = 0) -> np.ndarray:
    return default_cost_model().predict(lognormal_lengths(4.2, 0.9, n, seed, 20, 1024))


# ------------------------------------------------------------------ the model


def test_zero_noise_reproduces_the_plans_bubble():
    costs = heavy_costs(8 * 16 * 6)
    for strategy, window in (("contiguous", 1), ("kk", 1), ("kk", 6)):
        p = plan(costs, 8, 16, strategy=strategy, window_steps=window)
        predicted = simulate(p.loads, TimeModel(seconds_per_cost=2e-6), 16)
        assert predicted.bubble_fraction == pytest.approx(p.bubble, abs=1e-12)
        assert predicted.bubble_fraction == pytest.approx(bubble(p.loads), abs=1e-12)
        assert predicted.idle_fraction == pytest.approx(p.bubble, abs=1e-12)  # no comm: all idle time is bubble
        assert predicted.noise_max_factor == 1.0


def test_the_fractions_are_the_trainers_on_the_simulated_steps():
    """With noise and a comm term, the prediction equals freescale/training/timing/bubbles.py's bubble_fraction and
    idle_fraction of the very steps simulated (the same seed draws the same noise)."""
    from freescale.training.timing import bubbles

    loads = np.random.default_rng(1).uniform(1.0, 3.0, size=(40, 4))
    model = TimeModel(0.01, 0.004, 0.0005, Noise("normal", 0.2))
    predicted = simulate(loads, model, 8, seed=7, min_steps=40)
    compute = loads * 0.01 * model.noise.factors(np.random.default_rng(7), loads.shape)
    step_time = compute.max(axis=1) + 0.004 + 0.0005 * 8
    assert predicted.simulated_steps == 40
    assert predicted.bubble_fraction == pytest.approx(bubbles.bubble_fraction(compute, step_time), rel=1e-9)
    assert predicted.idle_fraction == pytest.approx(bubbles.idle_fraction(compute, step_time), rel=1e-9)
    assert predicted.step_time_s == pytest.approx(float(np.median(step_time)), rel=1e-9)


def test_noise_costs_more_on_more_ranks():
    """Equal loads (a perfectly balanced plan): the slowest of K noisy ranks sets every step, and
    its expected excess grows with K like the expected maximum of K normals (~ sigma sqrt(2 ln K))."""
    cv, results = 0.05, []
    for k in (2, 16, 256, 4096):
        results.append(simulate(np.ones((8, k)), TimeModel(noise=Noise("normal", cv)), 1, seed=0))
    factors = [r.noise_max_factor for r in results]
    bubbles_ = [r.bubble_fraction for r in results]
    assert factors == sorted(factors) and bubbles_ == sorted(bubbles_)
    assert results[0].plan_bubble == 0.0 and bubbles_[0] > 0
    # E[max of 2 normals] = sigma / sqrt(pi); E[max of 4096] ~ 3.6 sigma, between sqrt(2 ln K) - 1 and sqrt(2 ln K).
    assert factors[0] - 1 == pytest.approx(cv / math.sqrt(math.pi), rel=0.15)
    assert cv * (math.sqrt(2 * math.log(4096)) - 1) < factors[-1] - 1 < cv * math.sqrt(2 * math.log(4096))
    # Measured (empirical) noise grows too, until K draws reach the largest measured value.
    measured = Noise.measured(np.random.default_rng(3).normal(0, cv, 500))
    grown = [simulate(np.ones((8, k)), TimeModel(noise=measured), 1).bubble_fraction for k in (2, 64)]
    assert grown[0] < grown[1]


def test_balanced_predicts_a_lower_bubble_than_contiguous_on_heavy_tails():
    costs = heavy_costs(64 * 16 * 8, seed=2)
    model = TimeModel(1e-6, 0.01, 0.0, Noise("normal", 0.05))
    contiguous = simulate(plan(costs, 64, 16, strategy="contiguous").loads, model, 16)
    balanced = simulate(plan(costs, 64, 16, window_steps=8).loads, model, 16)
    assert contiguous.plan_bubble > 0.3 and balanced.plan_bubble < 0.1
    assert balanced.bubble_fraction < 0.5 * contiguous.bubble_fraction
    assert balanced.step_time_s < contiguous.step_time_s


def test_the_comm_term_adds_to_step_time():
    loads = np.random.default_rng(4).uniform(1.0, 2.0, size=(20, 8))
    alone = simulate(loads, TimeModel(0.01), 16)
    with_comm = simulate(loads, TimeModel(0.01, 0.003, 0.0002), 16)
    assert with_comm.step_time_s - alone.step_time_s == pytest.approx(0.003 + 0.0002 * 16)
    assert with_comm.comm_s == pytest.approx(0.0062)
    # The same waits over a longer step: a smaller bubble share, a larger idle share.
    assert with_comm.bubble_fraction < alone.bubble_fraction and with_comm.idle_fraction > alone.idle_fraction


# Two steps on two ranks, 12 cost units each way: contiguous leaves rank 0 or 1 waiting, balanced none.
CONTIGUOUS = np.array([[1.0, 5.0], [4.0, 2.0]])
BALANCED = np.array([[3.0, 3.0], [3.0, 3.0]])


def test_the_per_step_constant_is_every_ranks_compute():
    """compute = seconds_per_cost * load + constant on every rank: by hand, contiguous steps take
    max(1, 5) ms + 6 ms and max(4, 2) ms + 6 ms, balanced 3 ms + 6 ms; the same waits over longer
    steps are a smaller bubble, and the speedup shrinks from 4.5 / 3 to 10.5 / 9."""
    from freescale.balancing.time_model import predict, reductions

    plans = {2: {"contiguous": CONTIGUOUS, "balanced": BALANCED}}
    with_constant = TimeModel(0.001, step_constant_s=0.006)
    contiguous = simulate(CONTIGUOUS, with_constant, 4)
    assert contiguous.step_time_s == pytest.approx((0.011 + 0.010) / 2)  # the median of 11 ms and 10 ms
    assert contiguous.compute_s == contiguous.mean_step_time_s == pytest.approx(0.0105)
    # waits: (5 - 1) ms in step 0, (4 - 2) ms in step 1, over K x (11 + 10) ms of rank-time
    assert contiguous.bubble_fraction == pytest.approx(0.006 / (2 * 0.021))
    assert contiguous.idle_fraction == pytest.approx(contiguous.bubble_fraction)  # no comm: all idle is bubble
    assert contiguous.plan_bubble == pytest.approx(6 / (2 * 9))  # the plan's own, loads only
    assert simulate(BALANCED, with_constant, 4).step_time_s == pytest.approx(0.009)
    [reduced] = reductions(predict(plans, with_constant, 4, 0))
    assert reduced["speedup"] == pytest.approx(0.0105 / 0.009)
    [alone] = reductions(predict(plans, TimeModel(0.001), 4, 0))
    assert alone["speedup"] == pytest.approx(0.0045 / 0.003)
    # With comm, the constant stays compute: the idle share grows by the comm wait only.
    with_comm = simulate(CONTIGUOUS, TimeModel(0.001, 0.002, step_constant_s=0.006), 4)
    assert with_comm.idle_fraction == pytest.approx(1 - (0.007 + 0.011 + 0.010 + 0.008) / (2 * 0.025))


def test_noise_multiplies_the_per_step_constant_with_the_rest_of_the_compute():
    """The mirror runs' noise is the spread of the whole dense compute, constant included."""
    loads = np.random.default_rng(2).uniform(1.0, 3.0, size=(30, 4))
    model = TimeModel(0.01, noise=Noise("normal", 0.1), step_constant_s=0.05)
    predicted = simulate(loads, model, 8, seed=3, min_steps=30)
    compute = (loads * 0.01 + 0.05) * model.noise.factors(np.random.default_rng(3), loads.shape)
    assert predicted.step_time_s == pytest.approx(float(np.median(compute.max(axis=1))), rel=1e-12)
    with pytest.raises(ValueError, match="step_constant_s"):
        TimeModel(step_constant_s=-1.0)


def test_fits_recover_what_made_the_measurements():
    rng = np.random.default_rng(5)
    cost = np.repeat(rng.uniform(0.05, 0.1, size=(4000, 1)), 2, axis=1)  # a mirror run: equal costs per step
    compute = 0.9 * cost * (1 + rng.normal(0, 0.08, size=cost.shape))
    assert np.std(rank_noise(compute)) == pytest.approx(0.08, rel=0.05)
    assert fit_seconds_per_cost(cost, compute) == pytest.approx(0.9, rel=0.01)
    latency, per_sample = fit_comm(np.array([16.0, 32.0]), np.array([0.020 + 16 * 0.0004, 0.020 + 32 * 0.0004]))
    assert (latency, per_sample) == (pytest.approx(0.020), pytest.approx(0.0004))
    assert fit_comm(np.array([16.0]), np.array([0.03])) == (pytest.approx(0.03), 0.0)
    with pytest.raises(ValueError):
        rank_noise(compute[:, :1])


def test_seconds_per_cost_counts_the_constant_once_per_step_and_rank():
    """Measured compute = 0.9 s per cost unit x (samples' cost + the constant of 0.02 cost units):
    counting the constant in the fit recovers 0.9; leaving it out spreads it over the costs."""
    cost = np.random.default_rng(6).uniform(0.05, 0.1, size=(50, 4))
    compute = 0.9 * (cost + 0.02)
    assert fit_seconds_per_cost(cost, compute, 0.02) == pytest.approx(0.9, rel=1e-12)
    assert fit_seconds_per_cost(cost, compute) > 1.0


# ------------------------------------------------------------------ the command


def mirror_summary(path: Path, steps: int = 60, ranks: int = 2, seed: int = 0,
                   cost_model: dict | None = DEFAULT_MODEL_JSON) -> Path:
    """A `freescale train --summary-json` file of a mirror run (the trainer's field layout), of
    shards costed by `cost_model` (None: a summary from before summaries named it)."""
    from freescale.training.timing.bubbles import FIELD_INDEX, TIMING_FIELDS

    rng = np.random.default_rng(seed)
    table = np.zeros((steps, ranks, len(TIMING_FIELDS)))
    cost = rng.uniform(0.05, 0.1, size=(steps, 1))
    compute = cost * (1 + rng.normal(0, 0.05, size=(steps, ranks)))
    table[..., FIELD_INDEX["cost"]] = cost
    table[..., FIELD_INDEX["dense_compute_s"]] = compute
    table[..., FIELD_INDEX["samples"]] = 16
    table[..., FIELD_INDEX["step_s"]] = compute.max(axis=1, keepdims=True) + 0.02
    data = {"summary": {"measured_steps": steps - 2},
            "timings": {"fields": list(TIMING_FIELDS), "steps_ranks_fields": table.tolist()}}
    if cost_model is not None:
        data["cost_model"] = cost_model
    path.write_text(json.dumps(data))
    return path


def freescale(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "FREESCALE_LOG_DIR": str(tmp_path / "logs")}
    env.pop("FREESCALE_LOG_FILE", None)
    return subprocess.run([sys.executable, "-m", "freescale.jobs.cli", "simulate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.spawns
def test_the_command_prints_the_table_and_writes_json(tmp_path):
    summary = mirror_summary(tmp_path / "control.json")
    out = tmp_path / "sim.json"
    run = freescale("--lengths", "lognormal:4.2,0.9", "--world-sizes", "32,8", "--steps", "4", "--noise-from",
                    str(summary), "--calibrate-from", str(summary), "--tracking-uri", "none", "--json", str(out),
                    "--plot", str(tmp_path / "plot.png"), tmp_path=tmp_path)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[:2] for r in rows if r.split(" | ")[1] in ("contiguous", "balanced")] == [
        ["| 8", "contiguous"], ["| 8", "balanced"], ["| 32", "contiguous"], ["| 32", "balanced"]]
    result = json.loads(out.read_text())
    assert [(p["world_size"], p["plan"]) for p in result["predictions"]] == [
        (8, "contiguous"), (8, "balanced"), (32, "contiguous"), (32, "balanced")]
    assert result["model"]["noise"] == "empirical" and result["model"]["times_in"] == "seconds"
    assert result["model"]["comm_latency_s"] == pytest.approx(0.02, rel=0.3)
    for r in result["reductions"]:
        assert 0 < r["bubble_reduction"] <= 1 and r["speedup"] > 1
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--lengths", "lognormal:4.2,0.9", "--world-sizes", "0,8"], "--world-sizes: 0 is not a positive integer"),
    (["--lengths", "gamma:2,1"], "--lengths 'gamma:2,1': expected lognormal:MU,SIGMA with finite MU and SIGMA >= 0"),
    (["--lengths", "lognormal:4.2,0.9", "--noise-from", "missing.json"],
     "missing.json: run summary (freescale train --summary-json) does not exist"),
    (["--input", "no-such-dir"], "--input no-such-dir does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(fresh_log, tmp_path, capsys, args, message):
    from freescale.jobs import cli

    assert cli.main(["simulate", *args, "--tracking-uri", "none", "--json", str(tmp_path / "sim.json")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"freescale simulate: error: {message}\n"
    assert not (tmp_path / "sim.json").exists()


def test_a_run_that_is_not_a_mirror_control_is_refused_as_noise(fresh_log, tmp_path, capsys):
    from freescale.jobs import cli
    from freescale.training.timing.bubbles import FIELD_INDEX

    summary = mirror_summary(tmp_path / "balanced.json")
    data = json.loads(summary.read_text())
    data["timings"]["steps_ranks_fields"][5][1][FIELD_INDEX["cost"]] *= 1.5
    summary.write_text(json.dumps(data))
    assert cli.main(["simulate", "--lengths", "lognormal:4.2,0.9", "--noise-from", str(summary),
                     "--tracking-uri", "none"]) == 2
    assert capsys.readouterr().err == (f"freescale simulate: error: {summary}: not a mirror-control run (the ranks' "
                                       "planned costs differ in measured step 3); balance with --control mirror\n")


@pytest.mark.slow
def test_a_shard_set_is_simulated_at_its_own_size_and_tracked(movielens_shards, tmp_path):
    """The balance job's own plan, with zero noise and no comm term: its manifest's predicted
    bubble; the MLflow run holds the numbers and the plot."""
    import mlflow

    from freescale.jobs import simulate as job

    uri = sqlite_store(tmp_path / "mlflow.db")
    out = tmp_path / "sim.json"
    assert job.main(["--shards", str(movielens_shards), "--tracking-uri", uri, "--experiment", "sim-test",
                     "--json", str(out)]) == 0
    predicted = json.loads(out.read_text())["predictions"]
    manifest = json.loads((movielens_shards / "manifest.json").read_text())
    assert [(p["world_size"], p["plan"]) for p in predicted] == [(2, "kk")]
    assert predicted[0]["bubble_fraction"] == pytest.approx(manifest["stats"]["bubble"], abs=1e-6)
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sim-test").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["k2/kk/bubble_fraction"] == pytest.approx(predicted[0]["bubble_fraction"])
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"bubble_vs_k.png", "simulation.json"}
    with pytest.raises(SystemExit):
        job.build_parser().parse_args(["--shards", "x", "--input", "y"])
    assert job.main(["--shards", str(movielens_shards), "--world-sizes", "8", "--tracking-uri", "none"]) == 2


@pytest.mark.spawns
def test_the_command_loads_nothing_heavy_before_its_work():
    """Argument checks and the model are NumPy only: no torch, torchrec, pyspark or mlflow on import."""
    probe = ("import sys, freescale.jobs.simulate, freescale.balancing.simulate; "
             "print(sorted(m for m in ('torch', 'torchrec', 'pyspark', 'mlflow', 'matplotlib') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_runs_cost_model_costs_the_plans_and_another_is_refused(fresh_log, tmp_path, capsys):
    """Seconds per cost unit is fitted on the runs' cost column, so the plans must be costed by
    the same model: the runs' by default; another --cost-model, or runs of two models, are refused."""
    from freescale.jobs import cli
    from freescale.costs.cost_model import CostModel

    theirs = CostModel("quadratic", a=1e-6, b=1e-3, c=0.5, unit="seconds", provenance={"source": "theirs.json"})
    runs = mirror_summary(tmp_path / "runs.json", cost_model=theirs.to_json())
    out = tmp_path / "sim.json"
    common = ["simulate", "--lengths", "lognormal:4.2,0.9", "--world-sizes", "8", "--steps", "2",
              "--tracking-uri", "none", "--json", str(out)]
    assert cli.main([*common, "--calibrate-from", str(runs)]) == 0
    assert json.loads(out.read_text())["what"]["cost_model"] == "theirs.json"
    capsys.readouterr()
    out.unlink()

    other = tmp_path / "other.json"
    default_cost_model().save(other)
    assert cli.main([*common, "--calibrate-from", str(runs), "--cost-model", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"freescale simulate: error: --calibrate-from {runs}: its costs are in cost model "
                          "theirs.json") and "--cost-model" in err and len(err.splitlines()) == 1, err
    assert not out.exists()

    mixed = mirror_summary(tmp_path / "default.json")
    assert cli.main([*common, "--calibrate-from", str(runs), str(mixed)]) == 2
    assert "were trained on shards of different cost models" in capsys.readouterr().err

    old = mirror_summary(tmp_path / "old.json", cost_model=None)
    assert cli.main([*common, "--calibrate-from", str(old)]) == 0
    assert f"warning: {old} does not name its shards' cost model" in capsys.readouterr().err


@pytest.mark.spawns
def test_a_k_too_large_for_memory_is_refused_up_front_in_one_line(tmp_path):
    """The issue's command: 10 million ranks died with MemoryError (exit 1) after allocating. The
    memory the plans need is known from K x B x steps before any is taken: exit 2, one line
    naming K and the memory, at once."""
    import time

    started = time.perf_counter()
    run = freescale("--lengths", "lognormal:4.2,0.9", "--world-sizes", "8,10000000", "--tracking-uri", "none",
                    "--json", str(tmp_path / "sim.json"), tmp_path=tmp_path)
    assert time.perf_counter() - started < 10
    assert run.returncode == 2, run.stderr
    from freescale.balancing.simulate import PLAN_BYTES_PER_SAMPLE, plan_memory_bytes

    [line] = run.stderr.splitlines()
    gib = plan_memory_bytes(10_000_000, 16, 16) / 2**30
    assert line.startswith(f"freescale simulate: error: --world-sizes: K=10000000 needs about {gib:.3g} GiB to plan "
                           f"(10000000 ranks x 16 samples x 16 steps x {PLAN_BYTES_PER_SAMPLE} bytes), more than the ")
    assert " GiB of memory available here" in line
    assert run.stdout == "" and not (tmp_path / "sim.json").exists()


def test_the_memory_bound_is_the_largest_k_against_what_is_available(monkeypatch):
    from freescale.balancing import plan_memory as run
    from freescale.balancing.simulate import plan_memory_bytes

    monkeypatch.setattr(run, "available_memory_bytes", lambda: plan_memory_bytes(1000, 16, 16))
    run.check_plan_memory([8, 1000], 16, 16)  # exactly fits
    with pytest.raises(run.InputError, match=r"K=1001 needs about"):
        run.check_plan_memory([1001, 8], 16, 16)
    with pytest.raises(run.InputError, match=r"K=1000 needs about .* x 32 samples x 16 steps"):
        run.check_plan_memory([1000], 32, 16)
    monkeypatch.setattr(run, "available_memory_bytes", lambda: None)  # unknown (no /proc): no bound
    run.check_plan_memory([10**9], 16, 16)


def test_plan_memory_bytes_covers_what_planning_and_simulating_take():
    """The bound is honest: the traced peak of drawing, costing, planning (kk over the whole window,
    the larger of a K's two plans) and simulating K x B x steps samples stays under it."""
    import tracemalloc

    from freescale.balancing.simulate import plan_memory_bytes

    k, b, steps = 256, 16, 16
    tracemalloc.start()
    try:
        costs = heavy_costs(k * b * steps)
        simulate(plan(costs, k, b, window_steps=steps).loads, TimeModel(noise=Noise("normal", 0.1)), b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 0.5 * plan_memory_bytes(k, b, steps) < peak <= plan_memory_bytes(k, b, steps)


# ------------------------------------------------------------------ the library the command calls


def simulation_spec(**values):
    from freescale.balancing.simulation_spec import SimulationSpec
    from freescale.runtime import options

    return options.from_values(SimulationSpec, {"lengths": "lognormal:4.2,0.9", **values})


def test_the_spec_checks_in_the_commands_order_and_gives_the_planned_sizes():
    from freescale.runtime.errors import InputError

    spec = simulation_spec(world_sizes="64, 8,8", calibrate_from=["a.json"])
    assert spec.planned_world_sizes == [8, 64] and spec.planned_batch_size == 16
    assert spec.planned_window_steps == 16 and spec.calibrate_from == ("a.json",)
    assert simulation_spec(strategy="flops_kk").planned_window_steps == 1
    # --steps is checked before --local-batch-size (the parser lists them the other way round)
    with pytest.raises(InputError, match=r"^--steps must be a positive integer, got 0$"):
        simulation_spec(steps=0, local_batch_size=0)
    with pytest.raises(InputError, match=r"^--comm-latency-s is in seconds"):
        simulation_spec(comm_latency_s=0.1)
    with pytest.raises(InputError, match=r"^--world-sizes: 'x' is not an integer$"):
        simulation_spec(world_sizes="8,x")


def test_built_plans_resample_a_small_dataset_and_say_so(tmp_path):
    from freescale.balancing.simulation_run import built_plans

    spec = simulation_spec(world_sizes="2,8", local_batch_size=4, steps=2, lengths=None, input=str(tmp_path))
    pool = np.arange(20, 60)  # 40 samples: enough for K=2 (16), not for K=8 (64)
    plans, what = built_plans(spec, default_cost_model(), pool)
    assert {k: {name: loads.shape for name, loads in by_plan.items()} for k, by_plan in plans.items()} == {
        2: {"contiguous": (2, 2), "balanced": (2, 2)}, 8: {"contiguous": (2, 8), "balanced": (2, 8)}}
    assert what["source"] == "input" and what["lengths"] == str(tmp_path)
    assert what["dataset_samples"] == 40 and what["resampled_world_sizes"] == [8]
    assert what["balanced"] == "kk, window 2 steps"


def test_the_report_prints_the_tables_and_names_the_metrics(capsys):
    from freescale.balancing.simulation_report import plot_title, print_report, reduction_metrics, row_metrics

    what = {"source": "lengths", "lengths": "lognormal:4.2,0.9", "local_batch_size": 16, "cost_model": "analytic"}
    described = {"noise": "none", "seconds_per_cost": 1.0, "comm_latency_s": 0.0, "comm_seconds_per_sample": 0.0,
                 "times_in": "cost units"}
    rows = [{"world_size": 8, "plan": plan, "plan_bubble": b, "step_time_s": t, "bubble_fraction": b,
             "idle_fraction": b, "noise_max_factor": 1.0} for plan, b, t in (("contiguous", 0.2, 10.0),
                                                                             ("balanced", 0.05, 8.0))]
    reduced = [{"world_size": 8, "bubble_reduction": 0.75, "idle_reduction": 0.75, "speedup": 1.25}]
    print_report(what, described, rows, reduced)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("freescale simulate: lengths lognormal:4.2,0.9, B=16, cost model analytic; noise none")
    assert "| 8 | balanced | 0.0500 | 8 | 0.0500 | 0.0500 | x1.000 |" in out
    assert out[-1] == "| 8 | 75.0% | 75.0% | x1.250 |"
    assert row_metrics(rows)["k8/balanced/step_time_s"] == 8.0 and len(row_metrics(rows)) == 8
    assert reduction_metrics(reduced) == {"k8/bubble_reduction": 0.75, "k8/idle_reduction": 0.75, "k8/speedup": 1.25}
    assert plot_title(what) == "lengths lognormal:4.2,0.9, B=16"


# ------------------------------------------------------------------ the cost model's per-step constant


def seconds_model(constant: float | None, unit: str = "seconds") -> CostModel:
    """Quadratic, 1 ms x L^2 per sample, with a per-step constant of ``constant`` seconds (None: none named)."""
    provenance = {"source": "h100-like"} | ({} if constant is None else {"step_constant_s": constant})
    return CostModel("quadratic", a=1e-3, unit=unit, provenance=provenance)


def test_a_shard_sets_cost_model_constant_is_in_every_ranks_compute(fresh_log, tmp_path, capsys):
    """--shards with a manifest whose cost model names a constant: the step times, fractions and
    header are the hand computation's; without one, the manifest's plan bubble as before."""
    from freescale.jobs import cli
    from tests.helpers import read_all, reseal, write_shards

    rows = read_all(write_shards(tmp_path / "shards", world_size=2, local_batch=4, num_steps=7, max_len=6))
    loads = np.zeros((7, 2))
    np.add.at(loads, (rows["step"].to_numpy(), rows["rank"].to_numpy()), 1e-3 * rows["length"].to_numpy() ** 2)
    results = {}
    for name, constant in (("with", 0.005), ("without", None)):
        shards = write_shards(tmp_path / name, world_size=2, local_batch=4, num_steps=7, max_len=6)
        reseal(shards, lambda m, c=constant: m.update(cost_model=seconds_model(c).to_json()))
        out = tmp_path / f"{name}.json"
        assert cli.main(["simulate", "--shards", str(shards), "--tracking-uri", "none", "--json", str(out)]) == 0
        results[name] = (json.loads(out.read_text()), capsys.readouterr().out.splitlines()[0])
    (result, header), (plain, plain_header) = results["with"], results["without"]
    compute = loads + 0.005
    step_time = compute.max(axis=1)
    [predicted] = result["predictions"]
    assert predicted["step_time_s"] == pytest.approx(float(np.median(step_time)))
    assert predicted["bubble_fraction"] == pytest.approx(float((step_time[:, None] - compute).sum()
                                                               / (2 * step_time.sum())))
    assert predicted["idle_fraction"] == pytest.approx(predicted["bubble_fraction"])
    assert result["model"]["step_constant_s"] == 0.005 and result["model"]["times_in"] == "seconds"
    assert header.endswith("; per-step constant 5 ms on every rank (the cost model's, in its compute)"), header
    [before] = plain["predictions"]
    assert before["bubble_fraction"] == pytest.approx(before["plan_bubble"])
    assert before["bubble_fraction"] > predicted["bubble_fraction"]
    assert before["step_time_s"] == pytest.approx(float(np.median(loads.max(axis=1))))
    assert plain["model"]["step_constant_s"] == 0.0 and "per-step constant" not in plain_header


def test_the_constant_shrinks_the_speedup_of_built_plans(fresh_log, tmp_path, capsys):
    """--lengths with an H100-like cost model (small per-sample costs): without noise a constant c
    moves every step time by c, so the speedup becomes (contiguous + c) / (balanced + c)."""
    from freescale.jobs import cli

    steps = {}
    for name, constant in (("with", 0.0092), ("without", None)):
        model, out = tmp_path / f"{name}-model.json", tmp_path / f"{name}.json"
        seconds_model(constant).save(model)
        assert cli.main(["simulate", "--lengths", "lognormal:5.7,1.0", "--max-seq-len", "4096", "--world-sizes", "64",
                         "--local-batch-size", "8", "--steps", "4", "--cost-model", str(model), "--tracking-uri",
                         "none", "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        steps[name] = {p["plan"]: p["step_time_s"] for p in result["predictions"]}
        steps[name]["speedup"] = result["reductions"][0]["speedup"]
    capsys.readouterr()
    alone = steps["without"]
    assert steps["with"]["contiguous"] == pytest.approx(alone["contiguous"] + 0.0092)
    assert steps["with"]["speedup"] == pytest.approx((alone["contiguous"] + 0.0092) / (alone["balanced"] + 0.0092))
    assert 1 < steps["with"]["speedup"] < alone["speedup"]


def test_the_constant_is_converted_with_seconds_per_cost_or_left_out(tmp_path):
    """In cost units: as is for a model in seconds, times --seconds-per-cost; a relative model's has
    no unit to convert with (warned, left out); with --calibrate-from the fit counts it once per
    measured step and rank, so runs made of 0.9 s per cost unit give back 0.9 and 0.9 x the constant."""
    from freescale.balancing.simulation_run import build_time_model, read_measured
    from freescale.training.timing.bubbles import FIELD_INDEX

    warnings: list[str] = []
    for values, model, constant in (({}, seconds_model(0.005), 0.005), ({"seconds_per_cost": 2.0},
                                    seconds_model(0.005), 0.01), ({}, seconds_model(0.005, "relative"), 0.0),
                                    ({}, seconds_model(None), 0.0)):
        spec = simulation_spec(**values)
        time_model, described = build_time_model(spec, read_measured(spec, warnings.append), model, warnings.append)
        assert time_model.step_constant_s == described["step_constant_s"] == pytest.approx(constant)
    assert warnings == ["cost model h100-like names a per-step constant of 0.005 s but its costs are in 'relative', "
                        "not seconds: the constant is left out"]
    runs = mirror_summary(tmp_path / "runs.json", cost_model=seconds_model(0.02).to_json())
    data = json.loads(runs.read_text())
    table = np.asarray(data["timings"]["steps_ranks_fields"])
    table[..., FIELD_INDEX["dense_compute_s"]] = 0.9 * (table[..., FIELD_INDEX["cost"]] + 0.02)
    data["timings"]["steps_ranks_fields"] = table.tolist()
    runs.write_text(json.dumps(data))
    spec = simulation_spec(calibrate_from=[str(runs)])
    measured = read_measured(spec, warnings.append)
    time_model, described = build_time_model(spec, measured, measured.cost_model, warnings.append)
    assert time_model.seconds_per_cost == pytest.approx(0.9) and time_model.step_constant_s == pytest.approx(0.018)
    assert len(warnings) == 1
