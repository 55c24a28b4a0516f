"""`freescale simulate`'s report of its predictions (freescale/balancing/time_model.py's ``predict`` rows and
``reductions``): the printed tables, the MLflow metrics and the bubble-vs-K plot. Standard library
only; matplotlib is imported by :func:`plot_bubbles` alone, when a plot is drawn.
"""
from __future__ import annotations

from pathlib import Path

PLOT_NAME = "bubble_vs_k.png"
ROW_METRICS = ("bubble_fraction", "idle_fraction", "step_time_s", "plan_bubble")
REDUCTION_METRICS = ("bubble_reduction", "idle_reduction", "speedup")


def source_name(what: dict) -> str:
    """``input PATH``, ``lengths lognormal:...`` or ``shards PATH``: what the plans were built on."""
    return f"{what['source']} {what.get('lengths') or what.get('shards')}"


def print_report(what: dict, described: dict, rows: list[dict], reduced: list[dict]) -> None:
    """The model in one line (with the per-step constant when the cost model has one), a note when
    a dataset's lengths were resampled, the table per K and plan, and (with both plans) the
    balanced/contiguous reductions."""
    unit, scale = ("ms", 1e3) if described["times_in"] == "seconds" else ("cost units", 1.0)
    constant = described.get("step_constant_s", 0.0)
    print(f"freescale simulate: {source_name(what)}, "
          f"B={what['local_batch_size']}, cost model {what['cost_model']}; noise {described['noise']}"
          f" (cv {described.get('noise_cv', 0.0):.3f}); "
          + (f"{described['seconds_per_cost']:.4g} s per cost unit; " if unit == "ms" else
             "times in cost units (no --calibrate-from or --seconds-per-cost); ")
          + f"non-compute {described['comm_latency_s'] * scale:.3g} {unit} + "
          f"{described['comm_seconds_per_sample'] * scale:.3g} {unit} per sample"
          + (f"; per-step constant {constant * scale:.3g} {unit} on every rank (the cost model's, in its compute)"
             if constant else ""))
    if what.get("resampled_world_sizes"):
        print(f"freescale simulate: the dataset has {what['dataset_samples']} samples, fewer than K x B x steps for "
              f"K = {', '.join(map(str, what['resampled_world_sizes']))}: their lengths are drawn with "
              "replacement from its length distribution")
    print(f"\n| K | plan | plan bubble | step time ({unit}) | bubble_fraction | idle_fraction | slowest rank's noise |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['world_size']} | {r['plan']} | {r['plan_bubble']:.4f} | {r['step_time_s'] * scale:.4g} | "
              f"{r['bubble_fraction']:.4f} | {r['idle_fraction']:.4f} | x{r['noise_max_factor']:.3f} |")
    if reduced:
        print("\n| K | bubble removed (1 - balanced / contiguous) | idle removed | step-time speedup |")
        print("| --- | --- | --- | --- |")
        for r in reduced:
            print(f"| {r['world_size']} | {r['bubble_reduction']:.1%} | {r['idle_reduction']:.1%} | "
                  f"x{r['speedup']:.3f} |")


def row_metrics(rows: list[dict]) -> dict[str, float]:
    """MLflow metrics per K and plan: ``k{K}/{plan}/{name}``."""
    return {f"k{r['world_size']}/{r['plan']}/{name}": r[name] for r in rows for name in ROW_METRICS}


def reduction_metrics(reduced: list[dict]) -> dict[str, float]:
    """MLflow metrics per K of what balancing removes: ``k{K}/{name}``."""
    return {f"k{r['world_size']}/{name}": r[name] for r in reduced for name in REDUCTION_METRICS}


def plot_title(what: dict) -> str:
    return f"{source_name(what)}, B={what['local_batch_size']}"


def plot_bubbles(rows: list[dict], path: Path, title: str) -> Path:
    """bubble_fraction (solid) and idle_fraction (dashed) vs K, one colour per plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, name in enumerate(dict.fromkeys(r["plan"] for r in rows)):
        mine = sorted((r for r in rows if r["plan"] == name), key=lambda r: r["world_size"])
        ks = [r["world_size"] for r in mine]
        ax.plot(ks, [r["bubble_fraction"] for r in mine], "o-", color=f"C{i}", label=f"{name} bubble_fraction")
        ax.plot(ks, [r["idle_fraction"] for r in mine], "s--", color=f"C{i}", alpha=0.6,
                label=f"{name} idle_fraction")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks K")
    ax.set_ylabel("fraction of rank-time")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
