"""The trainer: each rank streams its balanced shard, the tables are sharded, bubbles are measured.

    trainer = Trainer(config, sink)
    result = trainer.train()

The step itself, one implementation per comm mode, is ``freescale.training.loop.step``; what a
checkpoint holds and the resume, ``freescale.training.checkpoint.resume``; the random numbers,
``freescale.training.loop.seeding``; the log lines and the run summary, ``freescale.training.timing.step_report``.
Per-rank timings, communication included, are all-gathered every
``timing_sync_every`` steps; rank 0 appends each window to the run's timing file
(``freescale.costs.run_timings``) and turns the file into bubble and idle fractions at the end.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from freescale.costs.run_timings import TimingColumns, TimingFile, artifact_name
from freescale.shards.manifest import Manifest, ShardError, load_manifest
from freescale.training.timing.bubbles import TIMING_FIELDS, StepTimeLog
from freescale.training.checkpoint.checkpointer import Checkpointer
from freescale.training.config import TrainConfig, to_flat_dict
from freescale.training.parallel.distributed import DistEnv, all_ranks_ok, bound_collectives, init_distributed
from freescale.training.eval.evaluator import SPLIT_PREFIX, NegativeDraws, check_protocol, evaluate
from freescale.training.model.recommender import build_model
from freescale.training.checkpoint.init_from import warm_start
from freescale.training.checkpoint.resume import LoaderPosition, checkpoint_states, resume_latest
from freescale.training.loop.seeding import StepNegatives, rank_generator, seed_initial_weights
from freescale.training.data.shard_reader import build_loader, stop_prefetch
from freescale.training.data.replanned_reader import build_replanned_loader, check_replan
from freescale.shards.replan import Replan, ReplanFiles
from freescale.training.parallel.sharding import broadcast_dense, dense_parameters, shard_model
from freescale.training.loop.step import BatchStream, StepParts, build_step
from freescale.training.loop.schedule import LearningRateSchedule
from freescale.training.timing.step_report import MetricsSink, StepReporter, run_summary, step_losses
from freescale.training.eval.validation import Validation


class NullSink:
    """No record; keeps a resumed record's state, so a later tracked resume still continues it."""

    def __init__(self, state: dict[str, Any] | None = None):
        self.state = state or {}

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return self.state


@dataclass
class TrainResult:
    """What a run produced; identical on every rank (built from gathered data) but ``timings``."""

    summary: dict[str, float]
    timings: Path | None
    """Rank 0: the run's timing file (``TimingColumns`` reads it; the trainer's own temporary one
    lasts until ``Trainer.close``); None on the other ranks, and when no step was trained."""
    steps: list[int]
    losses: list[float]
    """Global loss per step (targets-weighted over all ranks)."""
    manifest: Manifest | None = None
    comm_issue_order: list[str] = field(default_factory=list)
    """Rank 0's collectives of one steady-state step (the second this process trained), in the order issued
    (empty in plain mode, whose collectives TorchRec issues)."""


class Trainer:
    def __init__(self, config: TrainConfig, sink: MetricsSink | None = None, env: DistEnv | None = None,
                 timings_file: str | Path | None = None):
        """``timings_file``: where rank 0 writes the timing file (None: a temporary folder of its own)."""
        self.config = config
        self._timings_dir: tempfile.TemporaryDirectory | None = None
        self.sink = sink or NullSink()
        self.env = env or init_distributed(config.parallel, config.training.threads)
        # One job per checkpoint folder, until close(): taken first, so a refused job stops
        # before it reads shards or builds the model.
        self.checkpointer = Checkpointer(config.checkpoint.folder, self.env.rank, self.env.host_group,
                                         keep_last=config.checkpoint.keep_last)
        self.checkpointer.lock()
        try:
            self.manifest, self.loader = self._open_shards()
            check_protocol(config.evaluation, self.manifest)  # before training, not after it
            seed_initial_weights(config.training.seed)
            # Two names, two objects: `sharded_model` is TorchRec's DistributedModelParallel
            # wrapper (state dict, fused optimizer, comm routes); `model` is the recommender
            # inside it, whose tables DMP replaced by sharded ones (forward, lookups, evaluation).
            self.sharded_model = shard_model(
                build_model(self.manifest.num_items, config.model, self.env.device,
                            user_features=[(f.name, f.num_ids) for f in self.manifest.user_features],
                            precision=config.training.precision, cuda_graphs=config.training.cuda_graphs),
                config.optimizer, config.parallel, self.env)
            self.model = self.sharded_model.module
            dense = dense_parameters(self.sharded_model)
            broadcast_dense(dense, group=self.env.device_group)
            self.dense_optimizer = torch.optim.Adam(dense, lr=config.optimizer.dense_lr,
                                                    weight_decay=config.optimizer.weight_decay)
            self.generator = rank_generator(config.training.seed, self.env.rank)
            negatives = StepNegatives(self.model, config.loss, config.training.seed, self.env.rank, self.env.device)
            self.training_step = build_step(config, StepParts(self.model, self.dense_optimizer, config.loss,
                                                              self.generator, negatives, self.env.world_size,
                                                              config.optimizer.max_grad_norm),
                                            self.sharded_model, self.env, dense)
            self.log = StepTimeLog(self.env.world_size, config.training.timing_sync_every, self.env.host_group)
            self.step = 0
            self._set_up_ended = False
            planned, self.max_steps = planned_steps(config, self.manifest.num_steps)
            if self.replan is not None:
                self.max_steps = replanned_end(self.max_steps, self.replan, self.manifest.num_steps)
            self.schedule = LearningRateSchedule(config.optimizer, planned, self.dense_optimizer,
                                                 self.model.fused_optimizers())
            self.validation = Validation(config.evaluation, self.manifest.num_steps, self.sharded_model)
            # Drawn at the first validation, reused by the later ones and the test.
            self.eval_negatives = NegativeDraws(self.manifest.num_items, config.evaluation.sampled_negatives,
                                                config.training.seed)
            self.resumed_sink_state: dict[str, Any] = {}
            self._load_start()
            if self.replan is not None:
                self._check_replan_start()
            self.timing_file = self._open_timing_file(timings_file)
        except BaseException:
            self.close()
            raise
        if self.env.rank == 0:
            print(f"freescale train: {self.describe_comm()}", file=sys.stderr, flush=True)

    def describe_comm(self) -> str:
        """Which comm mode and transport actually run (logged once, and recorded as a run tag)."""
        return self.training_step.describe()

    def _open_timing_file(self, path: str | Path | None) -> TimingFile | None:
        """Rank 0's timing file (written from the first step this process trains)."""
        if self.env.rank != 0:
            return None
        if path is None:
            self._timings_dir = tempfile.TemporaryDirectory(prefix="freescale-timings-")
            path = Path(self._timings_dir.name) / artifact_name(self.step)
        return TimingFile(path, TIMING_FIELDS, self.env.world_size)

    def _open_shards(self) -> tuple[Manifest, Any]:
        """Load and check the manifest and this rank's files on every rank, then agree.

        The manifest is read once here and passed to everything that needs it. A rank
        with a bad shard must not leave the others blocked in the first collective:
        each rank reports success, and all stop if any failed.
        """
        error: Exception | None = None
        manifest, loader, self.replan = None, None, None
        data = self.config.data
        try:
            if data.replan:
                manifest = load_manifest(data.shards)
                self.replan = check_replan(ReplanFiles(data.replan), manifest, self.env.world_size)
                loader = build_replanned_loader(manifest, ReplanFiles(data.replan), self.env.rank,
                                                prefetch=data.prefetch)
            else:
                manifest = load_manifest(data.shards, self.env.world_size, self.env.rank)
                loader = build_loader(manifest, self.env.rank, prefetch=data.prefetch, verify=data.verify_checksums,
                                      seed=self.config.training.seed, repeat=True)
            iter(loader)  # opens and checks every file footer of this rank
        except ShardError as exc:
            error = exc
        if not all_ranks_ok(error is None, self.env.host_group):
            raise error or ShardError(f"rank {self.env.rank}: another rank's shard failed its checks "
                                      "(its error names the file)")
        return manifest, loader

    def _check_replan_start(self) -> None:
        """A re-plan starts at the checkpoint it was made from: any other step would train samples twice or never."""
        assert self.replan is not None
        first, end = self.replan.from_step, self.replan.from_step + self.replan.num_steps
        if not first <= self.step <= end:
            raise ShardError(f"re-plan {self.config.data.replan} covers steps {first}..{end - 1}, but the checkpoint "
                             f"in {self.config.checkpoint.folder} is at step {self.step}")

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This rank's progress (the trainer is one of its checkpoint's ``Stateful`` objects)."""
        return {"step": self.step, "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
                "sink": self.sink.state_dict(), "validation": self.validation.record.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_progress(state)
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])

    def load_progress(self, state: dict[str, Any]) -> None:
        """The run's progress, which every rank shares: its step, validation record and MLflow record."""
        self.step = int(state["step"])
        self.validation.record.load_state_dict(state.get("validation", {}))
        # The sink is built after the resume (it continues the record named here).
        self.resumed_sink_state = state.get("sink") or {}

    def _load_start(self) -> None:
        """Where the run starts: its own newest checkpoint (a resume), else ``training.init_from``'s weights
        (a warm start at step 0), else the cold start's. A resume wins, so a warm-started run that
        restarts continues from its own checkpoints."""
        config = self.config
        resumed = None
        if config.checkpoint.resume:
            resumed = resume_latest(self.checkpointer, config, self.manifest.sha256, self.env.rank, self.dense_optimizer,
                                    self._checkpoint_states(), self.max_steps, self.env.world_size)
        if not config.training.init_from:
            return
        if resumed is not None:
            if self.env.rank == 0:
                print(f"freescale train: note: resuming {self.checkpointer.step_dir(resumed)}: training.init_from "
                      f"{config.training.init_from} is not loaded (the run continues its own weights)",
                      file=sys.stderr, flush=True)
            return
        warm_start(config.training.init_from, self._checkpoint_states()[0], self.dense_optimizer, config,
                   self.manifest.num_items, self.env.rank, self.env.host_group)
        if self.validation.best is not None:  # the weights the run starts from, until a validation keeps better
            self.validation.best.keep()

    def _checkpoint_states(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return checkpoint_states(self.sharded_model, self.dense_optimizer, self,
                                 LoaderPosition(self.loader, self, self.manifest.num_steps), self.validation.best)

    def save(self) -> None:
        self.checkpointer.save(self.step, *self._checkpoint_states(), self.manifest.sha256,
                               to_flat_dict(self.config))

    def close(self) -> None:
        """Release the checkpoint folder and the timing file (also after a failure; safe to call twice)."""
        self.checkpointer.unlock()
        if getattr(self, "timing_file", None) is not None:
            self.timing_file.close()
        if self._timings_dir is not None:
            self._timings_dir.cleanup()
            self._timings_dir = None

    # ------------------------------------------------------------- the loop

    def _next_stop(self) -> int:
        """The step count at which the loop next stops: a checkpoint, a validation, or the run's end."""
        stops = [self.max_steps]
        every = self.config.checkpoint.every_steps
        if self.checkpointer.enabled and every:
            stops.append((self.step // every + 1) * every)
        if (validation_at := self.validation.next_at(self.step)) is not None:
            stops.append(validation_at)
        return min(stops)

    def train(self) -> TrainResult:
        self.model.train()
        reporter = StepReporter(self.env.world_size, self.max_steps, self.config.training.log_every)
        self.steps, self.losses = [], []
        stream = BatchStream(self.loader, self.env.device, self.step)
        while self.step < self.max_steps and not self.validation.record.stopped:
            # A step prefetches only within `batches`: at a stop nothing is in flight.
            until = self._next_stop()
            batches = stream.take(until - self.step)
            while self.step < until:
                self.schedule.apply(self.step)
                self._report(reporter, self.log.record(self.step, self.training_step.progress(batches)))
                self.step += 1
                self._end_set_up()
            assert not self.training_step.in_flight(), "an exchange was left in flight past its batches"
            # Every trained step reaches the sink before a checkpoint holds the sink's state.
            self._report(reporter, self.log.flush())
            if self.validation.due(self.step):
                self._validate()
            every = self.config.checkpoint.every_steps
            if (self.checkpointer.enabled and every and self.step % every == 0 and self.step < self.max_steps
                    and not self.validation.record.stopped):
                self.save()
        stop_prefetch(self.loader)
        self._report(reporter, self.log.flush())
        if self.replan is not None and self.step == self.replan.from_step + self.replan.num_steps:
            # The re-planned epoch is done: the run's count goes on from the plan's epoch end.
            self.step = (self.replan.epoch + 1) * self.manifest.num_steps
        if self.checkpointer.enabled:
            self.save()
        if self.validation.best is not None and self.validation.record.best_epoch:
            self.validation.best.restore()  # after the last checkpoint: it holds the last step's weights
        timings = self.timing_file.close() if self.timing_file is not None else None
        summary = self._timing_summary(timings)
        summary.update(self.validation.summary())
        summary.update(self._evaluate(tuple(SPLIT_PREFIX)))
        return TrainResult(summary, timings, self.steps, self.losses, self.manifest,
                           self.training_step.comm_issue_order)

    def _end_set_up(self) -> None:
        """After the first step this process trained (every rank has built, restored, compiled):
        ``parallel.collective_timeout_s`` bounds the collectives instead of ``init_timeout_s``."""
        if self._set_up_ended:
            return
        self._set_up_ended = True
        timeout = timedelta(seconds=self.config.parallel.collective_timeout_s)
        bound_collectives(timeout, self.env.host_group)
        self.training_step.set_timeout(timeout)

    def _timing_summary(self, timings: Path | None) -> dict[str, float]:
        """``run_summary`` of rank 0's timing file, read column by column, on every rank (a collective)."""
        summary = [run_summary(TimingColumns(timings)) if timings is not None else run_summary(
            np.zeros((0, self.env.world_size, len(TIMING_FIELDS))))] if self.env.rank == 0 else [None]
        if self.env.world_size > 1:
            dist.broadcast_object_list(summary, src=0, group=self.env.host_group)
        return summary[0]

    def _evaluate(self, uses: tuple[str, ...]) -> dict[str, float]:
        """The held-out items ``uses`` of every rank's users, scored by this run's model (a collective)."""
        return evaluate(self.model, self.manifest, self.env.rank, self.env.world_size, self.env.device,
                        self.config.training.eval_max_samples or None, self.config.evaluation,
                        self.config.training.seed, uses=uses, negatives=self.eval_negatives,
                        group=self.env.host_group)

    def _validate(self) -> None:
        """Score the validation item (a collective), record it, and keep the weights if best."""
        scores = self._evaluate(("valid",))
        improved = self.validation.take(scores, self.step, last=self.step >= self.max_steps)
        if self.env.rank != 0:
            return
        epoch, record = self.step // self.manifest.num_steps, self.validation.record
        # At the last step trained (the sink takes more metrics of a step it has): the series'
        # x-axis is the loss's.
        self.sink.log_step(self.step - 1, {"epoch/epoch": float(epoch),
                                           **{f"epoch/{name}": value for name, value in scores.items()}})
        metric = self.config.evaluation.metric
        note = "best so far" if improved else f"best {record.best_value:.4f} at epoch {record.best_epoch}"
        if record.stopped:
            note += f"; no better for {record.since_best} validation(s): stopping early"
        print(f"freescale train: epoch {epoch} {metric} {scores[metric]:.4f} ({note})", file=sys.stderr, flush=True)

    def _report(self, reporter: StepReporter, window: tuple[list[int], np.ndarray] | None) -> None:
        """The steps just gathered (None: none were): every rank keeps their losses; rank 0 appends
        them to the timing file, prints and records them."""
        if window is None:
            return
        steps, gathered = window
        self.steps.extend(steps)
        self.losses.extend(float(loss) for loss in step_losses(gathered))
        if self.timing_file is not None:
            self.timing_file.append(steps, gathered)
            reporter.report(self.sink, gathered, steps)


def planned_steps(config: TrainConfig, steps_per_epoch: int) -> tuple[int, int]:
    """``(planned, max_steps)``: the steps the run plans (the learning-rate schedule's horizon:
    ``max_epochs`` passes, else ``max_steps``, else one pass) and where it stops (``max_steps``
    caps the plan)."""
    training = config.training
    planned = training.max_epochs * steps_per_epoch or training.max_steps or steps_per_epoch
    return planned, min(planned, training.max_steps or planned)


def replanned_end(max_steps: int, replan: Replan, steps_per_epoch: int) -> int:
    """Where a run on a re-plan stops: the re-planned epoch's end, or ``max_steps`` where the run's
    plan ends before the epoch would have (the re-plan's steps are not the plan's: only an end
    inside the epoch is kept, as a step count from the re-plan's start)."""
    end = replan.from_step + replan.num_steps
    epoch_end = (replan.epoch + 1) * steps_per_epoch
    return end if max_steps >= epoch_end else min(max_steps, end)


def run(config: TrainConfig, sink: MetricsSink | None = None, timings_file: str | Path | None = None) -> TrainResult:
    """One training; its ``timings`` file outlives it only when ``timings_file`` says where."""
    trainer = Trainer(config, sink, timings_file=timings_file)
    try:
        return trainer.train()
    finally:
        trainer.close()
