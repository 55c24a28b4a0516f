"""`PlanOptions`: what the planner is asked for besides the samples themselves, declared once.

``plan`` and ``partition`` take it (or the same names as keywords, which build one), and the jobs'
specs make one (``BalanceSpec.plan_options``, ``SimulationSpec.plan_options``), so an option is
one field here. The values are checked where they are used (``freescale.balancing.inputs``), against
the samples and the world size they apply to. Standard library only: the jobs' parsers import it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

DEFAULT_FLOP_WIDTH = 64
"""The d of strategy flops_kk's FLOP formula when none is given: the default HSTU ``embedding_dim``."""


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """How samples are assigned; the per-sample costs and lengths are the call's data, not options."""

    window_steps: int = 1
    """Global batches planned together, so heavy samples can change step (``plan`` only; 1 moves
    nothing, and ``partition`` balances one global batch)."""
    strategy: str = "kk"
    """A name in ``STRATEGIES`` (``freescale.balancing.strategies`` describes each)."""
    token_cap: float | None = None
    """Per-rank limit on the sum of lengths per step; never exceeded (InfeasibleError instead). Needs lengths."""
    equal_counts: bool = False
    """Every rank gets floor(N/K) or ceil(N/K) samples of a step."""
    capacities: Any = None
    """Relative rank speeds (> 0), one per rank, normalised to mean 1; None: all equal."""
    seed: int = 0
    """Makes "ortools" reproducible (the other strategies are deterministic anyway); ``plan`` derives
    each step's seed from it."""
    time_limit_s: float | None = None
    """CP-SAT budget of "ortools" in deterministic seconds per step (None: 2)."""
    flop_width: int = DEFAULT_FLOP_WIDTH
    """The model width d in the FLOP formula L^2 + 2.5*d*L of "flops_kk" (needs lengths)."""

    @classmethod
    def of(cls, options: PlanOptions | None, **overrides: Any) -> PlanOptions:
        """``options`` (default: all defaults) with the named fields replaced; an unknown name is a TypeError."""
        return replace(options if options is not None else cls(), **overrides)
