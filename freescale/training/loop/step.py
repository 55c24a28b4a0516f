"""One training step per comm mode behind one interface, as TorchRec's ``TrainPipeline.progress``.

    step = build_step(config, parts, sharded_model, env, dense)
    stream = BatchStream(loader, device, first_step)
    batches = stream.take(n)              # the steps up to the next checkpoint or the run's end
    timing = step.progress(batches)       # one step; StopIteration when batches is spent

``plain`` (``BlockingStep``): next batch -> TorchRec's blocking lookups -> dense
forward + backward (the work the plan balanced) -> the tables' backward (all-to-all
and fused optimizer) -> one dense all-reduce -> dense optimizer.

``overlap`` / ``prioritized`` (``OverlappedStep``, the comm layer): this step's ids
left during the previous step; its rows come back (in priority groups) while the
next batch's ids leave; the dense span starts when the rows the encoder needs are
in; gradients leave during the backward as they become ready (embedding groups and
dense buckets); the step ends waiting for them, the fused update and the dense
optimizer. A step prefetches only from ``batches``: where they end (a checkpoint,
the last step) nothing is in flight and the loader's saved position is exact.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from freescale.training.data.batch import SequenceBatch
from freescale.training.timing.bubbles import StepTiming
from freescale.training.parallel.comm_layer import BatchExchange, CommLayer
from freescale.training.config import LossConfig, TrainConfig
from freescale.training.parallel.distributed import DistEnv
from freescale.training.model.recommender import EmbeddingSource, SequentialRecommender, TableLookup
from freescale.training.parallel.sharding import DenseGradSync
from freescale.training.timing.step_timer import StepTimer


@dataclass(frozen=True)
class StepBatch:
    step: int
    """The run's step (counted across epochs and resumes): the negatives are drawn for it."""
    batch: SequenceBatch


class BatchStream:
    """This rank's batches, epoch after epoch (the loader repeats, each epoch in its own order of the
    plan's steps), numbered by the run's step, on the device."""

    def __init__(self, loader: Any, device: torch.device, first_step: int):
        self.loader, self.device, self.next_step = loader, device, first_step
        self._iterator = iter(loader)

    def take(self, count: int) -> Iterator[StepBatch]:
        """The next ``count`` batches; the loader is not read past them."""
        for _ in range(count):
            try:
                batch = next(self._iterator)
            except StopIteration:  # a loader that stops after one pass: start it again
                self._iterator = iter(self.loader)
                batch = next(self._iterator)
            self.next_step += 1
            yield StepBatch(self.next_step - 1, batch.to(self.device))


@dataclass
class StepParts:
    """What every mode's step computes with."""

    model: SequentialRecommender
    dense_optimizer: torch.optim.Optimizer
    loss: LossConfig
    generator: torch.Generator
    """The in-batch negative cap's draws (per rank, checkpointed)."""
    negatives: Callable[[int, SequenceBatch], torch.Tensor]
    """(step, this rank's batch) -> its uniform negatives (``freescale.training.loop.seeding.StepNegatives``)."""
    world_size: int
    max_grad_norm: float = 0.0
    """Clip the averaged dense gradients to this global L2 norm (0: no clipping)."""


@dataclass
class InFlight:
    """A batch whose exchange has started: its ids are on their way to the ranks holding their rows."""

    step: int
    batch: SequenceBatch
    negatives: torch.Tensor
    exchange: BatchExchange


class TrainStep(ABC):
    """One comm mode's training step."""

    sync_dense_grads: Callable[[], None]
    """Averages the dense gradients over the ranks."""

    def __init__(self, parts: StepParts):
        self.parts = parts
        self.comm_issue_order: list[str] = []
        """Rank 0's collectives of one steady-state step (the second this process trained, so a
        resumed run has one too), in the order issued (empty in plain mode, whose collectives
        TorchRec issues)."""

    @abstractmethod
    def progress(self, batches: Iterator[StepBatch]) -> StepTiming:
        """Train one step on the next of ``batches`` (StopIteration when there is none)."""

    @abstractmethod
    def describe(self) -> str:
        """Which comm mode and transport run (logged once, and recorded as a run tag)."""

    def in_flight(self) -> bool:
        """Whether a later batch's exchange has started (never at a checkpoint or the end)."""
        return False

    def set_timeout(self, timeout: timedelta) -> None:
        """The bound on the step's own waits, beyond its process groups' (a comm backend's; plain
        mode has none)."""
        return None

    def _loss(self, batch: SequenceBatch, negatives: torch.Tensor, source: EmbeddingSource,
              timer: StepTimer) -> torch.Tensor:
        """This rank's loss, scaled so the ranks' gradients average to the step's per-target
        mean whatever the plan: the sum of its target losses over the mean targets per rank."""
        parts = self.parts
        loss, stats = parts.model(batch, parts.loss.num_negatives, full_softmax=parts.loss.full_softmax,
                                  generator=parts.generator, negative_ids=negatives, source=source,
                                  loss_kind=parts.loss.kind)
        timer.loss(stats)
        if batch.step_targets > 0:
            # The host's count (SequenceBatch.num_targets): reading stats' would wait for the GPU.
            return loss * (batch.num_targets * parts.world_size / batch.step_targets)
        return loss

    def _finish(self, timer: StepTimer) -> None:
        """The dense gradients' sync and the dense optimizer: every mode's step ends here."""
        with timer.phase("allreduce_s"):
            self.sync_dense_grads()
        with timer.phase("optimizer_s"):
            if self.parts.max_grad_norm:
                # After the average, so every rank clips the same gradients by the same factor.
                torch.nn.utils.clip_grad_norm_([p for group in self.parts.dense_optimizer.param_groups
                                                for p in group["params"]], self.parts.max_grad_norm)
            self.parts.dense_optimizer.step()
            self.parts.dense_optimizer.zero_grad(set_to_none=True)


class BlockingStep(TrainStep):
    """``plain``: TorchRec's blocking lookups and one flat dense all-reduce after the backward."""

    def __init__(self, parts: StepParts, dense: list[nn.Parameter], backend: str,
                 group: dist.ProcessGroup | None = None):
        super().__init__(parts)
        self.sync_dense_grads = DenseGradSync(dense, group)
        self.backend = backend

    def describe(self) -> str:
        return (f"comm mode plain: TorchRec's blocking lookups and one dense all-reduce after the backward, "
                f"over {self.backend}")

    def progress(self, batches: Iterator[StepBatch]) -> StepTiming:
        timer = StepTimer()
        with timer.phase("data_wait_s"):
            current = next(batches)
        batch = current.batch
        negatives = self.parts.negatives(current.step, batch)
        timer.carried(batch)
        if batch.batch_size:
            with timer.model_pass("forward"):
                loss = self._loss(batch, negatives, timer.timed(TableLookup(self.parts.model)), timer)
            with timer.model_pass("backward"):
                loss.backward()
        else:
            self._idle(negatives, timer)
        self._finish(timer)
        return timer.close_blocking()

    def _idle(self, negatives: torch.Tensor, timer: StepTimer) -> None:
        """A rank the plan gave no samples this step still joins the step's collectives."""
        model = self.parts.model
        empty = torch.zeros(0, dtype=torch.int64, device=negatives.device)
        with timer.phase("sparse_forward_s"):
            items, negative_rows = model.lookup(empty, empty, negatives)
            # The user tables' lookup is a collective too: the busy ranks are in it.
            users = model.lookup_users(empty.view(0, len(model.user_feature_names)))
        with timer.phase("sparse_backward_s"):
            zero = items.sum() * 0.0 + negative_rows.sum() * 0.0
            (zero if users is None else zero + users.sum() * 0.0).backward()


class OverlappedStep(TrainStep):
    """``overlap`` and ``prioritized``: the comm layer's exchange, a step ahead; the two differ
    in the layer's groups (one, or the configured priority groups)."""

    def __init__(self, parts: StepParts, layer: CommLayer):
        super().__init__(parts)
        self.layer = layer
        self.sync_dense_grads = layer.dense_sync.finish
        self._next: InFlight | None = None
        self._trained = 0

    def describe(self) -> str:
        return self.layer.describe()

    def in_flight(self) -> bool:
        return self._next is not None

    def set_timeout(self, timeout: timedelta) -> None:
        self.layer.backend.set_timeout(timeout)

    def progress(self, batches: Iterator[StepBatch]) -> StepTiming:
        timer = StepTimer()
        current = self._next or self._start(batches, timer)
        self._next = None
        timer.carried(current.batch)
        with timer.phase("sparse_forward_s"):
            current.exchange.look_up()
        self._next = self._start_next(batches, timer)
        if current.batch.batch_size:
            with timer.model_pass("forward"):
                loss = self._loss(current.batch, current.negatives, timer.timed(current.exchange), timer)
            self._send_next_ids()
            with timer.model_pass("backward"):
                loss.backward()
        else:
            self._send_next_ids()
        with timer.phase("sparse_backward_s"):
            current.exchange.finish_backward()
        self._finish(timer)
        timing = timer.close_overlapped(self.layer.clock)
        self._trained += 1
        if self._trained == 2:  # the first had no exchange in flight when it began
            self.comm_issue_order = list(self.layer.clock.step_issue_log)
        return timing

    def _start(self, batches: Iterator[StepBatch], timer: StepTimer) -> InFlight:
        with timer.phase("data_wait_s"):
            item = next(batches)
        negatives = self.parts.negatives(item.step, item.batch)
        return InFlight(item.step, item.batch, negatives, self.layer.start(item.batch, negatives))

    def _start_next(self, batches: Iterator[StepBatch], timer: StepTimer) -> InFlight | None:
        try:
            return self._start(batches, timer)
        except StopIteration:
            return None

    def _send_next_ids(self) -> None:
        # After this step's forward, before its backward: the ids travel during the backward.
        if self._next is not None:
            self._next.exchange.send_ids()


def build_step(config: TrainConfig, parts: StepParts, sharded_model: nn.Module, env: DistEnv,
               dense: list[nn.Parameter]) -> TrainStep:
    """The step of ``config.comm.mode``."""
    if config.comm.mode == "plain":
        return BlockingStep(parts, dense, env.backend, env.device_group)
    return OverlappedStep(parts, CommLayer(config.comm, sharded_model, env, dense,
                                           timedelta(seconds=config.parallel.init_timeout_s)))
