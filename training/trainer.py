"""The trainer: each rank streams its balanced shard, the tables are sharded, bubbles are measured.

    trainer = Trainer(config, sink)
    result = trainer.train()

A ``plain`` step (``comm.mode``): next batch (timed as data wait) -> sharded
embedding lookup (TorchRec's blocking all-to-alls) -> dense HSTU forward + backward
(the work the plan balanced; timed on the wall and thread CPU clocks between the
lookup's return and the gradient reaching the lookup's output) -> sparse backward
(all-to-all + fused optimizer) -> dense gradient all-reduce -> dense optimizer.

An ``overlap`` / ``prioritized`` step (``overlapped_step``, the comm layer in
``comm/``): this step's ids already left during the previous step; its rows come
back in priority groups while the next step's ids leave; the dense span starts when
the first group is in; gradients leave during the backward as they become ready
(embedding groups and dense buckets); the step ends waiting for them, the fused
update and the dense optimizer. Per-rank timings, communication included, are
all-gathered every ``timing_sync_every`` steps; rank 0 turns them into bubble and
idle fractions.
"""
from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch

from comm.clock import overlap_length
from training import bubbles
from training.batch import SequenceBatch
from training.comm_layer import build_comm_layer
from shards.manifest import Manifest, ShardError, load_manifest
from training.checkpoint import Checkpointer, materialize_optimizer_state
from training.config import TrainConfig, to_flat_dict
from training.distributed import DistEnv, all_ranks_ok, init_distributed
from training.evaluator import check_protocol, evaluate
from training.model import build_model
from training.shard_reader import build_loader, stop_prefetch
from training.sharding import DenseGradSync, broadcast_dense, dense_parameters, shard_model

WARMUP_STEPS = 2  # first steps pay allocator and first-touch costs no plan controls


class MetricsSink(Protocol):
    def log_step(self, step: int, metrics: dict[str, float]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this record (part of rank 0's checkpoint)."""
        ...


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
    """What a run produced; identical on every rank (built from gathered data)."""

    summary: dict[str, float]
    timings: np.ndarray
    """[steps, ranks, fields] of bubbles.TIMING_FIELDS."""
    steps: list[int]
    losses: list[float]
    """Global loss per step (targets-weighted over all ranks)."""
    manifest: Manifest | None = None
    comm_issue_order: list[str] = field(default_factory=list)
    """Rank 0's collectives of one steady-state step (the second), in the order issued
    (empty in plain mode, whose collectives TorchRec issues)."""


class Trainer:
    def __init__(self, config: TrainConfig, sink: MetricsSink | None = None, env: DistEnv | None = None):
        self.config = config
        self.sink = sink or NullSink()
        self.env = env or init_distributed(config.parallel, config.training.threads)
        # One job per checkpoint folder, until close(): taken first, so a refused job stops
        # before it reads shards or builds the model.
        self.checkpointer = Checkpointer(config.checkpoint.folder, self.env.rank)
        self.checkpointer.lock()
        try:
            self.manifest, self.loader = self._open_shards()
            check_protocol(config.evaluation, self.manifest)  # before training, not after it
            torch.manual_seed(config.training.seed)
            # Two names, two objects: `sharded_model` is TorchRec's DistributedModelParallel
            # wrapper (state dict, fused optimizer, comm routes); `model` is the recommender
            # inside it, whose tables DMP replaced by sharded ones (forward, lookups, evaluation).
            self.sharded_model = shard_model(
                build_model(self.manifest.num_items, config.model, self.env.device,
                            user_features=[(f.name, f.num_ids) for f in self.manifest.user_features]),
                config.optimizer, config.parallel, self.env)
            self.model = self.sharded_model.module
            dense = dense_parameters(self.sharded_model)
            broadcast_dense(dense)
            self.comm = build_comm_layer(config.comm, self.sharded_model, self.env, dense,
                                         timedelta(seconds=config.parallel.collective_timeout_s))
            # Averages the dense gradients after the backward: one flat all-reduce (plain), or
            # waiting for the buckets the backward already issued (comm layer).
            self.sync_dense_grads = DenseGradSync(dense) if self.comm is None else self.comm.dense_sync.finish
            self._next: tuple[SequenceBatch, torch.Tensor, Any] | None = None  # prefetched (batch, negatives, exchange)
            self._dense_span: tuple[float, float, float] | None = None  # (start, end, thread CPU) of this step
            self.comm_issue_order: list[str] = []
            self.dense_optimizer = torch.optim.Adam(dense, lr=config.optimizer.dense_lr,
                                                    weight_decay=config.optimizer.weight_decay)
            # Negatives and dropout differ per rank but replay exactly on resume.
            self.generator = torch.Generator().manual_seed(config.training.seed * 1_000_003 + self.env.rank)
            torch.manual_seed(config.training.seed * 1_000_003 + self.env.rank)
            self.meter = bubbles.BubbleMeter(self.env.world_size, config.training.timing_sync_every)
            self.step = 0
            self.max_steps = config.training.max_steps or self.manifest.num_steps
            self.resumed_sink_state: dict[str, Any] = {}
            if config.checkpoint.resume:
                self.resume()
        except BaseException:
            self.close()
            raise
        if self.env.rank == 0:
            print(f"freescale train: {self.describe_comm()}", file=sys.stderr, flush=True)

    def describe_comm(self) -> str:
        """Which comm mode and transport actually run (logged once, and recorded as a run tag)."""
        if self.comm is None:
            return (f"comm mode plain: TorchRec's blocking lookups and one dense all-reduce after the backward, "
                    f"over {self.env.backend}")
        return self.comm.describe()

    def negatives(self, step: int) -> torch.Tensor:
        """Step ``step``'s uniform negatives on this rank: a function of (seed, rank, step) alone,
        so every comm mode -- which may draw them a step early -- and a resumed run use the same."""
        if self.config.loss.full_softmax:
            return torch.arange(1, self.model.num_items + 1, device=self.env.device)
        state = np.random.SeedSequence([self.config.training.seed, self.env.rank, step]).generate_state(2)
        generator = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        return self.model.sample_negatives(self.config.loss.num_negatives, torch.device("cpu"),
                                            generator).to(self.env.device)

    def _open_shards(self) -> tuple[Manifest, Any]:
        """Load and check the manifest and this rank's files on every rank, then agree.

        The manifest is read once here and passed to everything that needs it. A rank
        with a bad shard must not leave the others blocked in the first collective:
        each rank reports success, and all stop if any failed.
        """
        error: Exception | None = None
        manifest, loader = None, None
        try:
            manifest = load_manifest(self.config.data.shards, self.env.world_size, self.env.rank)
            loader = build_loader(manifest, self.env.rank, prefetch=self.config.data.prefetch,
                                  verify=self.config.data.verify_checksums)
            iter(loader)  # opens and checks every file footer of this rank
        except ShardError as exc:
            error = exc
        if not all_ranks_ok(error is None):
            raise error or ShardError(f"rank {self.env.rank}: another rank's shard failed its checks "
                                      "(its error names the file)")
        return manifest, loader

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This rank's progress (the trainer is one of its checkpoint's ``Stateful`` objects)."""
        return {"step": self.step, "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
                "sink": self.sink.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        # The sink is built after the resume (it continues the record named here).
        self.resumed_sink_state = state.get("sink") or {}

    def checkpoint_states(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(shared, own)`` ``Stateful`` objects for the checkpointer.

        Shared (through DCP): the model, the item table's fused optimizer and the dense
        optimizer. Own (this rank's file): the trainer's progress, the loader position and
        the user feature tables' fused optimizer. The user tables are sharded table-wise and
        their bag collection's optimizer lists only the tables a rank holds (unlike the item
        table's, whose state is a ShardedTensor on every rank), so DCP would find keys only
        some ranks have; the same world size and plan put the same tables on the same rank on
        resume. Each sharded collection owns its fused optimizer, so no key needs parsing.
        """
        shared = {"model": self.sharded_model, "sparse_optimizer": self.model.embedding_collection.fused_optimizer,
                  "dense_optimizer": self.dense_optimizer}
        own: dict[str, Any] = {"trainer": self, "loader": self.loader}
        if self.model.user_embedding_collection is not None:
            own["user_table_optimizer"] = self.model.user_embedding_collection.fused_optimizer
        return shared, own

    def save(self) -> None:
        self.checkpointer.save(self.step, *self.checkpoint_states(), self.manifest.sha256, to_flat_dict(self.config))

    def close(self) -> None:
        """Release the checkpoint folder (also after a failure; safe to call twice)."""
        self.checkpointer.unlock()

    def resume(self) -> None:
        step = self.checkpointer.latest_step()
        if step is None:
            return
        self.checkpointer.check_shards(step, self.manifest.sha256)
        changed = self.checkpointer.check_config(step, to_flat_dict(self.config))
        if changed and self.env.rank == 0:
            print(f"freescale train: warning: resuming {self.checkpointer.step_dir(step)} with changed "
                  f"settings: {', '.join(changed)}", file=sys.stderr, flush=True)
        materialize_optimizer_state(self.dense_optimizer)
        self.checkpointer.load(step, *self.checkpoint_states())
        if self.step >= self.max_steps and self.env.rank == 0:
            print(f"freescale train: checkpoint {self.checkpointer.step_dir(step)} already reached max_steps "
                  f"{self.max_steps}: nothing left to train, evaluating only", file=sys.stderr, flush=True)

    # --------------------------------------------------------------- training

    def train_step(self, batch: SequenceBatch, timing: bubbles.StepTiming) -> None:
        if batch.batch_size == 0:
            return self.idle_step(timing)
        probe = bubbles.DenseSpanProbe()
        start_wall = time.perf_counter()
        loss, stats = self.model(batch, self.config.loss.num_negatives,
                                  full_softmax=self.config.loss.full_softmax, generator=self.generator,
                                  probe=probe, negative_ids=self.negatives(self.step))
        local_targets = float(stats["num_targets"])
        loss = self._rank_loss(loss, local_targets, batch)
        backward_start = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        self._finish_step(timing)
        timing.sparse_forward_s = probe.start_wall - start_wall
        dense_end_wall = probe.end_wall if probe.end_wall is not None else backward_end
        dense_end_cpu = probe.end_cpu if probe.end_cpu is not None else time.thread_time()
        timing.dense_compute_s = dense_end_wall - probe.start_wall
        timing.dense_compute_cpu_s = dense_end_cpu - probe.start_cpu
        timing.sparse_backward_s = backward_end - max(dense_end_wall, backward_start)
        timing.loss_sum = float(stats["loss"]) * local_targets
        timing.targets = local_targets

    def idle_step(self, timing: bubbles.StepTiming) -> None:
        """A rank the plan gave no samples this step still joins the step's collectives."""
        empty = torch.zeros(0, dtype=torch.int64, device=self.env.device)
        start = time.perf_counter()
        items, negative_embeddings = self.model.lookup(empty, empty, self.negatives(self.step))
        # The user tables' lookup is a collective too: the busy ranks are in it.
        users = self.model.lookup_users(empty.view(0, len(self.model.user_feature_names)))
        timing.sparse_forward_s = time.perf_counter() - start
        start = time.perf_counter()
        zero = items.sum() * 0.0 + negative_embeddings.sum() * 0.0
        (zero if users is None else zero + users.sum() * 0.0).backward()
        timing.sparse_backward_s = time.perf_counter() - start
        self._finish_step(timing)

    def _rank_loss(self, loss: torch.Tensor, local_targets: float, batch: SequenceBatch) -> torch.Tensor:
        """Sum of this rank's target losses over the step's mean targets per rank: the
        ranks' gradients then average to the step's per-target mean whatever the plan."""
        if batch.step_targets > 0:
            return loss * (local_targets * self.env.world_size / batch.step_targets)
        return loss

    def _finish_step(self, timing: bubbles.StepTiming) -> None:
        t = time.perf_counter()
        self.sync_dense_grads()
        timing.allreduce_s = time.perf_counter() - t
        t = time.perf_counter()
        self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=True)
        timing.optimizer_s = time.perf_counter() - t

    # ------------------------------------------------- overlapped (comm layer)

    def _next_batch(self, timing: bubbles.StepTiming) -> SequenceBatch:
        start = time.perf_counter()
        try:
            batch = next(self._iterator)
        except StopIteration:  # past one pass over the shards: next epoch, same plan
            self._iterator = iter(self.loader)
            batch = next(self._iterator)
        timing.data_wait_s += time.perf_counter() - start
        return batch.to(self.env.device)

    def _checkpoint_after(self, step: int) -> bool:
        every = self.config.checkpoint.every_steps
        return bool(self.checkpointer.enabled and every and (step + 1) % every == 0)

    def _start_exchange(self, step: int, timing: bubbles.StepTiming) -> tuple[SequenceBatch, torch.Tensor, Any]:
        batch = self._next_batch(timing)
        negatives = self.negatives(step)
        return batch, negatives, self.comm.start(batch, negatives)

    def overlapped_step(self, timing: bubbles.StepTiming) -> None:
        """One step with the comm layer: this step's ids left during the previous step; the
        next step's leave during this one, except before a checkpoint or the last step (no
        collective is in flight then, and the loader's saved position is exact)."""
        batch, negatives, exchange = self._next or self._start_exchange(self.step, timing)
        self._next = None
        timing.samples, timing.cost = float(batch.batch_size), float(batch.cost)
        start = time.perf_counter()
        exchange.look_up()
        looked_up = time.perf_counter()
        if self.step + 1 < self.max_steps and not self._checkpoint_after(self.step):
            self._next = self._start_exchange(self.step + 1, timing)
        forward_start = time.perf_counter()
        probe = bubbles.DenseSpanProbe()
        self._dense_span = None
        if batch.batch_size:
            loss, stats = self.model(batch, self.config.loss.num_negatives,
                                      full_softmax=self.config.loss.full_softmax, generator=self.generator,
                                      probe=probe, negative_ids=negatives, exchanged=exchange)
            local_targets = float(stats["num_targets"])
            loss = self._rank_loss(loss, local_targets, batch)
            timing.sparse_forward_s = (looked_up - start) + (probe.start_wall - forward_start)
            if self._next is not None:
                self._next[2].send_ids()
            loss.backward()
            end_wall = probe.end_wall if probe.end_wall is not None else time.perf_counter()
            end_cpu = probe.end_cpu if probe.end_cpu is not None else time.thread_time()
            self._dense_span = (probe.start_wall, end_wall, end_cpu - probe.start_cpu)
            timing.loss_sum = float(stats["loss"]) * local_targets
            timing.targets = local_targets
        else:
            timing.sparse_forward_s = looked_up - start
            if self._next is not None:
                self._next[2].send_ids()
        t = time.perf_counter()
        exchange.finish_backward()
        timing.sparse_backward_s = time.perf_counter() - t
        self._finish_step(timing)

    def _record_comm(self, timing: bubbles.StepTiming, start: float, end: float) -> None:
        """The step's collective timings; under overlap the dense span excludes the time its
        thread waited on a collective inside it (the lowest-priority group at the loss)."""
        if self.comm is None:  # every collective blocks: its phases are the communication
            timing.comm_s = timing.exposed_comm_s = (timing.sparse_forward_s + timing.sparse_backward_s
                                                     + timing.allreduce_s)
            return
        seen = self.comm.clock.close_step(start, end)
        timing.comm_s, timing.exposed_comm_s = seen.comm_s, seen.exposed_comm_s
        if self._dense_span is not None:
            a, b, cpu = self._dense_span
            waited = overlap_length(seen.waits, a, b)
            timing.dense_compute_s = (b - a) - waited
            timing.dense_compute_cpu_s = cpu
            timing.dense_comm_overlap_s = max(0.0, overlap_length(seen.intervals, a, b) - waited)

    # ------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        self.model.train()
        self._iterator = iter(self.loader)
        log_every = max(1, self.config.training.log_every)
        self._recent_step_s: collections.deque[float] = collections.deque(maxlen=log_every)  # the ETA's pace
        while self.step < self.max_steps:
            timing = bubbles.StepTiming()
            start = time.perf_counter()
            if self.comm is None:
                batch = self._next_batch(timing)
                timing.samples, timing.cost = float(batch.batch_size), float(batch.cost)
                self.train_step(batch, timing)
            else:
                self.overlapped_step(timing)
            timing.step_s = time.perf_counter() - start
            self._record_comm(timing, start, start + timing.step_s)
            if self.comm is not None and self.step == 1:
                self.comm_issue_order = list(self.comm.clock.step_issue_log)
            self._report(self.meter.record(self.step, timing), log_every)
            self.step += 1
            if self._checkpoint_after(self.step - 1) and self.step < self.max_steps:
                # Every trained step reaches the sink before the checkpoint holds the sink's state.
                self._report(self.meter.flush(), log_every)
                self.save()
        assert self._next is None, "an exchange was left in flight past the last step"
        stop_prefetch(self.loader)
        self._report(self.meter.flush(), log_every)
        if self.checkpointer.enabled:
            self.save()
        table = self.meter.table()
        summary = bubbles.summarize(table, skip_steps=min(WARMUP_STEPS, max(0, len(table) - 1)))
        losses = step_losses(table)
        summary["loss"] = float(np.mean(losses[-max(1, len(losses) // 10):])) if len(losses) else float("nan")
        total_time = float(bubbles.column(table, "step_s").max(axis=1).sum())
        summary["samples_per_s"] = float(bubbles.column(table, "samples").sum()) / total_time if total_time else 0.0
        summary.update(evaluate(self.model, self.manifest, self.env.rank, self.env.world_size, self.env.device,
                                self.config.training.eval_max_samples or None, self.config.evaluation,
                                self.config.training.seed))
        return TrainResult(summary, table, list(self.meter.steps), list(losses), self.manifest,
                           self.comm_issue_order)

    def _report(self, gathered: np.ndarray | None, log_every: int) -> None:
        """Rank 0 prints and records the steps just gathered (None: none were)."""
        if gathered is not None and self.env.rank == 0:
            self._log_steps(gathered, self.meter.steps[-len(gathered):], log_every)

    def _log_steps(self, gathered: np.ndarray, steps: list[int], log_every: int) -> None:
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
            if self.env.world_size <= 16:
                for r in range(self.env.world_size):
                    metrics[f"step/compute_s.rank{r}"] = float(compute[i, r])
                    metrics[f"step/comm_s.rank{r}"] = float(comm[i, r])
                    metrics[f"step/exposed_comm_s.rank{r}"] = float(exposed[i, r])
            self.sink.log_step(step, metrics)
            self._recent_step_s.append(float(step_time[i]))
            if step == 0 or (step + 1) % log_every == 0 or step == self.max_steps - 1:
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

def step_losses(table: np.ndarray) -> np.ndarray:
    """Global loss per step: the sum of target losses over all ranks / all targets."""
    if len(table) == 0:
        return np.zeros(0)
    loss_sum = bubbles.column(table, "loss_sum").sum(axis=1)
    targets = bubbles.column(table, "targets").sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.nan_to_num(loss_sum / targets)


def run(config: TrainConfig, sink: MetricsSink | None = None) -> TrainResult:
    trainer = Trainer(config, sink)
    try:
        return trainer.train()
    finally:
        trainer.close()
