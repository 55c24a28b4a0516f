"""Relative rank speeds: estimated from lock-step timings, written and read as a JSON file.

``freescale calibrate --rank-speeds-output`` has every rank time identical work
at the same moments (freescale/jobs/calibrate.py) and estimates here each rank's capacity
with a bootstrap interval; ``freescale balance --capacities @FILE`` reads the
file back with ``read_rank_speeds``. The statistics, the file's format and its
reader live together so the writer and the reader cannot drift apart, and
beside the cost model (freescale/costs/cost_model.py), the other file balance reads.
NumPy only: the balance job reads the file without loading torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from freescale.runtime.errors import InputError
from freescale.runtime.json_files import read_json, write_json

FORMAT = "freescale.rank_speeds/1"
CONFIDENCE = 0.95
"""Confidence of the bootstrap intervals."""
MIN_SPEED_DIFFERENCE = 0.02
"""Capacities other than 1 are written only when the fastest rank is more than 2% faster than the slowest."""


@dataclass(frozen=True)
class RankSpeeds:
    """Relative speed (capacity) of each rank from identical work timed in lock-step."""

    capacities: tuple[float, ...]
    """mean time over all ranks / mean time of the rank, normalised to mean 1."""
    ci_low: tuple[float, ...]
    ci_high: tuple[float, ...]
    confidence: float
    significant: bool
    reason: str
    spread: float
    """max capacity / min capacity - 1."""


def rank_capacities(times: np.ndarray) -> np.ndarray:
    """``times`` ``[repeats, ranks]`` -> capacity per rank, mean 1 (a faster rank gets more)."""
    per_rank = np.asarray(times, dtype=np.float64).mean(axis=0)
    capacity = per_rank.mean() / per_rank
    return capacity / capacity.mean()


def estimate_rank_speeds(times: np.ndarray, confidence: float = CONFIDENCE, resamples: int = 2000,
                         min_difference: float = MIN_SPEED_DIFFERENCE, seed: int = 0) -> RankSpeeds:
    """Capacities with percentile-bootstrap intervals over repeats, and whether they differ for real.

    Resampling whole repeats keeps each repeat's ranks together: they ran at the
    same moment, so load on the machine at that moment affects them alike. The
    difference counts only when some rank's interval excludes 1 (equal speed)
    *and* the fastest rank is more than ``min_difference`` faster than the
    slowest: a 1% difference that is merely certain is not worth re-planning
    for. Repeats are treated as independent; slow drifts in machine load make
    the intervals somewhat optimistic, which the ``min_difference`` floor guards against.
    """
    t = np.asarray(times, dtype=np.float64)
    if t.ndim != 2 or t.shape[0] < 2:
        raise ValueError(f"times must be [repeats >= 2, ranks], got shape {t.shape}")
    capacity = rank_capacities(t)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, t.shape[0], size=(resamples, t.shape[0]))
    boot = np.stack([rank_capacities(t[p]) for p in picks])
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(boot, tail, axis=0), np.quantile(boot, 1.0 - tail, axis=0)
    spread = float(capacity.max() / capacity.min() - 1.0)
    excludes_equal = bool(((low > 1.0) | (high < 1.0)).any())
    significant = excludes_equal and spread > min_difference
    if significant:
        reason = (f"ranks differ by {spread:.1%} (> {min_difference:.0%}) and the {confidence:.0%} intervals "
                  "exclude equal speed")
    elif not excludes_equal:
        reason = f"every rank's {confidence:.0%} interval includes equal speed (spread {spread:.1%})"
    else:
        reason = f"the difference is real but only {spread:.1%} (<= {min_difference:.0%}): not worth re-planning"
    return RankSpeeds(tuple(capacity.tolist()), tuple(low.tolist()), tuple(high.tolist()), confidence,
                      significant, reason, spread)


# ------------------------------------------------------------------------ the file


def rank_speeds_document(speeds: RankSpeeds, provenance: dict) -> dict:
    """The file's content: capacities only when the difference is real, 1.0 for every rank otherwise."""
    world_size = len(speeds.capacities)
    capacities = list(speeds.capacities) if speeds.significant else [1.0] * world_size
    return {
        "format": FORMAT,
        "capacities": capacities,
        "ci": [[lo, hi] for lo, hi in zip(speeds.ci_low, speeds.ci_high)],
        "significant": speeds.significant,
        "provenance": {
            **provenance,
            "clock": "wall (dense compute span, summed over the batches of a repeat)",
            "measured_capacities": list(speeds.capacities),
            "spread": speeds.spread,
            "confidence": speeds.confidence,
            "min_difference": MIN_SPEED_DIFFERENCE,
            "reason": speeds.reason,
            "written": "measured capacities" if speeds.significant else "1.0 for every rank (no real difference)",
        },
    }


def write_rank_speeds(path: str | Path, document: dict) -> str:
    """Write a ``rank_speeds_document`` atomically; returns the text written."""
    return write_json(path, document)


def read_rank_speeds(path: str | Path) -> tuple[float, ...]:
    """Capacities from a rank-speeds file written by ``freescale calibrate``; problems name the file."""
    p = Path(path)
    data = read_json(p, "rank speeds file")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise InputError(f"{p}: not a rank speeds file (format {found!r}, expected {FORMAT!r})")
    capacities = data.get("capacities")
    # bool is an int subclass; `true` as a speed is a typo, not 1.0.
    if (not isinstance(capacities, list) or not capacities
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in capacities)
            or not all(math.isfinite(v) and v > 0 for v in capacities)):
        raise InputError(f"{p}: 'capacities' must be a non-empty list of positive numbers, got {capacities!r}")
    return tuple(float(v) for v in capacities)
