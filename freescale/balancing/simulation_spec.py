"""`freescale simulate`'s options, declared once (freescale/runtime/options.py): the job's command line is
derived from ``SimulationSpec``, and the spec is what the simulation's library functions take
(freescale/balancing/simulation_run.py, freescale/shards/simulation.py).

Standard library, NumPy and the balancing registry's names only: the parser is built from it
before anything heavy loads.
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from freescale.balancing.plan_options import DEFAULT_FLOP_WIDTH, PlanOptions
from freescale.balancing.simulate import NoiseDist
from freescale.balancing.strategies import PER_BATCH, STRATEGIES, per_batch_conflict
from freescale.runtime import options
from freescale.runtime.errors import InputError
from freescale.runtime.options import option

LENGTHS_SPEC = re.compile(r"^lognormal:([^,]+),([^,]+)$")
# `--lengths lognormal:` clips as freescale/prepare/synthetic.py's generator does by default (its module
# imports Spark, so its defaults are not imported here).
MIN_LEN, MAX_LEN = 20, 1024
DEFAULT_WORLD_SIZES, DEFAULT_LOCAL_BATCH_SIZE = "8,64,256,1024", 16
BalancedStrategy = Literal[tuple(s for s in STRATEGIES if s != "contiguous")]  # type: ignore[valid-type]
SOURCES = ("input", "lengths", "shards")
"""Where the plans' sample lengths come from: exactly one is given."""


def parse_world_sizes(text: str) -> list[int]:
    sizes = []
    for item in text.split(","):
        try:
            k = int(item.strip())
        except ValueError:
            raise InputError(f"--world-sizes: {item.strip()!r} is not an integer") from None
        if k < 1:
            raise InputError(f"--world-sizes: {k} is not a positive integer")
        sizes.append(k)
    return sorted(set(sizes))


def parse_lengths(text: str) -> tuple[float, float]:
    """``lognormal:MU,SIGMA`` -> (mu, sigma)."""
    match = LENGTHS_SPEC.match(text.strip())
    try:
        mu, sigma = (float(match.group(1)), float(match.group(2))) if match else (math.nan, math.nan)
    except ValueError:
        mu = sigma = math.nan
    if not (math.isfinite(mu) and math.isfinite(sigma) and sigma >= 0):
        raise InputError(f"--lengths {text!r}: expected lognormal:MU,SIGMA with finite MU and SIGMA >= 0")
    return mu, sigma


@dataclass(frozen=True, kw_only=True)
class SimulationSpec:
    """What to simulate: the plans' source, the K to plan for, and the time model's parts.

    The numbers are checked together by :meth:`check` (as `freescale simulate` always did, in one
    order), not by the options' own ``positive``, so its error lines stay as they were."""

    SURFACES = ("cli",)

    input: str | None = option(None, "a prepared dataset (`freescale prepare`'s output): its sample lengths")
    lengths: str | None = option(None, "synthetic sample lengths, lognormal:MU,SIGMA (L = round(exp(MU + SIGMA z)))")
    shards: str | None = option(None, "a shard directory (`freescale balance`'s output): its own plan")
    world_sizes: str | None = option(None, f"ranks K to simulate, comma separated (default {DEFAULT_WORLD_SIZES}; "
                                           "with --shards: the manifest's)")
    local_batch_size: int | None = option(None, f"samples per rank per step B (default {DEFAULT_LOCAL_BATCH_SIZE}; "
                                                "with --shards: the manifest's)")
    steps: int = option(16, "steps planned per K (default 16)")
    window_steps: int | None = option(None, "the balanced plan's window (default: --steps; 1 for "
                                            "flops_kk, which balances each global batch alone)")
    strategy: BalancedStrategy = option("kk", "the balanced plan's strategy (default kk)")
    flop_width: int = option(DEFAULT_FLOP_WIDTH,
                             "the model width d in flops_kk's FLOP formula L^2 + 2.5*d*L (default %(default)s)")
    cost_model: str | None = option(None, "cost-model JSON (default: the --calibrate-from runs' shards' model, else "
                                          "the built-in analytic one; with --shards: the manifest's); runs given "
                                          "to --calibrate-from must use the same")
    min_seq_len: int = option(MIN_LEN, f"--lengths clip (default {MIN_LEN})")
    max_seq_len: int = option(MAX_LEN, f"--lengths clip (default {MAX_LEN})")
    noise_from: str | None = option(None, "a mirror-control run's --summary-json: the per-rank noise",
                                    exclusive="noise")
    noise_cv: float | None = option(None, "per-rank noise: normal with this coefficient of variation",
                                    exclusive="noise")
    noise_dist: NoiseDist | None = option(
        None, "with --noise-from: draw the measured values (empirical, default) or a normal of their spread")
    calibrate_from: tuple[str, ...] | None = option(
        None, "runs' --summary-json: seconds per cost unit and the comm term (latency + per sample)",
        metavar="SUMMARY")
    """Several files on a command line (``nargs="+"``, which freescale.runtime.options does not derive)."""
    seconds_per_cost: float | None = option(None, "seconds per cost unit (overrides --calibrate-from)")
    comm_latency_s: float | None = option(None, "seconds per step outside compute (overrides --calibrate-from)")
    comm_bytes_per_sample: float | None = option(None, "bytes a rank moves per sample per step "
                                                       "(with --comm-bandwidth; overrides --calibrate-from)")
    comm_bandwidth: float = option(1e9, "bytes/s per rank (default 1e9)")
    seed: int = option(0, "sample draw, plan and noise seed (default 0)")

    def __post_init__(self) -> None:
        if self.calibrate_from is not None:
            object.__setattr__(self, "calibrate_from", tuple(self.calibrate_from))

    @property
    def planned_world_sizes(self) -> list[int]:
        """The K to build plans for, ascending, each once."""
        return parse_world_sizes(self.world_sizes or DEFAULT_WORLD_SIZES)

    @property
    def planned_batch_size(self) -> int:
        return self.local_batch_size or DEFAULT_LOCAL_BATCH_SIZE

    @property
    def planned_window_steps(self) -> int:
        """The balanced plan's window: --window-steps, else 1 for a per-batch strategy, else --steps."""
        return self.window_steps or (1 if self.strategy in PER_BATCH else self.steps)

    def plan_options(self) -> PlanOptions:
        """What the balanced plan of every K is planned with."""
        return PlanOptions(window_steps=self.planned_window_steps, strategy=self.strategy, seed=self.seed,
                           flop_width=self.flop_width)

    def check(self) -> None:
        """Every value, and how they combine, before anything is read or planned (one line each)."""
        self._check_numbers()
        for flag, path in (("--input", self.input), ("--shards", self.shards)):
            if path and not Path(path).exists():  # before the MLflow run opens: a typo leaves no failed run
                raise InputError(f"{flag} {path} does not exist")
        if self.lengths:
            parse_lengths(self.lengths)
        if self.world_sizes:
            parse_world_sizes(self.world_sizes)
        if not self.shards:  # a shard set's plan exists already; built plans are sized by K first
            from freescale.balancing.plan_memory import check_plan_memory

            check_plan_memory(self.planned_world_sizes, self.planned_batch_size, self.steps)

    def _check_numbers(self) -> None:
        positive = [("--steps", self.steps), ("--window-steps", self.window_steps), ("--local-batch-size",
                    self.local_batch_size), ("--min-seq-len", self.min_seq_len), ("--max-seq-len", self.max_seq_len),
                    ("--flop-width", self.flop_width)]
        for flag, value in positive:
            if value is not None and value < 1:
                raise InputError(f"{flag} must be a positive integer, got {value}")
        conflict = per_batch_conflict(self.strategy, self.window_steps or 1, None)
        if conflict:
            raise InputError(conflict)
        if self.min_seq_len > self.max_seq_len:
            raise InputError(f"--min-seq-len {self.min_seq_len} is above --max-seq-len {self.max_seq_len}")
        for flag, value in (("--noise-cv", self.noise_cv), ("--comm-latency-s", self.comm_latency_s),
                            ("--comm-bytes-per-sample", self.comm_bytes_per_sample)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise InputError(f"{flag} must be a finite number >= 0, got {value}")
        for flag, value in (("--seconds-per-cost", self.seconds_per_cost), ("--comm-bandwidth", self.comm_bandwidth)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InputError(f"{flag} must be a positive number, got {value}")
        seconds = self.seconds_per_cost is not None or self.calibrate_from
        for flag, value in (("--comm-latency-s", self.comm_latency_s),
                            ("--comm-bytes-per-sample", self.comm_bytes_per_sample)):
            if value is not None and not seconds:
                raise InputError(f"{flag} is in seconds: give --seconds-per-cost or --calibrate-from so compute is too")
        if self.noise_dist and not self.noise_from:
            raise InputError("--noise-dist applies to --noise-from (--noise-cv is normal)")


def add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    """The spec's options on a command line, in `freescale simulate`'s order: exactly one of the
    sources (a required group, which freescale.runtime.options does not derive), then the rest, with
    --calibrate-from taking one or more files."""
    fields = options.on_surface(SimulationSpec, "cli")
    names = [f.name for f in fields]
    runs = names.index("calibrate_from")
    options.add_arguments(parser.add_mutually_exclusive_group(required=True), SimulationSpec, only=SOURCES)
    options.add_arguments(parser, SimulationSpec, only=tuple(names[len(SOURCES):runs]))
    calibrate = options.option_of(fields[runs])
    parser.add_argument("--calibrate-from", nargs="+", metavar=calibrate.metavar, help=calibrate.help)
    options.add_arguments(parser, SimulationSpec, only=tuple(names[runs + 1:]))
