"""The numbers of a comparison of training runs (`freescale compare`): per-variant medians over
repeats, and what balancing removed against the noise floor. Standard library only: the runs
are their summaries (`freescale train --summary-json`'s ``summary``), not live trainings."""
from __future__ import annotations

import statistics

QUALITY = ("hr_at_10", "ndcg_at_10", "mrr")  # plus the sampled_* metrics when the runs have them


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per variant, the median over repeats of every summary number all its runs have."""
    out = {}
    for variant, rows in runs.items():
        keys = set.intersection(*(set(r["summary"]) for r in rows))
        out[variant] = {k: statistics.median(float(r["summary"][k]) for r in rows) for k in sorted(keys)}
    return out


def removed_share(contiguous: float, balanced: float, floor: float) -> float | None:
    """The share of the removable amount (contiguous - floor) that balancing removed; None when
    there was nothing to remove."""
    removable = contiguous - floor
    return (contiguous - balanced) / removable if removable > 0 else None


def comparison_metrics(med: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """The parent run's numbers, from the medians: reductions against the control's floor (0
    without a control), speedup, and balanced - contiguous quality."""
    con, bal = med["contiguous"], med["balanced"]
    floor = med.get("control", {})
    metrics: dict[str, float | None] = {
        "bubble_reduction": removed_share(con["bubble_fraction"], bal["bubble_fraction"],
                                          floor.get("bubble_fraction", 0.0)),
        "idle_reduction": removed_share(con["idle_fraction"], bal["idle_fraction"], floor.get("idle_fraction", 0.0)),
        "speedup": bal["samples_per_s"] / con["samples_per_s"] if con["samples_per_s"] > 0 else None,
    }
    sampled = sorted(k for k in con if k.startswith("sampled_") and k in bal)
    for key in (*QUALITY, *sampled):
        if key in con and key in bal:
            metrics[f"delta_{key}"] = bal[key] - con[key]
    for variant, values in med.items():
        metrics.update({f"{variant}/{k}": v for k, v in values.items()})
    return metrics
