"""Per-sample training cost as a function of history length L.

Balancing shards needs a cost that grows the way training time does: attention
is quadratic in L, projections and embedding lookups are linear, and every
sample pays some fixed work. Two shapes cover the cases we meet:

* ``quadratic``: ``a*L^2 + b*L + c`` -- the analytic default, and what a fit to
  profiled step times usually looks like;
* ``table``: costs measured at a few lengths, piecewise-linear in between and
  extrapolated linearly with the end segments (never below 0), for when the
  profile does not follow a clean polynomial (kernel switches, padding buckets).

Both add ``per_id * L`` for embedding ids looked up per sample.

A model is a JSON file (``save``/``load``, format ``FORMAT``). ``freescale
calibrate`` writes one fitted on the training machine (freescale/costs/calibration.py
fits it to the times freescale/training/calibration/calibrate.py measures); ``default_cost_model`` is
the analytic stand-in until then.

This module must not import pyspark at import time: the trainer and the
balancer load cost models on machines without Spark. Only ``cost_column``
imports it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from freescale.runtime.errors import InputError
from freescale.runtime.json_files import read_json, write_json

if TYPE_CHECKING:
    from pyspark.sql import Column

FORMAT = "freescale.cost_model/1"
KINDS = ("quadratic", "table")
STEP_CONSTANT_KEY = "step_constant_s"
"""The provenance entry of the per-step constant `freescale calibrate` fits beside the per-sample costs."""

# Default HSTU layer width the analytic default is derived for.
DEFAULT_D_MODEL = 64


@dataclass(frozen=True)
class CostModel:
    """Predicts a sample's training cost from its history length.

    Construction validates the parameters (raising ``InputError``), so a
    ``CostModel`` that exists is always usable.
    """

    kind: str  # "quadratic" or "table"
    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    per_id: float = 0.0
    lengths: tuple[float, ...] = ()
    costs: tuple[float, ...] = ()
    unit: str = "relative"
    provenance: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # JSON hands us lists; tuples keep the frozen model immutable.
        object.__setattr__(self, "lengths", tuple(float(x) for x in self.lengths))
        object.__setattr__(self, "costs", tuple(float(x) for x in self.costs))
        problem = _problem(self)
        if problem:
            raise InputError(f"cost model: {problem}")

    def predict(self, lengths: np.ndarray) -> np.ndarray:
        """Cost for each length (float64 array of the same shape)."""
        x = np.asarray(lengths, dtype=np.float64)
        if self.kind == "quadratic":
            base = (self.a * x + self.b) * x + self.c
        else:
            xp = np.asarray(self.lengths)
            fp = np.asarray(self.costs)
            # Segment index i covers [xp[i], xp[i+1]); the end segments also
            # cover everything beyond them, which gives linear extrapolation.
            i = np.clip(np.searchsorted(xp, x, side="right") - 1, 0, len(xp) - 2)
            slope = (fp[i + 1] - fp[i]) / (xp[i + 1] - xp[i])
            base = np.maximum(fp[i] + slope * (x - xp[i]), 0.0)
        return base + self.per_id * x

    @property
    def step_constant_s(self) -> float:
        """Seconds every rank's compute takes every step whatever its samples (kernel launches, host
        work): the ``d`` of calibrate's ``t(batch) = d + sum cost(L_i)``, kept in the provenance
        because no sample's cost holds it; 0.0 when the model names none. In the model's cost units
        only when ``unit`` is "seconds"."""
        return float(self.provenance.get(STEP_CONSTANT_KEY) or 0.0)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict; only the fields that matter for ``kind`` are written."""
        out: dict[str, Any] = {"format": FORMAT, "kind": self.kind}
        if self.kind == "quadratic":
            out.update(a=self.a, b=self.b, c=self.c)
        else:
            out.update(lengths=list(self.lengths), costs=list(self.costs))
        out.update(per_id=self.per_id, unit=self.unit, provenance=dict(self.provenance))
        return out

    @classmethod
    def from_json(cls, data: Any, source: str = "cost model") -> "CostModel":
        """Build from a dict made by ``to_json``; errors name ``source``."""
        if not isinstance(data, dict):
            raise InputError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise InputError(f"{source}: unknown format {data.get('format')!r} (expected {FORMAT!r})")
        kind = data.get("kind")
        if kind not in KINDS:
            raise InputError(f"{source}: unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
        names = ("a", "b", "c", "per_id")
        values: dict[str, Any] = {}
        for name in names:
            if name in data:
                values[name] = _number(data[name], f"{source}: field {name!r}")
        for name in ("lengths", "costs"):
            if name in data:
                seq = data[name]
                if not isinstance(seq, list):
                    raise InputError(f"{source}: field {name!r} must be a list of numbers")
                values[name] = tuple(_number(v, f"{source}: {name}[{i}]") for i, v in enumerate(seq))
        unit = data.get("unit", "relative")
        provenance = data.get("provenance", {})
        if not isinstance(unit, str) or not isinstance(provenance, dict):
            raise InputError(f"{source}: 'unit' must be a string and 'provenance' an object")
        try:
            return cls(kind=kind, unit=unit, provenance=provenance, **values)
        except InputError as err:
            # Re-prefix so the message names the file rather than "cost model".
            raise InputError(f"{source}: {str(err).removeprefix('cost model: ')}") from None

    def same_costs(self, other: "CostModel") -> bool:
        """Whether both give every length the same cost in the same unit: where they came from
        (provenance) aside."""
        return replace(self, provenance={}) == replace(other, provenance={})

    def save(self, path: str | Path) -> str:
        """Write the model as indented JSON, atomically (parents are created); returns the text written."""
        return write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Read a model saved by ``save``; any problem is one ``InputError`` line naming the file."""
        p = Path(path)
        data = read_json(p, "cost model file")
        return cls.from_json(data, source=str(p))


def _number(value: Any, what: str) -> float:
    # bool is an int subclass; `true` as a coefficient is a typo, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{what} must be a number, got {value!r}")
    return float(value)


def _problem(m: CostModel) -> str | None:
    """First reason the parameters are unusable, or None."""
    if m.kind not in KINDS:
        return f"unknown kind {m.kind!r} (expected one of {', '.join(KINDS)})"
    for name in ("a", "b", "c", "per_id"):
        value = getattr(m, name)
        if not math.isfinite(value):
            return f"coefficient {name}={value} is not finite"
        if value < 0:
            return f"coefficient {name}={value} is negative"
    if m.kind == "table":
        xs, ys = m.lengths, m.costs
        if len(xs) != len(ys):
            return f"table has {len(xs)} lengths but {len(ys)} costs"
        if len(xs) < 2:
            return f"table needs at least 2 points, got {len(xs)}"
        if not all(math.isfinite(v) for v in xs + ys):
            return "table lengths and costs must be finite"
        for i in range(1, len(xs)):
            if xs[i] <= xs[i - 1]:
                return f"table lengths must be strictly increasing (lengths[{i}]={xs[i]} <= {xs[i - 1]})"
        for i, y in enumerate(ys):
            if y < 0:
                return f"table cost costs[{i}]={y} is negative"
    constant = m.provenance.get(STEP_CONSTANT_KEY)
    if constant is not None and (isinstance(constant, bool) or not isinstance(constant, (int, float))
                                 or not math.isfinite(constant) or constant < 0):
        return f"provenance {STEP_CONSTANT_KEY}={constant!r} is not a finite number >= 0"
    # Zero everywhere leaves nothing to balance, and every bubble becomes 0/0 downstream.
    shape = (m.a, m.b, m.c) if m.kind == "quadratic" else m.costs
    if m.per_id == 0 and not any(shape):
        return "predicts zero cost at every length (all coefficients are 0)"
    return None


def default_cost_model() -> CostModel:
    """Analytic estimate for the default HSTU layer, until ``freescale calibrate`` replaces it.

    Per layer with width d, attention costs ~4*d*L^2 FLOPs and the projections
    ~10*d^2*L; dividing by 4d (only ratios between samples matter) gives
    L^2 + 2.5*d*L, i.e. a=1, b=160 for d=64. c=1000 stands for per-sample fixed
    work (embedding lookup, loss) that does not scale with L.
    """
    d = DEFAULT_D_MODEL
    return CostModel(
        kind="quadratic",
        a=1.0,
        b=2.5 * d,
        c=1000.0,
        unit="relative",
        provenance={
            "source": "analytic",
            "created": None,
            "host": None,
            "notes": (
                f"FLOP estimate of the default HSTU layer (d={d}): attention ~4*d*L^2 and "
                "projections ~10*d^2*L per layer, divided by 4d -> L^2 + 2.5*d*L; "
                "c approximates per-sample fixed work (embedding lookup, loss). "
                "Replace with `freescale calibrate`, which profiles the real model."
            ),
        },
    )


def cost_column(model: CostModel, length_col: "str | Column" = "length") -> "Column":
    """The model as a native Spark expression, so costs are computed without UDFs.

    Arithmetic mirrors ``predict`` term for term so both agree to rounding.
    """
    from pyspark.sql import functions as F

    x = (F.col(length_col) if isinstance(length_col, str) else length_col).cast("double")
    if model.kind == "quadratic":
        base = (F.lit(model.a) * x + F.lit(model.b)) * x + F.lit(model.c)
    else:
        xp, fp = model.lengths, model.costs

        def segment(i: int) -> "Column":
            slope = (fp[i + 1] - fp[i]) / (xp[i + 1] - xp[i])
            return F.lit(fp[i]) + F.lit(slope) * (x - F.lit(xp[i]))

        # Same segment choice as predict(): segment i for x < xp[i+1], the last
        # segment for everything beyond.
        n = len(xp)
        expr = F.when(x < F.lit(xp[1]), segment(0))
        for i in range(1, n - 2):
            expr = expr.when(x < F.lit(xp[i + 1]), segment(i))
        base = F.greatest(expr.otherwise(segment(n - 2)), F.lit(0.0))
    return base + F.lit(model.per_id) * x
