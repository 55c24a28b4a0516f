"""The run's picture: per-rank dense compute and wait time over steps (an MLflow artifact)."""
from __future__ import annotations

from pathlib import Path

from freescale.training.timing import bubbles


def plot_rank_timelines(table: bubbles.Timings, steps: list[int], path: str | Path, title: str = "") -> Path:
    """One run's picture: the comparison's layout with a single column."""
    return plot_comparison_timelines({title: (table, steps)}, path)


def plot_comparison_timelines(runs: dict[str, tuple[bubbles.Timings, list[int]]], path: str | Path,
                              title: str = "") -> Path:
    """Side by side, one column per shard set (e.g. contiguous | balanced): each rank's dense
    compute (top) and its wait for the slowest rank (bottom) over steps, on shared axes so the
    columns compare at a glance. ``runs`` maps a column title to a run's timings (a table, or its
    columns: ``bubbles.column``) and its steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(5 * len(runs), 6), sharex=True, sharey="row", squeeze=False)
    for column, (name, (table, steps)) in enumerate(runs.items()):
        compute = bubbles.column(table, "dense_compute_s")
        wait = bubbles.rank_bubbles(compute) * 1e3
        for rank in range(compute.shape[1]):
            axes[0, column].plot(steps, compute[:, rank] * 1e3, lw=1, label=f"rank {rank}")
            axes[1, column].plot(steps, wait[:, rank], lw=1, label=f"rank {rank}")
        axes[0, column].set_title(name)
        axes[1, column].set_xlabel("step")
    axes[0, 0].set_ylabel("dense compute (ms)")
    axes[1, 0].set_ylabel("waiting for slowest (ms)")
    if compute.shape[1] <= 8:
        axes[0, 0].legend(loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
