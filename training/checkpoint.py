"""Sharded checkpoints with torch.distributed.checkpoint, plus each rank's own position.

The trainer hands the checkpointer two dicts of ``Stateful`` objects (anything with
``state_dict()`` / ``load_state_dict()``): the *shared* ones go through DCP, which
saves sharded tensors once across ranks and loads them in place; each rank's *own*
ones go into its own file. A checkpoint is `<folder>/step_<n>/`: the DCP files, one
`rank_<r>.pt` per rank with what only that rank knows, `SHARDS` (the SHA-256 of the shard
manifest it trained on: a loader position means nothing in other shards), and
`COMPLETE`, written last by rank 0 after every rank finished. A folder without
`COMPLETE` (a crash mid-save) is ignored.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from shards.manifest import ShardError

COMPLETE = "COMPLETE"
SHARDS = "SHARDS"
STEP_DIR = re.compile(r"^step_(\d+)$")


class Checkpointer:
    def __init__(self, folder: str, rank: int):
        self.folder = Path(folder) if folder else None
        self.rank = rank

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def step_dir(self, step: int) -> Path:
        assert self.folder is not None
        return self.folder / f"step_{step}"

    def latest_step(self) -> int | None:
        """Newest complete checkpoint (the same answer on every rank: a shared folder)."""
        if self.folder is None or not self.folder.is_dir():
            return None
        steps = [int(m.group(1)) for p in self.folder.iterdir()
                 if (m := STEP_DIR.match(p.name)) and (p / COMPLETE).exists()]
        return max(steps, default=None)

    def save(self, step: int, shared: dict[str, Stateful], own: dict[str, Stateful], shards_sha256: str) -> None:
        """`shared`: state saved through DCP (sharded or replicated tensors); `own`: this rank's."""
        target = self.step_dir(step)
        dcp.save(shared, checkpoint_id=str(target))
        torch.save({name: state.state_dict() for name, state in own.items()}, target / f"rank_{self.rank}.pt")
        dist.barrier()
        if self.rank == 0:
            (target / SHARDS).write_text(f"{shards_sha256}\n")
            (target / COMPLETE).write_text(f"{step}\n")
        dist.barrier()

    def check_shards(self, step: int, shards_sha256: str) -> None:
        """Refuse to resume in shards other than the ones the checkpoint trained on."""
        recorded = self.step_dir(step) / SHARDS
        if recorded.exists() and (found := recorded.read_text().strip()) != shards_sha256:
            raise ShardError(f"checkpoint {self.step_dir(step)} was written for other shards (manifest sha256 "
                             f"{found[:12]}..., these are {shards_sha256[:12]}...): use another "
                             "checkpoint.folder, or remove this one to start over")

    def load(self, step: int, shared: dict[str, Stateful], own: dict[str, Stateful]) -> None:
        """Load every state saved by :meth:`save` into the same objects."""
        source = self.step_dir(step)
        # flatten_sharded_tensors (for FSDP 2D nesting) drops a ShardedTensor that has
        # no shard on this rank -- a table-wise table placed on another rank -- which
        # DCP then takes for a checkpoint from torch <= 2.3 and fails on every key.
        dcp.load(shared, checkpoint_id=str(source), planner=DefaultLoadPlanner(flatten_sharded_tensors=False))
        own_path = source / f"rank_{self.rank}.pt"
        if not own_path.exists():
            raise FileNotFoundError(f"checkpoint {source} has no state for rank {self.rank} "
                                    "(saved with a different world size?)")
        saved = torch.load(own_path, weights_only=False)
        for name, state in own.items():
            state.load_state_dict(saved[name])


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
