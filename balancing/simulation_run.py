"""`freescale simulate`'s work on a ``SimulationSpec`` (balancing/simulation_spec.py), NumPy only:
the time model (fitted on measured runs and/or given explicitly) and the noise, the cost model the plans are costed with, and the plans the real
planner builds at every K. The Monte Carlo itself is balancing/simulate.py's, its fit to runs
balancing/time_model.py's; a shard set's plan and a prepared dataset's lengths are read by
shards/simulation.py, the memory check before planning balancing/plan_memory.py's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from balancing.simulate import Noise, TimeModel, lognormal_lengths, plan_loads, sample_lengths
from balancing.simulation_spec import parse_lengths
from balancing.time_model import (check_same_cost_model, describe_cost_model, fit_time_model, mirror_noise, read_run,
                                  runs_cost_model)

if TYPE_CHECKING:
    from balancing.simulation_spec import SimulationSpec
    from pipeline.cost_model import CostModel

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


def build_time_model(spec: SimulationSpec, warn: Callable[[str], None]) -> tuple[TimeModel, dict, CostModel | None]:
    """The fitted and explicit parts of the model, where each came from, and the cost model of the
    --calibrate-from runs (None without them). ``warn`` gets a line for each run that does not name
    its shards' cost model."""
    noise, described = build_noise(spec)
    spc, latency, per_sample = 1.0, 0.0, 0.0
    runs_model = None
    if spec.calibrate_from:
        runs = [read_run(path) for path in spec.calibrate_from]
        runs_model, unnamed = runs_cost_model(runs)
        for path in unnamed:
            warn(f"{path} does not name its shards' cost model (a summary from before summaries did): its costs "
                 "are taken to be in the plans' cost model")
        spc, latency, per_sample = fit_time_model(runs)
        described["calibrate_from"] = list(spec.calibrate_from)
    if spec.seconds_per_cost is not None:
        spc = spec.seconds_per_cost
    if spec.comm_latency_s is not None:
        latency = spec.comm_latency_s
    if spec.comm_bytes_per_sample is not None:
        per_sample = spec.comm_bytes_per_sample / spec.comm_bandwidth
    described.update(seconds_per_cost=spc, comm_latency_s=latency, comm_seconds_per_sample=per_sample,
                     times_in="seconds" if spec.calibrate_from or spec.seconds_per_cost else "cost units")
    return TimeModel(spc, latency, per_sample, noise), described, runs_model


def check_runs_cost_model(plans_model: CostModel, runs_model: CostModel | None,
                          calibrate_from: tuple[str, ...] | None) -> None:
    """Refuse plans costed by another model than the --calibrate-from runs' (see check_same_cost_model)."""
    check_same_cost_model(plans_model, runs_model, f"--calibrate-from {calibrate_from[0]}"
                          if calibrate_from else "--calibrate-from")


# ----------------------------------------------------------------------- plans


def load_cost_model(path: str | None) -> CostModel:
    """The cost model at ``path``, else the built-in analytic one."""
    from pipeline.cost_model import CostModel, default_cost_model

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
        plans[k] = {"contiguous": plan_loads(costs, k, b, "contiguous", 1, spec.seed),
                    "balanced": plan_loads(costs, k, b, spec.strategy, window, spec.seed, lengths, spec.flop_width)}
    what = {"source": "input" if spec.input else "lengths", "lengths": spec.input or spec.lengths,
            "local_batch_size": b, "steps": spec.steps, "balanced": f"{spec.strategy}, window {window} steps",
            "cost_model": describe_cost_model(model)}
    if pool is not None:
        what.update(dataset_samples=int(pool.size), resampled_world_sizes=resampled)
    return plans, what
