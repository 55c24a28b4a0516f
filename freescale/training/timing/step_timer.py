"""The clock of one training step: the step calls it at named points, it fills the step's StepTiming.

    timer = StepTimer()
    with timer.phase("data_wait_s"):
        batch = next(batches)
    timer.carried(batch)
    with timer.model_pass("forward"):
        loss, stats = model(batch, source=timer.timed(source))   # the dense span starts when the rows are in
    with timer.model_pass("backward"):
        loss.backward()
    timer.loss(stats)
    timing = timer.close_blocking()          # or close_overlapped(clock)

Reading the step's clocks is all here, so a step body holds the math and the named points.

Under a ``torch.profiler`` the same names are the trace's ranges: ``step_s`` around the whole
step, each phase's StepTiming field, and the ``forward`` and ``backward`` passes. With no
profiler running no range is opened (one flag read per name).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.profiler import record_function

from freescale.comm.clock import CommClock, overlap_length
from freescale.training.data.batch import SequenceBatch
from freescale.training.timing.bubbles import DenseSpanProbe, StepTiming, TimedSource
from freescale.training.model.recommender import EmbeddingSource


def _open_range(name: str) -> record_function | None:
    """A profiler range entered now; None when no profiler runs (nothing to record, nothing to pay)."""
    if not torch.autograd._profiler_enabled():
        return None
    return record_function(name).__enter__()


def _close_range(handle: record_function | None) -> None:
    if handle is not None:
        handle.__exit__(None, None, None)


class StepTimer:
    def __init__(self) -> None:
        self.timing = StepTiming()
        self.span = DenseSpanProbe()
        self.started = time.perf_counter()
        self._marks: dict[str, tuple[float, float]] = {}
        self._stats: dict[str, torch.Tensor] | None = None
        # Entered here and left in _close: a step's code creates its timer first and closes it
        # last. Named after the field that clock fills.
        self._step_range = _open_range("step_s")

    @contextmanager
    def phase(self, field: str) -> Iterator[None]:
        """Adds the wall time spent inside to ``field`` of the StepTiming (a profiler range of that name)."""
        start = time.perf_counter()
        handle = _open_range(field)
        try:
            yield
        finally:
            _close_range(handle)
            setattr(self.timing, field, getattr(self.timing, field) + time.perf_counter() - start)

    @contextmanager
    def model_pass(self, name: str) -> Iterator[None]:
        """The model's ``forward`` or ``backward`` (a profiler range of that name): wall and thread
        CPU time at its start (``name``) and end (``name_end``), which the close splits into phases."""
        self._mark(name)
        handle = _open_range(name)
        try:
            yield
        finally:
            _close_range(handle)
        self._mark(f"{name}_end")

    def _mark(self, name: str) -> None:
        self._marks[name] = (time.perf_counter(), time.thread_time())

    def timed(self, source: EmbeddingSource) -> TimedSource:
        """``source`` with this step's dense span around the rows it hands out."""
        return self.span.timed(source)

    def carried(self, batch: SequenceBatch) -> None:
        self.timing.samples, self.timing.cost = float(batch.batch_size), float(batch.cost)

    def loss(self, stats: dict[str, torch.Tensor]) -> None:
        """The model's stats of this step (read when the step closes)."""
        self._stats = stats

    def close_blocking(self) -> StepTiming:
        """Every collective blocked the thread (plain): its phases are the communication. The
        backward's part after the dense span is the tables' backward (all-to-all, fused update)."""
        t = self._close()
        if self.span.started:
            backward_end_wall, backward_end_cpu = self._marks["backward_end"]
            end_wall, end_cpu = self._span_end()
            t.dense_compute_s = end_wall - self.span.start_wall
            t.dense_compute_cpu_s = end_cpu - self.span.start_cpu
            t.sparse_backward_s = backward_end_wall - max(end_wall, self._marks["backward"][0])
        t.comm_s = t.exposed_comm_s = t.sparse_forward_s + t.sparse_backward_s + t.allreduce_s
        return t

    def close_overlapped(self, clock: CommClock) -> StepTiming:
        """Collectives ran beside the compute (comm layer): the clock says when they were in
        flight and when the thread waited; the dense span excludes the waits inside it (the
        lowest-priority group at the loss)."""
        t = self._close()
        seen = clock.close_step(self.started, self.started + t.step_s)
        t.comm_s, t.exposed_comm_s = seen.comm_s, seen.exposed_comm_s
        if self.span.started:
            a, (b, end_cpu) = self.span.start_wall, self._span_end()
            waited = overlap_length(seen.waits, a, b)
            t.dense_compute_s = (b - a) - waited
            t.dense_compute_cpu_s = end_cpu - self.span.start_cpu
            t.dense_comm_overlap_s = max(0.0, overlap_length(seen.intervals, a, b) - waited)
        return t

    def _close(self) -> StepTiming:
        t = self.timing
        t.step_s = time.perf_counter() - self.started
        _close_range(self._step_range)
        self._step_range = None
        if self.span.started:  # from the forward's call to its rows being in
            t.sparse_forward_s += self.span.start_wall - self._marks["forward"][0]
        if self._stats is not None:
            t.targets = float(self._stats["num_targets"])
            t.loss_sum = float(self._stats["loss"]) * t.targets
        return t

    def _span_end(self) -> tuple[float, float]:
        """The last gradient at the source's rows; the backward's end if none reached them (a frozen table)."""
        if self.span.end_wall is not None and self.span.end_cpu is not None:
            return self.span.end_wall, self.span.end_cpu
        return self._marks["backward_end"]
