"""Sharded checkpoints with torch.distributed.checkpoint, plus each rank's own position.

The trainer hands the checkpointer two dicts of ``Stateful`` objects (anything with
``state_dict()`` / ``load_state_dict()``): the *shared* ones go through DCP, which
saves sharded tensors once across ranks and loads them in place; each rank's *own*
ones go into its own file. A checkpoint is `<folder>/step_<n>/`: the DCP files, one
`rank_<r>.pt` per rank with what only that rank knows, `SHARDS` (the SHA-256 of the shard
manifest it trained on: a loader position means nothing in other shards), and
`CONFIG` (the run's flat config), and `COMPLETE`, written last by rank 0 after every
rank finished. A folder without `COMPLETE` (a crash mid-save) is ignored. A rank's own
state is plain data (tensors, numbers, strings, lists and dicts), and nothing of a checkpoint
is read by an unpickler that could run code from it (``freescale.training.checkpoint.safe_load``).

One job at a time: rank 0 holds `<folder>/LOCK` (host, PID) while it trains, so a
second job on the same folder is refused instead of overwriting the first one's
checkpoints. A resume into another model shape is refused; one with changed
hyperparameters continues with a warning (``shape_keys``, HYPERPARAMETER_KEYS).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from freescale.runtime import locks
from freescale.runtime.errors import InputError
from freescale.shards.manifest import ShardError
from freescale.training.config import ConfigError, moved_flat, shape_keys
from freescale.training.parallel.distributed import all_ranks_ok
from freescale.training.checkpoint.safe_load import SafePlanner, SafeReader, check_plain, read_own_state

from freescale.training.checkpoint.layout import (COMPLETE, CONFIG, LOCK, SHARDS, STEP_DIR, complete_steps, other_shards, own_file,
                                       saved_world_size)

# Config keys the saved tensors' shapes depend on (a checkpoint cannot be loaded into a model or
# optimizer built with other values, so a resume with any of them changed is refused) are the
# fields marked ``shape`` in freescale/training/config/: freescale.training.config.shape_keys().
# Keys (prefixes) that change what the saved numbers mean without changing their shapes:
# a resume with any of them changed continues, with a warning naming them. Everything
# else (steps, logging, comm mode, tracking, paths) may change freely.
HYPERPARAMETER_KEYS = ("model.", "loss.", "optimizer.", "training.seed", "training.precision")
# Keys that decide which rank holds which table. The fused sparse optimizer's state is
# saved per rank, for the tables that rank held, so it cannot be restored into another
# placement (TorchRec's KeyedOptimizer: "Parameter ... not found"): refused as well.
PLACEMENT_KEYS = ("parallel.sharding",)
PRUNED_PREFIX = ".pruned-step_"
"""A checkpoint being deleted (renamed first: no longer a step_<n> folder)."""


class Checkpointer:
    def __init__(self, folder: str, rank: int, group: dist.ProcessGroup | None = None, keep_last: int = 0):
        self.folder = Path(folder) if folder else None
        self.rank = rank
        # Every collective here carries host data (flags, objects, DCP's plans): a group serving
        # CPU tensors, ``DistEnv.host_group`` (None: the default group).
        self.group = group
        self.keep_last = keep_last
        """After a save is complete, rank 0 deletes the complete checkpoints older than the newest
        ``keep_last`` (:meth:`prune`); 0 keeps all."""

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def step_dir(self, step: int) -> Path:
        assert self.folder is not None
        return self.folder / f"step_{step}"

    def latest_step(self) -> int | None:
        """Newest complete checkpoint (the same answer on every rank: a shared folder)."""
        return max(complete_steps(self.folder), default=None)

    def world_size_of(self, step: int) -> int:
        """How many ranks wrote checkpoint ``step``."""
        return saved_world_size(self.step_dir(step))

    def half_written(self) -> list[Path]:
        """``step_<n>`` folders without ``COMPLETE`` (a save cut short), oldest first."""
        if self.folder is None or not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir()
                 if (m := STEP_DIR.match(p.name)) and not (p / COMPLETE).exists()]
        return [p for _, p in sorted(found)]

    def save(self, step: int, shared: dict[str, Stateful], own: dict[str, Stateful], shards_sha256: str,
             config: dict[str, Any]) -> None:
        """`shared`: state saved through DCP (sharded or replicated tensors); `own`: this rank's;
        `config`: the run's flat config (``to_flat_dict``), checked on resume."""
        target = self.step_dir(step)
        dcp.save(shared, checkpoint_id=str(target), process_group=self.group)
        own_state = {name: state.state_dict() for name, state in own.items()}
        check_plain(own_state, f"rank {self.rank}'s own state")  # what a resume reads back safely
        torch.save(own_state, own_file(target, self.rank))
        dist.barrier(group=self.group)
        if self.rank == 0:
            (target / SHARDS).write_text(f"{shards_sha256}\n")
            (target / CONFIG).write_text(json.dumps(config, indent=1, default=str) + "\n")
            (target / COMPLETE).write_text(f"{step}\n")
            self.prune(step)
        dist.barrier(group=self.group)

    def prune(self, saved: int) -> list[int]:
        """Rank 0, once the save of step ``saved`` is complete: delete the complete checkpoints up to it
        but the newest ``keep_last``, and the half-written folders older than the newest of those (saves
        cut short, which no resume can use); the steps deleted. So a checkpoint goes only once a newer one is complete;
        the one a resume loads (the newest complete) and anything newer than ``saved`` (another run's,
        or a half-written folder the resume names) are never touched. A folder is first renamed out of
        the ``step_<n>`` names, so one cut short mid-delete is no checkpoint; its rest goes next time."""
        if self.folder is None or not self.keep_last or not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), (p / COMPLETE).exists()) for p in self.folder.iterdir()
                 if (m := STEP_DIR.match(p.name))]
        complete = sorted(step for step, done in found if done and step <= saved)
        if not complete:
            return []
        doomed = complete[:-self.keep_last] + [step for step, done in found if not done and step < complete[-1]]
        for step in sorted(doomed):
            self.step_dir(step).rename(self.folder / f"{PRUNED_PREFIX}{step}")
        for leftover in self.folder.glob(f"{PRUNED_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        return sorted(doomed)

    def check_shards(self, step: int, shards_sha256: str) -> None:
        """Refuse to resume in shards other than the ones the checkpoint trained on."""
        recorded = self.step_dir(step) / SHARDS
        if recorded.exists() and (found := recorded.read_text().strip()) != shards_sha256:
            raise ShardError(other_shards(self.step_dir(step), found, shards_sha256))

    def check_config(self, step: int, config: dict[str, Any]) -> list[str]:
        """Refuse a resume into another model shape or table placement; return the changed hyperparameters as
        ``key old -> new`` (a checkpoint from before CONFIG was recorded is not checked)."""
        recorded = self.step_dir(step) / CONFIG
        if not recorded.exists():
            return []
        saved = moved_flat(json.loads(recorded.read_text()))  # an older checkpoint may record moved keys
        changed = {key: f"{key} {saved[key]} -> {config.get(key)}" for key in saved
                   if key.startswith(HYPERPARAMETER_KEYS) and saved[key] != config.get(key)}
        shapes = [changed.pop(key) for key in shape_keys() if key in changed]
        if shapes:
            raise ConfigError(f"checkpoint {self.step_dir(step)} holds another model shape ({', '.join(shapes)}): "
                              "use another checkpoint.folder, or the checkpoint's values")
        if _holds_best_weights(saved) != _holds_best_weights(config):
            raise ConfigError(f"checkpoint {self.step_dir(step)} was saved {'with' if _holds_best_weights(saved) else 'without'} "
                              "the best weights of validation during training (evaluation.every_epochs "
                              f"{saved.get('evaluation.every_epochs', 0)} -> {config.get('evaluation.every_epochs')}, "
                              f"evaluation.restore_best {saved.get('evaluation.restore_best', True)} -> "
                              f"{config.get('evaluation.restore_best')}): use another checkpoint.folder, or the "
                              "checkpoint's values")
        moved = [f"{key} {saved[key]} -> {config.get(key)}" for key in PLACEMENT_KEYS
                 if key in saved and saved[key] != config.get(key)]
        if moved:
            raise ConfigError(f"checkpoint {self.step_dir(step)} holds another table placement ({', '.join(moved)}; "
                              "its sparse optimizer state is per rank): use another checkpoint.folder, or the "
                              "checkpoint's values")
        return list(changed.values())

    # ------------------------------------------------------------------ lock

    def lock(self) -> None:
        """Rank 0 takes the folder's lock; every rank stops with the same line when another job holds it.

        Rank 0 decides and tells the others, so no rank goes on into a collective alone.
        """
        refusal = self._take_lock() if self.rank == 0 and self.folder is not None else None
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            shared = [refusal]
            dist.broadcast_object_list(shared, src=0, group=self.group)
            refusal = shared[0]
        if refusal:
            raise FileExistsError(refusal)

    def unlock(self) -> None:
        """Release the lock if this process holds it (rank 0; safe to call more than once)."""
        if self.rank != 0 or self.folder is None:
            return
        locks.release(self.folder / LOCK)

    def _take_lock(self) -> str | None:
        """Create the lock; None when taken, else the one-line refusal naming the holder."""
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK
        refused = locks.acquire(path, on_stale=lambda holder: print(
            f"freescale train: note: checkpoint folder {self.folder}: taking over the stale lock of "
            f"{holder} (that process is gone)", file=sys.stderr, flush=True))
        if refused is None:
            return None
        if refused.reason == "alive":
            return (f"checkpoint folder {self.folder} is in use by PID {refused.holder['pid']} on "
                    f"{refused.holder['host']} (lock {path}): wait for that job, or use another checkpoint.folder")
        if refused.reason == "other_host":
            return (f"checkpoint folder {self.folder} is locked by PID {refused.holder['pid']} on "
                    f"{refused.holder['host']} (lock {path}); if that job is gone, remove the lock")
        return f"checkpoint folder {self.folder}: another job took the lock {path} at the same time"

    def load(self, step: int, shared: dict[str, Stateful], own: dict[str, Stateful], own_rank: int | None = None
             ) -> None:
        """Load every state saved by :meth:`save` into the same objects, running no code from the files
        (``freescale.training.checkpoint.safe_load``): a file that holds more than data is refused in one line.
        ``own_rank``: whose own file to read (a resume on another world size reads rank 0's)."""
        source = self.step_dir(step)
        saved, reader = self._read_first(source, self.rank if own_rank is None else own_rank)
        # flatten_sharded_tensors (for FSDP 2D nesting) drops a ShardedTensor that has
        # no shard on this rank -- a table-wise table placed on another rank -- which
        # DCP then takes for a checkpoint from torch <= 2.3 and fails on every key.
        planner = SafePlanner(source, flatten_sharded_tensors=False)
        try:
            dcp.load(shared, storage_reader=reader, planner=planner, process_group=self.group)
        except CheckpointException as failed:
            refusal = _refusal_in(failed)
            if refusal is None:
                raise
            raise refusal from None
        for name, state in own.items():
            state.load_state_dict(saved[name])

    def _read_first(self, source: Path, own_rank: int) -> tuple[dict[str, Any], SafeReader]:
        """An own file and DCP's metadata, read on every rank before the shared state's
        collective load; all stop if any rank's are missing or refused."""
        own_path = own_file(source, own_rank)
        error: Exception | None = None
        saved, reader = {}, None
        try:
            if not own_path.exists():
                raise FileNotFoundError(f"checkpoint {source} has no state for rank {own_rank} "
                                        "(saved with a different world size?)")
            saved = read_own_state(own_path)
            reader = SafeReader(source)
        except (FileNotFoundError, InputError) as exc:
            error = exc
        if not all_ranks_ok(error is None, self.group):
            raise error or InputError(f"checkpoint {source}: another rank's file was refused (its error "
                                      "names the file)")
        return saved, reader


def _refusal_in(failed: CheckpointException) -> InputError | None:
    """DCP raises its load's failures on every rank as one ``CheckpointException`` (a BaseException,
    which a job's one-line report would miss): the refusal of a file among them, if any."""
    return next((exc for exc, _ in failed.failures.values() if isinstance(exc, InputError)), None)


def _holds_best_weights(config: dict[str, Any]) -> bool:
    """Whether a run with this flat config checkpoints best weights (``freescale.training.eval.validation``)."""
    return bool(config.get("evaluation.every_epochs", 0)) and bool(config.get("evaluation.restore_best", True))


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily built state (Adam's moments) so DCP has tensors to load into.

    One step with zero gradients and learning rate 0 allocates the state without
    moving any parameter (Adam's update is scaled by the learning rate, weight
    decay included); the checkpoint then overwrites it.
    """
    if optimizer.state:
        return
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, saved_lrs):
        group["lr"] = lr
