"""Fitting a cost model to measured batch times and choosing its form (NumPy only).

``freescale calibrate`` times batches on the training machine
(freescale/training/calibration/calibrate.py) and hands the times to the functions here, which turn
them into the ``CostModel`` the balancer reads (freescale/costs/cost_model.py). They
time nothing and import no torch, so they are tested on exact synthetic times
and can be used wherever the cost model is.

The fit
    Each kind of cost model (``KINDS``) is fitted by non-negative least squares
    on *relative* error to ``t(batch) = d + sum_i cost(L_i)``. ``d`` is the
    step's constant (attention plan, loss set-up over the shared negatives),
    fitted as its own coefficient so it cannot leak into the per-sample ``c``;
    it stays out of the cost model (every rank's step pays it alike) but is kept
    in ``FittedForm`` and added back when whole steps are predicted. Relative,
    because batch times span two orders of magnitude and the balancer cares
    about ratios. The table is fitted as non-negative increments between its
    knots, so it never decreases with length.

Choosing the form
    ``quadratic`` (``a L^2 + b L + c``) and ``table`` (costs at the grid
    lengths, piecewise linear in between) are fitted to the batches probing the
    grid lengths and scored on the batches probing held-out lengths (the
    geometric midpoints between neighbouring grid lengths, ``held_out_lengths``).
    Leave-one-out on the grid alone would judge the table with every gap
    doubled, which handicaps it by more than any real use does; held-out lengths
    score both forms as they will be used. The form with the lower RMS relative
    error wins (the quadratic on a tie: it is smooth and extrapolates sensibly)
    and is refitted on all batches, the table with knots at grid and held-out
    lengths.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from freescale.costs.cost_model import KINDS, CostModel
from freescale.runtime.errors import InputError

# ------------------------------------------------------------------------- lengths


def default_lengths(max_length: int, points: int = 10, min_length: int = 16) -> list[int]:
    """About ``points`` log-spaced lengths from ``min_length`` to ``max_length`` (the model's max_seq_len)."""
    low = min(min_length, max_length)
    return sorted({round(float(x)) for x in np.geomspace(low, max_length, points)})


def held_out_lengths(grid: Sequence[int]) -> list[int]:
    """Geometric midpoint of each pair of neighbouring grid lengths (pairs without an integer between skipped)."""
    out = []
    for low, high in itertools.pairwise(sorted(grid)):
        mid = round(math.sqrt(low * high))
        if low < mid < high:
            out.append(mid)
    return out


def check_lengths(grid: Sequence[int]) -> None:
    """Raise ``InputError`` unless the grid can be fitted and has room for held-out lengths."""
    if len(set(grid)) < 3:
        raise InputError(f"need at least 3 distinct lengths, got {sorted(set(grid))}")
    if min(grid) < 2:
        raise InputError(f"lengths must be at least 2 (a 1-long history has no next-item target), got {min(grid)}")
    if not held_out_lengths(grid):
        raise InputError(f"lengths {sorted(set(grid))} leave no integer between neighbours for held-out lengths")


# ------------------------------------------------------------------------- fitting


def nonnegative_least_squares(features: np.ndarray, target: np.ndarray, max_iter: int = 1000) -> np.ndarray:
    """``argmin ||features @ x - target||`` subject to ``x >= 0`` (Lawson-Hanson active set).

    Exact: it ends when no inactive coefficient could lower the residual, which is
    the NNLS optimality condition. Columns are scaled to unit norm first (L^2
    and 1 differ by six orders of magnitude). numpy only, so no scipy dependency.
    """
    A = np.asarray(features, dtype=np.float64)
    b = np.asarray(target, dtype=np.float64)
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    A = A / norms
    n = A.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(A.shape) * max(1.0, float(np.abs(A).sum(axis=0).max()))
    gradient = A.T @ (b - A @ x)
    for _ in range(max_iter):
        if passive.all() or gradient[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            trial = np.zeros(n)
            trial[passive], *_ = np.linalg.lstsq(A[:, passive], b, rcond=None)
            if trial[passive].min() > 0:
                break
            # Step from x towards the trial solution until the first coefficient hits 0,
            # drop the coefficients at 0 from the passive set and solve again.
            shrinking = passive & (trial <= 0)
            step = np.min(x[shrinking] / (x[shrinking] - trial[shrinking]))
            x = x + step * (trial - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                trial = np.zeros(n)
                break
        x = trial
        gradient = A.T @ (b - A @ x)
    return x / norms


def quadratic_features(batches: Sequence[Sequence[int]]) -> np.ndarray:
    """``[batches, 4]``: sum of L^2, sum of L, samples, 1 -- coefficients a, b, c and the step constant."""
    rows = []
    for lengths in batches:
        x = np.asarray(lengths, dtype=np.float64)
        rows.append([(x * x).sum(), x.sum(), float(len(x)), 1.0])
    return np.array(rows)


def hat_weights(lengths: Sequence[float], knots: Sequence[float]) -> np.ndarray:
    """``[len(lengths), len(knots)]`` weights with ``weights @ costs`` = the table's prediction.

    The same segments as ``CostModel.predict`` for ``kind="table"``: interpolation
    between neighbouring knots, the end segments extended beyond the ends.
    """
    x, xp = np.asarray(lengths, dtype=np.float64), np.asarray(knots, dtype=np.float64)
    i = np.clip(np.searchsorted(xp, x, side="right") - 1, 0, len(xp) - 2)
    upper = (x - xp[i]) / (xp[i + 1] - xp[i])
    weights = np.zeros((len(x), len(xp)))
    rows = np.arange(len(x))
    weights[rows, i] = 1.0 - upper
    weights[rows, i + 1] = upper
    return weights


def table_features(batches: Sequence[Sequence[int]], knots: Sequence[float]) -> np.ndarray:
    """``[batches, knots + 1]``: summed hat weights of each batch's samples, then 1 for the step constant."""
    return np.array([[*hat_weights(lengths, knots).sum(axis=0), 1.0] for lengths in batches])


@dataclass(frozen=True)
class FittedForm:
    """A per-sample cost form fitted to batch times, and the step constant fitted with it."""

    kind: str
    model: CostModel
    """The per-sample part, as the balancer will use it (unit: seconds)."""
    step_constant: float

    def per_sample(self, lengths: Sequence[int]) -> np.ndarray:
        return self.model.predict(np.asarray(lengths))

    def batch_times(self, batches: Sequence[Sequence[int]]) -> np.ndarray:
        return np.array([self.step_constant + float(self.per_sample(b).sum()) for b in batches])


def fit_form(kind: str, batches: Sequence[Sequence[int]], seconds: Sequence[float],
             knots: Sequence[float] = ()) -> FittedForm:
    """Fit ``t = d + sum_i cost(L_i)`` with non-negative coefficients, minimising *relative* error.

    Relative, because batch times span two orders of magnitude and the balancer
    cares about ratios: absolute errors would let the longest batches decide
    the fit alone. ``knots`` are the table's lengths (unused by the quadratic).
    The table is fitted as non-negative *increments* between knots, so its
    costs never decrease with length: a longer history never costs less, and
    short knots -- a small part of any batch's time -- cannot zig-zag with noise.
    """
    t = np.asarray(seconds, dtype=np.float64)
    if (t <= 0).any():
        raise ValueError("fit_form needs positive batch times")
    if kind == "quadratic":
        features = quadratic_features(batches)
        coef = nonnegative_least_squares(features / t[:, None], np.ones_like(t))
        a, b, c = (float(v) for v in coef[:3])
        model = CostModel(kind="quadratic", a=a, b=b, c=c, unit="seconds")
    elif kind == "table":
        features = table_features(batches, knots)
        # costs = cumulative sums of increments: [knots, knots] lower-triangular ones.
        cumulative = np.tril(np.ones((len(knots), len(knots))))
        features[:, :-1] = features[:, :-1] @ cumulative
        coef = nonnegative_least_squares(features / t[:, None], np.ones_like(t))
        costs = cumulative @ coef[:-1]
        model = CostModel(kind="table", lengths=tuple(knots), costs=tuple(costs.tolist()), unit="seconds")
    else:
        raise ValueError(f"unknown form {kind!r}")
    return FittedForm(kind, model, float(coef[-1]))


# ------------------------------------------------------------------ scoring, choice


def r_squared(actual: Sequence[float], predicted: Sequence[float]) -> float:
    y, p = np.asarray(actual, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    total = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - p) ** 2)) / total if total > 0 else 1.0


def rms(values: Sequence[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(np.sqrt(np.mean(v * v))) if v.size else float("nan")


def relative_errors(predicted: Sequence[float], actual: Sequence[float]) -> np.ndarray:
    return np.asarray(predicted, dtype=np.float64) / np.asarray(actual, dtype=np.float64) - 1.0


@dataclass(frozen=True)
class FormScore:
    """One form fitted to some batches: how it fits them and how it predicts the held-out ones."""

    form: FittedForm
    r2: float
    """R^2 of the fitted batch times."""
    fit_errors: tuple[float, ...]
    """Relative error of each fitted batch (predicted / measured - 1)."""
    cv_errors: tuple[float, ...]
    """Relative error of each held-out batch."""

    @property
    def cv_rms(self) -> float:
        return rms(self.cv_errors)


@dataclass(frozen=True)
class FormChoice:
    chosen: str
    reason: str
    scores: dict[str, FormScore]


def score_form(kind: str, batches: Sequence[Sequence[int]], seconds: Sequence[float], knots: Sequence[float],
               held_out: Sequence[Sequence[int]] = (), held_out_seconds: Sequence[float] = ()) -> FormScore:
    form = fit_form(kind, batches, seconds, knots)
    fitted = form.batch_times(batches)
    cv = relative_errors(form.batch_times(held_out), held_out_seconds) if len(held_out) else np.zeros(0)
    return FormScore(form, r_squared(seconds, fitted), tuple(relative_errors(fitted, seconds).tolist()),
                     tuple(cv.tolist()))


def compare_forms(batches: Sequence[Sequence[int]], seconds: Sequence[float], knots: Sequence[float],
                  held_out: Sequence[Sequence[int]], held_out_seconds: Sequence[float]) -> FormChoice:
    """Fit both forms to ``batches``, score them on the ``held_out`` batches, choose the better predictor."""
    if len(held_out) == 0:
        raise ValueError("compare_forms needs held-out batches")
    scores = {kind: score_form(kind, batches, seconds, knots, held_out, held_out_seconds) for kind in KINDS}
    quad, table = scores["quadratic"].cv_rms, scores["table"].cv_rms
    if table < quad:
        chosen = "table"
        reason = f"the table predicts held-out lengths better: RMS relative error {table:.2%} vs {quad:.2%}"
    else:
        chosen = "quadratic"
        reason = (f"the quadratic predicts held-out lengths {'as well as' if quad == table else 'better than'} "
                  f"the table: RMS relative error {quad:.2%} vs {table:.2%}")
    return FormChoice(chosen, reason, scores)


@dataclass(frozen=True)
class PredictionQuality:
    """Predicted vs measured step times of a set of batches, compared as ratios between batches."""

    correlation: float
    """Pearson correlation of predicted and measured times."""
    median_abs_error: float
    """Median over batches of |normalised ratio - 1|, ratio = (predicted / mean) / (measured / mean)."""
    p90_abs_error: float
    ratio_errors: tuple[float, ...]


def prediction_quality(predicted: Sequence[float], measured: Sequence[float]) -> PredictionQuality:
    """Only ratios between batches matter to the balancer, so both sides are normalised by their mean."""
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    ratio = (p / p.mean()) / (m / m.mean()) - 1.0
    corr = float(np.corrcoef(p, m)[0, 1]) if len(p) > 1 and p.std() > 0 and m.std() > 0 else float("nan")
    abs_err = np.abs(ratio)
    return PredictionQuality(corr, float(np.median(abs_err)), float(np.quantile(abs_err, 0.9)),
                             tuple(ratio.tolist()))
