"""The balance job's options, declared once: `freescale balance`'s command line, the pipeline's
``[balance]`` section and `freescale compare`'s balanced variant are derived from ``BalanceSpec``
(freescale/runtime/options.py), and the spec itself is what the Spark planning takes (freescale/shards/spark_balance.py)
and ships to the executors.

A new option is one field here; it is on every surface in ``SURFACES`` unless it names its own.
Standard library and the balancing registry's names only: parsers are built from it before
anything heavy loads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from freescale.balancing.plan_options import DEFAULT_FLOP_WIDTH, PlanOptions
from freescale.balancing.strategies import STRATEGIES, per_batch_conflict
from freescale.balancing.types import LeftoverPolicy
from freescale.runtime.errors import InputError
from freescale.runtime.options import option

StrategyName = Literal[STRATEGIES]  # type: ignore[valid-type]  # the balancing registry's names
CLI = ("cli",)


def parse_capacities(text: str, values: dict[str, Any]) -> tuple[float, ...]:
    """``--capacities``: ``1.0,0.9`` or ``@rank_speeds.json`` (written by `freescale calibrate`),
    one per rank (``values["world_size"]``)."""
    world_size = values["world_size"]
    if text.startswith("@"):
        from freescale.costs.rank_speeds import read_rank_speeds

        path = text[1:]
        speeds = read_rank_speeds(path)  # InputError naming the file when it is bad
        if len(speeds) != world_size:
            raise InputError(f"--capacities file {path} has {len(speeds)} capacities, --world-size is {world_size}")
        return speeds
    try:
        speeds = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise InputError(f"--capacities {text!r}: expected {world_size} comma-separated numbers") from None
    if len(speeds) != world_size:
        raise InputError(f"--capacities has {len(speeds)} values, --world-size is {world_size}")
    bad = [v for v in speeds if not math.isfinite(v) or v <= 0]
    if bad:
        raise InputError(f"--capacities value {bad[0]} is not a positive number")
    return speeds


@dataclass(frozen=True, kw_only=True)
class BalanceSpec:
    """One shard set: its input and output, and what every window is planned with."""

    SURFACES = ("cli", "pipeline", "compare")
    """`freescale balance`'s options, the pipeline's [balance] keys, `freescale compare`'s balanced variant."""

    input: str = option(help="output directory of `freescale prepare` (holds sequences/)", surfaces=CLI)
    output: str = option(help="shard directory to create", surfaces=CLI)
    world_size: int = option(help="number of training ranks K", surfaces=CLI, positive=True)
    local_batch_size: int = option(help="samples per rank per step B", surfaces=CLI, positive=True)
    strategy: StrategyName = option("kk", "partition strategy",
                                    helps={"compare": "the balanced variant's strategy"})
    window_steps: int = option(1, "plan W global batches together so heavy samples can share steps", positive=True,
                               helps={"compare": "the balanced variant's --window-steps"})
    cost_model: str | None = option(None, "cost-model JSON (default: the built-in analytic model)", surfaces=CLI)
    token_cap: int | None = option(None, "per-rank cap on the sum of history lengths per step", positive=True,
                                   surfaces=("cli", "pipeline"))
    equal_counts: bool = option(False, "every rank gets B samples (+-1) per step", surfaces=("cli", "pipeline"))
    capacities: tuple[float, ...] | None = option(
        None, "relative rank speeds, comma separated, one per rank, or @FILE: a rank-speeds JSON written by "
              "`freescale calibrate`", surfaces=CLI, parse=parse_capacities)
    flop_width: int = option(DEFAULT_FLOP_WIDTH, "the model width d in flops_kk's FLOP formula L^2 + 2.5*d*L "
                                                 "(default %(default)s, the HSTU embedding_dim)",
                             positive=True, surfaces=CLI)
    seed: int = option(0, "shuffle and tie-break seed", surfaces=("cli", "pipeline"))
    time_limit: float | None = option(None, "seconds per step for the ortools strategy", positive=True,
                                      surfaces=("cli", "pipeline"))
    leftover: LeftoverPolicy = option("keep", "the last partial global batch: keep it as a short last step split "
                                              "over the ranks (default: every sample trains every epoch) or drop "
                                              "it (counted in the manifest)", surfaces=("cli", "pipeline"))
    control: Literal["mirror"] | None = option(
        None, "diagnostic shards: 'mirror' gives every rank the same samples each step", surfaces=CLI)
    overwrite: bool = option(False, "replace an existing output", surfaces=CLI)
    master: str | None = option(None, "Spark master (default: spark-submit's, else local[*])", surfaces=CLI)

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.local_batch_size

    @property
    def leftover_applied(self) -> str:
        """The leftover policy the plan follows: the mirror control fills whole steps only, so it drops."""
        return "drop" if self.control else self.leftover

    @property
    def window_size(self) -> int:
        return self.window_steps * self.global_batch_size

    def plan_options(self, window: int) -> PlanOptions:
        """What window ``window`` is planned with: its own seed, so windows do not share tie-breaking."""
        return PlanOptions(window_steps=self.window_steps, strategy=self.strategy, token_cap=self.token_cap,
                           equal_counts=self.equal_counts, capacities=self.capacities,
                           seed=self.seed * 1_000_003 + window, time_limit_s=self.time_limit,
                           flop_width=self.flop_width)

    def check(self) -> None:
        """What the fields' own checks (freescale.runtime.options.check) cannot see: how they combine."""
        conflict = per_batch_conflict(self.strategy, self.window_steps, self.token_cap)
        if conflict:
            raise InputError(conflict)
