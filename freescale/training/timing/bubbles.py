"""Per-step, per-rank timings and the bubbles they show, measured on the ranks themselves.

Every rank times its own phases each step (wall clock, and the thread's CPU clock
for the dense compute). Every `sync_every` steps the ranks all-gather their rows
(a window of the [step, rank] table; rank 0 appends it to the run's timing file,
``freescale.costs.run_timings``). A rank's bubble in a step is the time it waits
for the slowest rank, max_k compute[k] - compute[r]; the step's bubble
fraction is the sum over ranks divided by ranks x step time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol, Union

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from freescale.training.model.recommender import EmbeddingSource


@dataclass
class StepTiming:
    """One rank's phases of one step, seconds (cost and samples: what the step carried)."""

    data_wait_s: float = 0.0
    """Blocked on the input pipeline for this step's batch."""
    sparse_forward_s: float = 0.0
    """Embedding lookup: input/output all-to-all and the local table lookup (a synchronisation point)."""
    dense_compute_s: float = 0.0
    """Dense forward + backward, wall clock: the work the balancer equalises."""
    dense_compute_cpu_s: float = 0.0
    """The same span on this thread's CPU clock (excludes time the OS gave to others)."""
    sparse_backward_s: float = 0.0
    """Embedding backward: gradient all-to-all and fused optimizer; where fast ranks wait for slow ones."""
    allreduce_s: float = 0.0
    """Dense gradient all-reduce."""
    optimizer_s: float = 0.0
    """Dense optimizer step."""
    step_s: float = 0.0
    """Whole step, wall clock."""
    comm_s: float = 0.0
    """Time with at least one of this rank's collectives in flight (plain mode: every
    blocking phase, sparse forward + sparse backward + all-reduce)."""
    exposed_comm_s: float = 0.0
    """Time the compute thread waited on a collective (plain mode: equal to ``comm_s``)."""
    dense_comm_overlap_s: float = 0.0
    """Dense compute time during which a collective was in flight (where transport
    threads compete with compute for cores -- on GPUs, for SMs)."""
    cost: float = 0.0
    """Sum of the cost model over this rank's samples (what the plan predicted)."""
    samples: float = 0.0
    """Samples in this rank's batch."""
    loss_sum: float = 0.0
    """Sum of this rank's per-target losses (the global loss is sum over ranks / targets)."""
    targets: float = 0.0
    """Next-item targets in this rank's batch."""


class DenseSpanProbe:
    """Marks the dense span of one step: lookup returned -> gradient back at the lookup's outputs.

    ``timed(source)`` puts it around the model's embedding source: the span starts when
    the rows the encoder needs are in, and ends at the last gradient to reach any row the
    source handed out. The trainer's ``dense_compute_s`` and the calibration's timings
    are this span, on the wall and thread CPU clocks.
    """

    def __init__(self) -> None:
        self.start_cpu = self.start_wall = 0.0
        self.started = False
        self.end_cpu: float | None = None
        self.end_wall: float | None = None

    def __call__(self, *sparse_outputs: torch.Tensor) -> None:
        self.start_wall, self.start_cpu = time.perf_counter(), time.thread_time()
        self.started = True
        for tensor in sparse_outputs:
            self.watch(tensor)

    def watch(self, tensor: torch.Tensor) -> None:
        """Also end the span no earlier than ``tensor``'s gradient (an output that arrived
        after the span started, such as the lowest-priority exchange group)."""
        if tensor.requires_grad:
            tensor.register_hook(self._grad_arrived)

    def timed(self, source: "EmbeddingSource") -> "TimedSource":
        return TimedSource(source, self)

    def _grad_arrived(self, grad: torch.Tensor) -> torch.Tensor:
        # Every output is reached by backward; the last one ends the dense part (the
        # model's sparse boundary holds the tables' backward until then).
        self.end_wall, self.end_cpu = time.perf_counter(), time.thread_time()
        return grad


class TimedSource:
    """An embedding source (``freescale.training.model.recommender.EmbeddingSource``) whose rows a probe watches:
    the model's math is the inner source's, the timing stays out of it."""

    def __init__(self, source: "EmbeddingSource", probe: DenseSpanProbe):
        self.source, self.probe = source, probe

    def inputs(self, batch, negative_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        items, users = self.source.inputs(batch, negative_ids)
        self.probe(*[t for t in (items, users) if t is not None])
        return items, users

    def negatives(self) -> torch.Tensor:
        rows = self.source.negatives()
        self.probe.watch(rows)
        return rows


TIMING_FIELDS = tuple(f.name for f in fields(StepTiming))
FIELD_INDEX = {name: i for i, name in enumerate(TIMING_FIELDS)}


class StepTimeLog:
    """Collects this rank's StepTimings and all-gathers them, ``sync_every`` steps at a time, into
    ``[steps, ranks, fields]`` windows: a rank holds the steps since the last gather and the window it
    returns, never the run's table (rank 0 appends the windows to a ``TimingFile``)."""

    def __init__(self, world_size: int, sync_every: int = 1, group: dist.ProcessGroup | None = None):
        self.world_size = world_size
        self.sync_every = max(1, sync_every)
        self.group = group
        self._pending: list[list[float]] = []
        self._pending_steps: list[int] = []

    def record(self, step: int, timing: StepTiming) -> tuple[list[int], np.ndarray] | None:
        """Add one step; returns the newly gathered steps and their [n, K, F] rows when a sync happened."""
        self._pending.append([getattr(timing, name) for name in TIMING_FIELDS])
        self._pending_steps.append(step)
        if len(self._pending) >= self.sync_every:
            return self.flush()
        return None

    def flush(self) -> tuple[list[int], np.ndarray] | None:
        """All-gather what is pending (a collective: every rank must call it the same number of times)."""
        if not self._pending:
            return None
        local = torch.tensor(self._pending, dtype=torch.float64)
        if dist.is_initialized() and self.world_size > 1:
            gathered = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(gathered, local, group=self.group)
            table = torch.stack(gathered, dim=1).numpy()
        else:
            table = local.unsqueeze(1).numpy()
        steps, self._pending, self._pending_steps = self._pending_steps, [], []
        return steps, table


class TimingSource(Protocol):
    """A run's timings read one field at a time (``freescale.costs.run_timings.TimingColumns``)."""

    def __len__(self) -> int: ...

    def column(self, name: str) -> np.ndarray: ...


Timings = Union[np.ndarray, TimingSource]
"""A ``[steps, ranks, fields]`` table, or a source of its ``[steps, ranks]`` columns."""


def column(timings: Timings, name: str) -> np.ndarray:
    """``[steps, ranks]``: field ``name`` of every step and rank."""
    if isinstance(timings, np.ndarray):
        return timings[..., FIELD_INDEX[name]]
    return timings.column(name)


def rank_bubbles(compute: np.ndarray) -> np.ndarray:
    """[steps, ranks]: how long each rank waits for the slowest rank's compute."""
    return compute.max(axis=1, keepdims=True) - compute


def step_bubble_fractions(compute: np.ndarray, step_time: np.ndarray) -> np.ndarray:
    """Per step: sum over ranks of the bubble / (ranks x step time)."""
    ranks = compute.shape[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        out = rank_bubbles(compute).sum(axis=1) / (ranks * step_time)
    return np.nan_to_num(out)


def bubble_fraction(compute: np.ndarray, step_time: np.ndarray) -> float:
    """Over all steps: total rank-time spent waiting / total rank-time."""
    ranks = compute.shape[1]
    total = ranks * float(step_time.sum())
    return 0.0 if total <= 0 else float(rank_bubbles(compute).sum()) / total


def idle_fraction(compute: np.ndarray, step_time: np.ndarray, share: bool = False) -> float:
    """1 - mean dense compute / step time over ranks: the share of rank-time not spent
    computing (straggler waits, exposed communication, data waits and the rest together).
    With ``share=True``, ``compute``'s own share of rank-time instead (e.g. exposed comm)."""
    total = compute.shape[1] * float(step_time.sum())
    if total <= 0:
        return 0.0
    used = float(compute.sum()) / total
    return used if share else 1.0 - used


def overlap_fraction(comm: np.ndarray, exposed: np.ndarray) -> float:
    """Share of the time collectives were in flight that the compute thread did not wait through."""
    total = float(comm.sum())
    return 0.0 if total <= 0 else 1.0 - float(exposed.sum()) / total


def summarize(timings: Timings, skip_steps: int = 0) -> dict[str, float]:
    """Bubble fractions (wall and CPU clock), medians and imbalance over the measured steps, read a
    few columns at a time.

    `skip_steps` leaves out warm-up steps (allocator, first-touch) that no plan controls.
    """
    if len(timings) <= skip_steps:
        return {}

    def measured(name: str) -> np.ndarray:
        return column(timings, name)[skip_steps:]

    step_time = measured("step_s").max(axis=1)
    wall = measured("dense_compute_s")
    cpu = measured("dense_compute_cpu_s")
    cost = measured("cost")
    with np.errstate(divide="ignore", invalid="ignore"):
        cost_imbalance = np.nan_to_num(cost.max(axis=1) / cost.mean(axis=1) - 1.0)
    del cost
    waits = measured("sparse_forward_s") + measured("sparse_backward_s") + measured("allreduce_s")
    comm, exposed = measured("comm_s"), measured("exposed_comm_s")
    return {
        "bubble_fraction": bubble_fraction(wall, step_time),
        "bubble_fraction_cpu": bubble_fraction(cpu, step_time),
        "compute_bubble_fraction": bubble_fraction(wall, wall.max(axis=1)),
        "step_time_s": float(np.median(step_time)),
        "dense_compute_s": float(np.median(wall)),
        "collective_s": float(np.median(waits)),
        "data_wait_s": float(np.median(measured("data_wait_s"))),
        "imbalance": float(np.mean(cost_imbalance)),
        "comm_s": float(np.median(comm)),
        "exposed_comm_s": float(np.median(exposed)),
        "overlap_fraction": overlap_fraction(comm, exposed),
        "dense_comm_overlap_s": float(np.median(measured("dense_comm_overlap_s"))),
        "idle_fraction": idle_fraction(wall, step_time),
        "exposed_comm_fraction": idle_fraction(exposed, step_time, share=True),
        "measured_steps": float(len(step_time)),
    }
