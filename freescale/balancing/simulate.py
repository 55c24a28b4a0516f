"""Predicted step time and bubbles of a plan on K ranks: a seeded Monte Carlo over steps.

A plan gives every step's per-rank load in cost units, ``loads[s, k]``. One step on rank k::

    compute[s, k] = (seconds_per_cost * loads[s, k] + step_constant_s) * (1 + eps[s, k])
    step_time[s]  = max_k compute[s, k] + comm_latency_s + comm_seconds_per_sample * samples_per_rank

``step_constant_s`` is what every rank's compute takes every step whatever its samples (kernel
launches, host work): the cost model's per-step constant (``CostModel.step_constant_s``, fitted by
`freescale calibrate`). On a GPU it can outweigh the samples' own costs (9.2 ms on an H100,
against about 3.9 ms for a rank's 32 log-normal histories of mean length 500), and every rank
pays it, balanced or not, so it shrinks what balancing wins. It is part of each rank's compute,
not of the non-compute line, because the trainer measures it there (inside every rank's dense
compute), so the fractions count it as the trainer does; the noise multiplies it too, because
``eps`` is measured (``rank_noise``) as the spread of that whole compute, constant included.

``eps`` is per-rank noise, drawn independently for every (step, rank) from what a mirror-control
run measured (``--control mirror``: every rank computes the same samples, so any difference
between ranks is noise). The slowest of K noisy ranks sets the step, and the expected maximum of
K draws grows with K (about ``sigma * sqrt(2 ln K)`` for normal noise), so even a perfectly
balanced plan loses more to noise on more ranks; the Monte Carlo captures that without assuming
a distribution. The second line is everything in a step besides the slowest rank's compute
(collectives, optimizer, data hand-off), calibrated on measured runs as a latency plus a cost
per sample of the rank's batch; per-rank bytes of an all-to-all or a ring all-reduce hardly
change with K, and the latency is held constant (a lower bound when K grows).

The fractions are the trainer's (freescale/training/timing/bubbles.py), from the same per-step quantities:
``bubble_fraction = sum_s sum_k (max_k compute - compute) / (K * sum_s step_time)`` and
``idle_fraction = 1 - sum compute / (K * sum_s step_time)``, both written with
``freescale.balancing.metrics.bubble_of_totals`` (this package must not import the trainer's torch).

NumPy only: no Spark, no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from freescale.balancing.metrics import bubble_of_totals

NoiseDist = Literal["empirical", "normal"]
NOISE_DISTS: tuple[str, ...] = get_args(NoiseDist)

# Monte Carlo size: at least this many simulated steps, the plan's steps repeated with fresh noise;
# a repeat of a plan with K ranks costs K noise draws per step, so very large plans stop earlier.
MIN_SIMULATED_STEPS = 512
MAX_SIMULATED_CELLS = 1 << 24
# A rank cannot compute in negative time: the noise factor is floored (normal tails at large K).
MIN_NOISE_FACTOR = 0.05
# Peak memory of planning and simulating K x B x steps sample lengths, per sample: the lengths,
# their costs, the planner's order and assignment arrays. Measured on the lognormal lengths with
# B = 16 and 16 steps: 82-92 bytes per sample for kk over the whole window (the larger of the
# two plans a K gets) at K = 4,096 and 16,384, rounded up.
PLAN_BYTES_PER_SAMPLE = 96


def plan_memory_bytes(world_size: int, local_batch_size: int, steps: int) -> int:
    """About the most memory that planning and simulating ``steps`` steps on ``world_size`` ranks
    of ``local_batch_size`` samples takes."""
    return world_size * local_batch_size * steps * PLAN_BYTES_PER_SAMPLE


@dataclass(frozen=True)
class Noise:
    """Per-rank multiplicative noise of the compute, ``1 + eps``."""

    dist: NoiseDist = "normal"
    """``empirical``: eps drawn with replacement from ``residuals`` (what was measured, no tail
    beyond its largest value); ``normal``: eps ~ N(0, cv^2) (extrapolates the tail to large K)."""
    cv: float = 0.0
    """Standard deviation of eps (the coefficient of variation of a rank's compute)."""
    residuals: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """The measured eps values (``rank_noise``); required for ``empirical``."""

    def __post_init__(self) -> None:
        if self.dist not in NOISE_DISTS:
            raise ValueError(f"noise dist must be one of {NOISE_DISTS}, got {self.dist!r}")
        if not (math.isfinite(self.cv) and self.cv >= 0):
            raise ValueError(f"noise cv must be a finite number >= 0, got {self.cv!r}")
        if self.dist == "empirical" and len(self.residuals) == 0:
            raise ValueError("empirical noise needs measured residuals")

    @classmethod
    def measured(cls, residuals: np.ndarray, dist: NoiseDist = "empirical") -> "Noise":
        r = np.asarray(residuals, dtype=np.float64)
        return cls(dist=dist, cv=float(np.sqrt(np.mean(r**2))) if r.size else 0.0, residuals=r)

    def factors(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        """``1 + eps`` for every (step, rank) of ``shape``."""
        if self.dist == "empirical":
            eps = rng.choice(self.residuals, size=shape)
        elif self.cv > 0:
            eps = rng.normal(0.0, self.cv, size=shape)
        else:
            return np.ones(shape)
        return np.maximum(1.0 + eps, MIN_NOISE_FACTOR)


@dataclass(frozen=True)
class TimeModel:
    """Cost units -> seconds, the non-compute part of a step, and the noise."""

    seconds_per_cost: float = 1.0
    """Seconds of dense compute per cost unit (1.0: times stay in cost units)."""
    comm_latency_s: float = 0.0
    """Seconds per step outside compute that do not grow with the batch (collective latency, optimizer)."""
    comm_seconds_per_sample: float = 0.0
    """Seconds per step outside compute per sample of a rank's batch (bytes per sample / bandwidth)."""
    noise: Noise = field(default_factory=Noise)
    step_constant_s: float = 0.0
    """Seconds of every rank's compute every step whatever its samples (the cost model's per-step
    constant in this model's time unit); the noise multiplies it with the rest of the compute."""

    def __post_init__(self) -> None:
        for name in ("seconds_per_cost", "comm_latency_s", "comm_seconds_per_sample", "step_constant_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.seconds_per_cost <= 0:
            raise ValueError(f"seconds_per_cost must be > 0, got {self.seconds_per_cost!r}")

    def comm_s(self, samples_per_rank: float) -> float:
        return self.comm_latency_s + self.comm_seconds_per_sample * samples_per_rank


@dataclass(frozen=True)
class Prediction:
    """What the trainer would report for a plan, predicted (its summary's names and meanings)."""

    world_size: int
    plan_steps: int
    simulated_steps: int
    plan_bubble: float
    """The plan's own bubble (no noise, no per-step constant, compute only): ``freescale.balancing.metrics.bubble``
    of its loads."""
    step_time_s: float
    """Median step time."""
    bubble_fraction: float
    idle_fraction: float
    compute_s: float
    """Mean over steps of the slowest rank's compute (the per-step constant included)."""
    comm_s: float
    """The non-compute part of every step."""
    noise_max_factor: float
    """Mean over steps of max_k (1 + eps): how much the slowest of K noisy ranks costs."""

    @property
    def mean_step_time_s(self) -> float:
        """Mean step time (``step_time_s`` is the median): the comm part is the same every step."""
        return self.compute_s + self.comm_s

    def to_json(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def simulate(
    loads: np.ndarray,
    model: TimeModel,
    samples_per_rank: float,
    *,
    seed: int = 0,
    min_steps: int = MIN_SIMULATED_STEPS,
    max_cells: int = MAX_SIMULATED_CELLS,
) -> Prediction:
    """Predict step time, bubble_fraction and idle_fraction of ``loads`` ([steps, K] cost units).

    The plan's steps are repeated with fresh noise until ``min_steps`` steps are simulated (fewer
    when ``max_cells`` (steps x K) would be exceeded; at least one pass of the plan).
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2 or loads.shape[0] == 0 or loads.shape[1] == 0:
        raise ValueError(f"loads must be [steps, K] with steps, K >= 1, got shape {loads.shape}")
    if not np.all(np.isfinite(loads)) or loads.min() < 0:
        raise ValueError("loads must be finite and >= 0")
    steps, k = loads.shape
    repeats = max(1, min(-(-min_steps // steps), max_cells // (steps * k)))
    rng = np.random.default_rng(seed)
    comm = model.comm_s(samples_per_rank)
    base = loads * model.seconds_per_cost + model.step_constant_s
    sum_mean = sum_max = sum_time = sum_factor = 0.0
    step_times = []
    for _ in range(repeats):
        factors = model.noise.factors(rng, loads.shape)
        compute = base * factors
        slowest = compute.max(axis=1)
        step_time = slowest + comm
        sum_mean += float(compute.mean(axis=1).sum())
        sum_max += float(slowest.sum())
        sum_time += float(step_time.sum())
        sum_factor += float(factors.max(axis=1).sum())
        step_times.append(step_time)
    simulated = repeats * steps
    idle = bubble_of_totals(sum_mean, sum_time)
    return Prediction(
        world_size=k,
        plan_steps=steps,
        simulated_steps=simulated,
        plan_bubble=bubble_of_totals(float(loads.mean(axis=1).sum()), float(loads.max(axis=1).sum())),
        step_time_s=float(np.median(np.concatenate(step_times))),
        # sum(max - compute) / (K sum T) = (sum max - sum mean) / sum T
        bubble_fraction=idle - bubble_of_totals(sum_max, sum_time),
        idle_fraction=idle,
        compute_s=sum_max / simulated,
        comm_s=comm,
        noise_max_factor=sum_factor / simulated,
    )


# ----------------------------------------------------------------- calibration from measured runs


def rank_noise(compute: np.ndarray) -> np.ndarray:
    """eps samples from a mirror-control run's [steps, K] compute (K >= 2), flattened.

    Every rank of a step computed the same samples, so ``compute / step mean - 1`` is noise; the
    deviation from a mean of K draws has variance (1 - 1/K) sigma^2, hence the sqrt(K / (K-1)).
    """
    c = np.asarray(compute, dtype=np.float64)
    if c.ndim != 2 or c.shape[1] < 2:
        raise ValueError(f"rank noise needs [steps, K] compute with K >= 2, got shape {c.shape}")
    mean = c.mean(axis=1, keepdims=True)
    keep = mean[:, 0] > 0
    if not keep.any():
        raise ValueError("rank noise needs steps with positive compute")
    k = c.shape[1]
    return ((c[keep] / mean[keep] - 1.0) * math.sqrt(k / (k - 1))).ravel()


def fit_seconds_per_cost(cost: np.ndarray, compute: np.ndarray, step_constant: float = 0.0) -> float:
    """Seconds per cost unit: total measured compute over total planned cost (ratio of sums, the
    quantity the bubble's sums are made of). ``step_constant`` is the cost model's per-step
    constant in cost units: every measured (step, rank) compute holds it once, so it counts once
    per cell in the planned cost (else the fit would spread it over the samples' costs, and adding
    it to the prediction again would count it twice)."""
    cost = np.asarray(cost, dtype=np.float64)
    total_cost, total_compute = float(np.sum(cost)) + cost.size * step_constant, float(np.sum(compute))
    if not (total_cost > 0 and total_compute > 0):
        raise ValueError(f"seconds per cost needs positive cost and compute (got {total_cost}, {total_compute})")
    return total_compute / total_cost


def non_compute_s(compute: np.ndarray, step_time: np.ndarray) -> np.ndarray:
    """Per step: the step time beyond the slowest rank's compute (what the comm term models)."""
    return np.maximum(np.asarray(step_time) - np.asarray(compute).max(axis=1), 0.0)


def fit_comm(samples_per_rank: np.ndarray, other_s: np.ndarray) -> tuple[float, float]:
    """(latency_s, seconds_per_sample) of ``other = latency + per_sample * samples`` by least
    squares; with a single batch size there is no slope to fit: the mean, all latency."""
    x = np.asarray(samples_per_rank, dtype=np.float64)
    y = np.asarray(other_s, dtype=np.float64)
    if x.size == 0 or x.shape != y.shape:
        raise ValueError("fit_comm needs one non-compute time per batch size")
    if np.ptp(x) == 0:
        return max(float(y.mean()), 0.0), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0:  # a line through the origin fits better than a negative latency
        return 0.0, max(float((x * y).sum() / (x * x).sum()), 0.0)
    if slope < 0:
        return max(float(y.mean()), 0.0), 0.0
    return float(intercept), float(slope)


# ----------------------------------------------------------------- plans at any K from sample lengths


def sample_lengths(pool: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, bool]:
    """``n`` lengths from ``pool`` in a seeded random order: a shuffle of the first ``n`` when the
    pool is large enough, else drawn with replacement from its distribution (second value True)."""
    pool = np.asarray(pool)
    if pool.size == 0:
        raise ValueError("no sample lengths to draw from")
    rng = np.random.default_rng(seed)
    if pool.size >= n:
        return pool[rng.permutation(pool.size)[:n]], False
    return rng.choice(pool, size=n, replace=True), True


def lognormal_lengths(mu: float, sigma: float, n: int, seed: int, min_len: int, max_len: int) -> np.ndarray:
    """``round(exp(mu + sigma z))`` clipped to [min_len, max_len], as freescale/prepare/synthetic.py draws."""
    z = np.random.default_rng(seed).standard_normal(n)
    return np.clip(np.round(np.exp(mu + sigma * z)), min_len, max_len).astype(np.int64)
