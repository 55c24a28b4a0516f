"""Fitting the simulator's time model (``freescale.balancing.simulate.TimeModel``) to measured training runs,
and what its predictions say.

A run is a `freescale train --summary-json` file (with its timing file): every measured step's
per-rank dense compute, planned cost, sample count and step time, and the cost model its shards were costed with. From
runs this module fits seconds per cost unit and the non-compute part of a step (a latency plus a
per-sample slope), and from a mirror-control run (every rank the same samples) the per-rank noise.
Seconds per cost unit is only meaningful for plans costed by the runs' own cost model, hence the
checks on it. NumPy only, like the rest of ``balancing``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from freescale.balancing.simulate import Noise, TimeModel, fit_comm, fit_seconds_per_cost, non_compute_s, rank_noise
from freescale.runtime.errors import InputError

if TYPE_CHECKING:
    from freescale.costs.cost_model import CostModel


@dataclass(frozen=True)
class RunTimings:
    """One training run's measured steps (warm-up steps left out, as its summary does), [steps, K]."""

    path: str
    compute: np.ndarray
    cost: np.ndarray
    samples: np.ndarray
    step_time: np.ndarray
    """Per step: the slowest rank's whole step, as the trainer's bubbles divide by."""
    cost_model: dict | None
    """The JSON of the cost model ``cost`` is in (its shards'); None in a summary written before
    summaries named it."""


def read_run(path: str) -> RunTimings:
    """A `freescale train --summary-json` file's per-step, per-rank timings (its timing file, or the
    table it carries), read field by field."""
    from freescale.costs.run_summary import timing_table
    from freescale.runtime.json_files import read_json

    data = read_json(path, "run summary (freescale train --summary-json)")
    try:
        measured = int(data["summary"]["measured_steps"])
    except (KeyError, TypeError, ValueError):
        raise InputError(f"{path}: not a run summary (no summary.measured_steps)") from None
    timings = timing_table(data, path)
    missing = [n for n in ("dense_compute_s", "cost", "samples", "step_s") if n not in timings.fields]
    if missing:
        raise InputError(f"{path}: timings lack field {missing[0]!r}")
    if not 0 < measured <= len(timings):
        raise InputError(f"{path}: timings are not [steps, ranks, fields] with {measured} measured steps")
    skip = len(timings) - measured
    column = {name: timings.column(name)[skip:] for name in ("dense_compute_s", "cost", "samples", "step_s")}
    return RunTimings(path, column["dense_compute_s"], column["cost"], column["samples"],
                      column["step_s"].max(axis=1), data.get("cost_model"))


def mirror_noise(run: RunTimings, dist: str = "empirical") -> Noise:
    """The per-rank noise of a mirror-control run: its ranks computed the same samples every step,
    so their differences are noise. Any other run is refused (its differences are the plan's)."""
    if run.cost.shape[1] < 2:
        raise InputError(f"{run.path}: a 1-rank run shows no noise between ranks")
    uneven = np.flatnonzero(~np.isclose(run.cost, run.cost[:, :1], rtol=1e-9).all(axis=1))
    if uneven.size:
        raise InputError(f"{run.path}: not a mirror-control run (the ranks' planned costs differ in "
                         f"measured step {int(uneven[0])}); balance with --control mirror")
    return Noise.measured(rank_noise(run.compute), dist)


def runs_cost_model(runs: list[RunTimings]) -> tuple[CostModel | None, list[str]]:
    """The one cost model the runs' costs are in (None when no run names it), and the runs that do
    not name theirs. Seconds per cost unit fitted across runs of different cost models would mix
    units: refused."""
    from freescale.costs.cost_model import CostModel

    named = [(r.path, CostModel.from_json(r.cost_model, f"{r.path}: cost_model"))
             for r in runs if r.cost_model is not None]
    for path, model in named[1:]:
        if not model.same_costs(named[0][1]):
            raise InputError(f"--calibrate-from: {named[0][0]} and {path} were trained on shards of different "
                             "cost models; seconds per cost unit needs runs of one")
    return (named[0][1] if named else None), [r.path for r in runs if r.cost_model is None]


def describe_cost_model(model: CostModel) -> str:
    return str(model.provenance.get("source", model.kind))


def check_same_cost_model(plans_model: CostModel, runs_model: CostModel | None, runs: str) -> None:
    """Refuse plans costed by another model than the one the runs' seconds per cost unit is for
    (``runs`` names them in the message)."""
    if runs_model is not None and not plans_model.same_costs(runs_model):
        raise InputError(f"{runs}: its costs are in cost model "
                         f"{describe_cost_model(runs_model)}, the plans' is {describe_cost_model(plans_model)}; "
                         "pass --cost-model with the runs' cost model")


def fit_time_model(runs: list[RunTimings], step_constant: float = 0.0) -> tuple[float, float, float]:
    """Seconds per cost unit (total compute / total planned cost, the per-step constant counted
    once per step and rank: ``step_constant``, in cost units), and the non-compute part of a step
    (step time minus the slowest rank's compute) as a latency plus a per-sample slope across the
    runs' batch sizes (runs of one batch size give the latency alone)."""
    spc = fit_seconds_per_cost(np.concatenate([r.cost.ravel() for r in runs]),
                               np.concatenate([r.compute.ravel() for r in runs]), step_constant)
    latency, per_sample = fit_comm(np.array([r.samples.mean() for r in runs]),
                                   np.array([non_compute_s(r.compute, r.step_time).mean() for r in runs]))
    return spc, latency, per_sample


def predict(plans: dict, model: TimeModel, b: int, seed: int) -> list[dict]:
    """One row per K and plan ({K: {plan name: [steps, K] loads}}): the simulated step time,
    bubble_fraction, idle_fraction and the slowest rank's noise."""
    from freescale.balancing.simulate import simulate

    return [{"plan": name, **simulate(loads, model, b, seed=seed).to_json()}
            for k, by_plan in plans.items() for name, loads in by_plan.items()]


def reductions(rows: list[dict]) -> list[dict]:
    """Per K with both plans: how much of contiguous's bubble, idle time and step time balancing removes."""
    by_k: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_k.setdefault(row["world_size"], {})[row["plan"]] = row
    out = []
    for k, plans in by_k.items():
        if {"contiguous", "balanced"} <= plans.keys():
            c, bal = plans["contiguous"], plans["balanced"]
            out.append({"world_size": k, "bubble_reduction": _removed(c, bal, "bubble_fraction"),
                        "idle_reduction": _removed(c, bal, "idle_fraction"),
                        "speedup": c["step_time_s"] / bal["step_time_s"]})
    return out


def _removed(before: dict, after: dict, key: str) -> float:
    return 1.0 - after[key] / before[key] if before[key] > 0 else 0.0
