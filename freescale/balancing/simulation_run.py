"""`freescale simulate`'s work on a ``SimulationSpec`` (freescale/balancing/simulation_spec.py), NumPy only:
the time model (fitted on measured runs and/or given explicitly, with the per-step constant of the
plans' cost model) and the noise, the cost model the plans are costed with, and the plans the real
planner builds at every K. The Monte Carlo itself is freescale/balancing/simulate.py's, its fit to runs
freescale/balancing/time_model.py's; a shard set's plan and a prepared dataset's lengths are read by
freescale/shards/simulation.py, the memory check before planning freescale/balancing/plan_memory.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from freescale.balancing.plan_options import PlanOptions
from freescale.balancing.simulate import Noise, TimeModel, lognormal_lengths, sample_lengths
from freescale.balancing.simulation_spec import parse_lengths
from freescale.balancing.time_model import (RunTimings, check_same_cost_model, describe_cost_model, fit_time_model,
                                  mirror_noise, read_run, runs_cost_model)
from freescale.balancing.window import plan

if TYPE_CHECKING:
    from freescale.balancing.simulation_spec import SimulationSpec
    from freescale.costs.cost_model import CostModel

Plans = dict[int, dict[str, np.ndarray]]
"""{K: {plan name: [steps, K] loads in cost units}}."""


# ----------------------------------------------------------------------- measured runs


def build_noise(spec: SimulationSpec) -> tuple[Noise, dict]:
    """The per-rank noise (--noise-cv, --noise-from's mirror-control run, or none) and what it is."""
    if spec.noise_cv is not None:
        return Noise("normal", spec.noise_cv), {"noise": "normal", "noise_cv": spec.noise_cv}
    if not spec.noise_from:
        return Noise(), {"noise": "none"}
    noise = mirror_noise(read_run(spec.noise_from), spec.noise_dist or "empirical")
    return noise, {"noise": noise.dist, "noise_cv": noise.cv, "noise_from": spec.noise_from,
                   "noise_samples": int(noise.residuals.size)}


@dataclass(frozen=True)
class Measured:
    """What the --noise-from and --calibrate-from runs hold, read before anything is planned (a bad
    file fails first): the noise and what it is, the runs' timings and their shards' cost model."""

    noise: Noise
    described: dict
    runs: list[RunTimings]
    cost_model: CostModel | None
    """The --calibrate-from runs' cost model (None without runs, or when none names it)."""


def read_measured(spec: SimulationSpec, warn: Callable[[str], None]) -> Measured:
    """Read the runs; ``warn`` gets a line for each run that does not name its shards' cost model."""
    noise, described = build_noise(spec)
    runs = [read_run(path) for path in spec.calibrate_from or ()]
    runs_model = None
    if runs:
        runs_model, unnamed = runs_cost_model(runs)
        for path in unnamed:
            warn(f"{path} does not name its shards' cost model (a summary from before summaries did): its costs "
                 "are taken to be in the plans' cost model")
    return Measured(noise, described, runs, runs_model)


def step_constant_cost(model: CostModel, warn: Callable[[str], None]) -> float:
    """The cost model's per-step constant in its cost units: a model in seconds holds it as is (a
    cost unit is a second of the machine it was calibrated on); in any other unit seconds have no
    conversion, so it is left out, with a warning."""
    if model.unit == "seconds" or not model.step_constant_s:
        return model.step_constant_s
    warn(f"cost model {describe_cost_model(model)} names a per-step constant of {model.step_constant_s:.3g} s "
         f"but its costs are in {model.unit!r}, not seconds: the constant is left out")
    return 0.0


def build_time_model(spec: SimulationSpec, measured: Measured, plans_model: CostModel,
                     warn: Callable[[str], None]) -> tuple[TimeModel, dict]:
    """The fitted and explicit parts of the model and where each came from, for plans costed by
    ``plans_model``, whose per-step constant every rank pays every step.

    The constant is in cost units and converted with seconds per cost unit like the loads: as is
    for a model in seconds, scaled by --seconds-per-cost, and with --calibrate-from by the fitted
    seconds per cost unit, which is fitted with the constant counted once per measured step and
    rank (the runs' dense compute holds it) rather than spread over the samples' costs."""
    constant = step_constant_cost(plans_model, warn)
    spc, latency, per_sample = 1.0, 0.0, 0.0
    described = dict(measured.described)
    if measured.runs:
        spc, latency, per_sample = fit_time_model(measured.runs, constant)
        described["calibrate_from"] = list(spec.calibrate_from or ())
    if spec.seconds_per_cost is not None:
        spc = spec.seconds_per_cost
    if spec.comm_latency_s is not None:
        latency = spec.comm_latency_s
    if spec.comm_bytes_per_sample is not None:
        per_sample = spec.comm_bytes_per_sample / spec.comm_bandwidth
    # A cost model in seconds times in seconds: one cost unit is one second.
    in_seconds = bool(spec.calibrate_from or spec.seconds_per_cost) or plans_model.unit == "seconds"
    described.update(seconds_per_cost=spc, comm_latency_s=latency, comm_seconds_per_sample=per_sample,
                     step_constant_s=spc * constant, times_in="seconds" if in_seconds else "cost units")
    return TimeModel(spc, latency, per_sample, measured.noise, spc * constant), described


def check_runs_cost_model(plans_model: CostModel, runs_model: CostModel | None,
                          calibrate_from: tuple[str, ...] | None) -> None:
    """Refuse plans costed by another model than the --calibrate-from runs' (see check_same_cost_model)."""
    check_same_cost_model(plans_model, runs_model, f"--calibrate-from {calibrate_from[0]}"
                          if calibrate_from else "--calibrate-from")


# ----------------------------------------------------------------------- plans


def load_cost_model(path: str | None) -> CostModel:
    """The cost model at ``path``, else the built-in analytic one."""
    from freescale.costs.cost_model import CostModel, default_cost_model

    return CostModel.load(path) if path else default_cost_model()


def plans_cost_model(spec: SimulationSpec, runs_model: CostModel | None) -> CostModel:
    """What built plans are costed with: --cost-model, else the runs' own (the one their seconds per
    cost unit is for), else the built-in one; refused when it is not the runs'."""
    model = load_cost_model(spec.cost_model) if spec.cost_model or runs_model is None else runs_model
    check_runs_cost_model(model, runs_model, spec.calibrate_from)
    return model


def built_plans(spec: SimulationSpec, model: CostModel, pool: np.ndarray | None) -> tuple[Plans, dict]:
    """{K: {"contiguous": loads, "balanced": loads}} from the real planner, and what they are, on
    K x B x steps lengths: a seeded shuffle of ``pool`` (a prepared dataset's, drawn with
    replacement when it has fewer), or --lengths' lognormal without one."""
    b, window = spec.planned_batch_size, spec.planned_window_steps
    resampled = []
    plans = {}
    for k in spec.planned_world_sizes:
        n = k * b * spec.steps
        if pool is not None:
            lengths, drawn = sample_lengths(pool, n, spec.seed)
            if drawn:
                resampled.append(k)
        else:
            mu, sigma = parse_lengths(spec.lengths)
            lengths = lognormal_lengths(mu, sigma, n, spec.seed, spec.min_seq_len, spec.max_seq_len)
        costs = model.predict(lengths)
        plans[k] = {"contiguous": plan(costs, k, b, PlanOptions(strategy="contiguous", seed=spec.seed)).loads,
                    "balanced": plan(costs, k, b, spec.plan_options(), lengths=lengths).loads}
    what = {"source": "input" if spec.input else "lengths", "lengths": spec.input or spec.lengths,
            "local_batch_size": b, "steps": spec.steps, "balanced": f"{spec.strategy}, window {window} steps",
            "cost_model": describe_cost_model(model)}
    if pool is not None:
        what.update(dataset_samples=int(pool.size), resampled_world_sizes=resampled)
    return plans, what
