"""The run's picture: per-rank dense compute and wait time over steps (an MLflow artifact)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from training import bubbles


def plot_rank_timelines(table: np.ndarray, steps: list[int], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compute = bubbles.column(table, "dense_compute_s") * 1e3
    wait = bubbles.rank_bubbles(bubbles.column(table, "dense_compute_s")) * 1e3
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for rank in range(compute.shape[1]):
        top.plot(steps, compute[:, rank], lw=1, label=f"rank {rank}")
        bottom.plot(steps, wait[:, rank], lw=1, label=f"rank {rank}")
    top.set_ylabel("dense compute (ms)")
    bottom.set_ylabel("waiting for slowest (ms)")
    bottom.set_xlabel("step")
    if compute.shape[1] <= 8:
        top.legend(loc="upper right", fontsize=8)
    top.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
