"""What rank 0 makes of the gathered step windows: the sink's per-step series, the progress
line with its ETA, and the run's summary (from the run's timing file)."""
from __future__ import annotations

import collections
from typing import Any, Protocol

import numpy as np

from freescale.training.timing import bubbles

WARMUP_STEPS = 2  # first steps pay allocator and first-touch costs no plan controls


class MetricsSink(Protocol):
    def log_step(self, step: int, metrics: dict[str, float]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this record (part of rank 0's checkpoint)."""
        ...


class StepReporter:
    """Rank 0's record of the steps as they are gathered: every step to the sink, and a
    line every ``log_every`` steps (and the first and last) paced by the recent steps."""

    def __init__(self, world_size: int, max_steps: int, log_every: int):
        self.world_size, self.max_steps = world_size, max_steps
        self.log_every = max(1, log_every)
        self._recent_step_s: collections.deque[float] = collections.deque(maxlen=self.log_every)

    def report(self, sink: MetricsSink, gathered: np.ndarray, steps: list[int]) -> None:
        losses = step_losses(gathered)
        compute = bubbles.column(gathered, "dense_compute_s")
        comm = bubbles.column(gathered, "comm_s")
        exposed = bubbles.column(gathered, "exposed_comm_s")
        step_time = bubbles.column(gathered, "step_s").max(axis=1)
        fractions = bubbles.step_bubble_fractions(compute, step_time)
        for i, step in enumerate(steps):
            # "step/" keeps per-step series apart from the run summary's fixed names.
            metrics = {"step/loss": float(losses[i]), "step/time_s": float(step_time[i]),
                       "step/bubble_fraction": float(fractions[i]),
                       "step/exposed_comm_s": float(exposed[i].max()),
                       "step/overlap_fraction": bubbles.overlap_fraction(comm[i], exposed[i])}
            if self.world_size <= 16:
                for r in range(self.world_size):
                    metrics[f"step/compute_s.rank{r}"] = float(compute[i, r])
                    metrics[f"step/comm_s.rank{r}"] = float(comm[i, r])
                    metrics[f"step/exposed_comm_s.rank{r}"] = float(exposed[i, r])
            sink.log_step(step, metrics)
            self._recent_step_s.append(float(step_time[i]))
            if step == 0 or (step + 1) % self.log_every == 0 or step == self.max_steps - 1:
                pace = float(np.mean(self._recent_step_s))
                print(format_step_line(step, self.max_steps, float(losses[i]), pace,
                                       pace * (self.max_steps - step - 1), float(fractions[i]),
                                       float(exposed[i].max())), flush=True)


def format_step_line(step: int, max_steps: int, loss: float, step_s: float, eta_s: float,
                     bubble: float | None = None, exposed_comm_s: float | None = None) -> str:
    """Rank 0's line every ``training.log_every`` steps: steps done (``step`` is 0-based) of the
    run's, the loss, the recent pace and the time left at that pace, e.g.
    ``step 120/400  loss 5.3149  142 ms/step  bubble 8.8%  exposed comm 31 ms  ETA 40 s``."""
    parts = [f"step {step + 1}/{max_steps}", f"loss {loss:.4f}", f"{step_s * 1e3:.0f} ms/step"]
    if bubble is not None:
        parts.append(f"bubble {bubble:.1%}")
    if exposed_comm_s is not None:
        parts.append(f"exposed comm {exposed_comm_s * 1e3:.0f} ms")
    return "  ".join([*parts, f"ETA {_duration(eta_s)}"])


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def step_losses(table: bubbles.Timings) -> np.ndarray:
    """Global loss per step: the sum of target losses over all ranks / all targets."""
    if len(table) == 0:
        return np.zeros(0)
    loss_sum = bubbles.column(table, "loss_sum").sum(axis=1)
    targets = bubbles.column(table, "targets").sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.nan_to_num(loss_sum / targets)


def run_summary(table: bubbles.Timings) -> dict[str, float]:
    """Bubbles and timings past the warm-up, the loss of the last tenth of the steps, throughput
    (from a table or, column by column, from the run's timing file)."""
    summary = bubbles.summarize(table, skip_steps=min(WARMUP_STEPS, max(0, len(table) - 1)))
    losses = step_losses(table)
    summary["loss"] = float(np.mean(losses[-max(1, len(losses) // 10):])) if len(losses) else float("nan")
    total_time = float(bubbles.column(table, "step_s").max(axis=1).sum())
    samples = float(bubbles.column(table, "samples").sum())
    summary["samples_per_s"] = samples / total_time if total_time else 0.0
    # The samples whose loss this process computed, all ranks: a resumed run counts only its own.
    summary["samples_trained"] = samples
    return summary
