"""The clock of one training step: the step calls it at named points, it fills the step's StepTiming.

    timer = StepTimer()
    with timer.phase("data_wait_s"):
        batch = next(batches)
    timer.carried(batch)
    timer.mark("forward")
    loss, stats = model(batch, source=timer.timed(source))   # the dense span starts when the rows are in
    loss.backward()
    timer.mark("backward_end")
    timer.loss(stats)
    timing = timer.close_blocking()          # or close_overlapped(clock)

Reading the step's clocks is all here, so a step body holds the math and the named points.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

from comm.clock import CommClock, overlap_length
from training.batch import SequenceBatch
from training.bubbles import DenseSpanProbe, StepTiming, TimedSource
from training.model import EmbeddingSource


class StepTimer:
    def __init__(self) -> None:
        self.timing = StepTiming()
        self.span = DenseSpanProbe()
        self.started = time.perf_counter()
        self._marks: dict[str, tuple[float, float]] = {}
        self._stats: dict[str, torch.Tensor] | None = None

    @contextmanager
    def phase(self, field: str) -> Iterator[None]:
        """Adds the wall time spent inside to ``field`` of the StepTiming."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self.timing, field, getattr(self.timing, field) + time.perf_counter() - start)

    def mark(self, name: str) -> None:
        """Wall and thread CPU time at a named point (``forward``, ``backward``, ``backward_end``)."""
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
