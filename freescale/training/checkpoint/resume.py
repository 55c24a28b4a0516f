"""What a rank's checkpoint holds, and the resume from the newest one."""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from freescale.runtime.errors import InputError
from freescale.training.checkpoint.checkpointer import Checkpointer, materialize_optimizer_state
from freescale.training.config import TrainConfig, to_flat_dict
from freescale.training.data.shard_reader import at_step, with_epoch
from freescale.training.model.recommender import SequentialRecommender
from freescale.training.eval.validation import is_sharded


def checkpoint_states(sharded_model: nn.Module, dense_optimizer: torch.optim.Optimizer, progress: Any,
                      loader: Any, best_weights: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(shared, own)`` ``Stateful`` objects for the checkpointer.

    Shared (through DCP): the model, the item table's fused optimizer and the dense
    optimizer. Own (this rank's file, plain data): the run's progress (step, RNG states, the sink's
    record), the loader position and the user feature tables' fused optimizer (its local shards,
    ``LocalShards``). The user
    tables are sharded table-wise and their bag collection's optimizer lists only the
    tables a rank holds (unlike the item table's, whose state is a ShardedTensor on every
    rank), so DCP would find keys only some ranks have; the same world size and plan put
    the same tables on the same rank on resume. Each sharded collection owns its fused
    optimizer, so no key needs parsing. ``best_weights`` (``freescale.training.eval.validation.BestWeights``,
    kept while validation runs during training) is shared too, laid out like the model.
    """
    model: SequentialRecommender = sharded_model.module
    item_optimizer, *user_optimizer = model.fused_optimizers()
    shared = {"model": sharded_model, "sparse_optimizer": item_optimizer, "dense_optimizer": dense_optimizer}
    if best_weights is not None:
        shared["best_weights"] = best_weights
    own: dict[str, Any] = {"trainer": progress, "loader": loader}  # loaded in this order: see LoaderPosition
    if user_optimizer:
        own["user_table_optimizer"] = LocalShards(user_optimizer[0])
    return shared, own


class LoaderPosition:
    """The loader as a checkpoint's ``Stateful``: a state saved before the reader recorded epochs gets
    its epoch from the run's step (``freescale.training.data.shard_reader.with_epoch``). ``progress`` (the
    trainer) must be loaded first: ``checkpoint_states`` lists it before the loader."""

    def __init__(self, loader: Any, progress: Any, steps_per_epoch: int):
        self.loader, self.progress, self.steps_per_epoch = loader, progress, steps_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(with_epoch(state, self.progress.step, self.steps_per_epoch))

    def start_at_progress(self) -> None:
        """Without a state of its own (a checkpoint of another world size): the plan's reader starts where
        the run's step is in its epoch order; a re-plan's reader starts at its first step, as it is."""
        self.loader.load_state_dict(at_step(self.loader.state_dict(), self.progress.step, self.steps_per_epoch))


class LocalShards:
    """A fused optimizer as a ``Stateful`` of plain data: each ShardedTensor of its state as the list of
    this rank's local shards.

    A rank's own file holds plain data only (``freescale.training.checkpoint.safe_load``): a ShardedTensor pickles as
    torch.distributed classes rebuilt through ``getattr``, which no safe unpickler builds. The
    local shards are all this rank needs: the same world size and table placement (checked,
    ``freescale.training.checkpoint.checkpointer``) give it the same shards on resume, which are copied in place.
    """

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return _local_shards(self.optimizer.state_dict())

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        live = self.optimizer.state_dict()  # the optimizer's own tensors, not copies
        _copy_local_shards(live, saved, "user_table_optimizer")
        self.optimizer.load_state_dict(live)  # TorchRec's checks and hooks; the values are in place already


def _local_shards(state: Any) -> Any:
    if isinstance(state, dict):
        return {key: _local_shards(value) for key, value in state.items()}
    if is_sharded(state):
        return [shard.tensor for shard in state.local_shards()]
    return state


def _copy_local_shards(live: dict[str, Any], saved: dict[str, Any], where: str) -> None:
    """Copy ``saved`` (``_local_shards`` of the same optimizer) into ``live``'s tensors."""
    for key, value in live.items():
        if key not in saved:
            raise InputError(f"checkpoint's {where} has no {key} (saved with another table placement?)")
        if isinstance(value, dict):
            _copy_local_shards(value, saved[key], f"{where}.{key}")
        elif is_sharded(value):
            targets = [shard.tensor for shard in value.local_shards()]
            if [t.shape for t in targets] != [t.shape for t in saved[key]]:
                raise InputError(f"checkpoint's {where}.{key} holds local shards of shapes "
                                 f"{[tuple(t.shape) for t in saved[key]]}, this rank's are "
                                 f"{[tuple(t.shape) for t in targets]} (saved with another table placement?)")
            for target, shard in zip(targets, saved[key]):
                target.detach().copy_(shard)
        elif isinstance(value, torch.Tensor):
            value.detach().copy_(saved[key])
        else:
            live[key] = saved[key]


def resume_latest(checkpointer: Checkpointer, config: TrainConfig, shards_sha256: str, rank: int,
                  dense_optimizer: torch.optim.Optimizer, states: tuple[dict[str, Any], dict[str, Any]],
                  max_steps: int, world_size: int | None = None) -> int | None:
    """Load the newest complete checkpoint into ``states``; its step, or None when there is none.

    Refused for other shards or another model shape; changed hyperparameters are named
    in a warning (``freescale.training.checkpoint.checkpointer``). A checkpoint of another world size is
    resharded (``_load_resized``); ``world_size`` None takes the checkpoint's own."""
    step = checkpointer.latest_step()
    skipped = [path for path in checkpointer.half_written() if step is None or int(path.name[5:]) > step]
    if skipped and rank == 0:
        print(f"freescale train: note: skipping {', '.join(map(str, skipped))}: no COMPLETE (a save cut short); "
              + (f"resuming from {checkpointer.step_dir(step)}" if step is not None else "starting from step 0"),
              file=sys.stderr, flush=True)
    if step is None:
        return None
    checkpointer.check_shards(step, shards_sha256)
    changed = checkpointer.check_config(step, to_flat_dict(config))
    if changed and rank == 0:
        print(f"freescale train: warning: resuming {checkpointer.step_dir(step)} with changed "
              f"settings: {', '.join(changed)}", file=sys.stderr, flush=True)
    materialize_optimizer_state(dense_optimizer)
    saved_world_size = checkpointer.world_size_of(step)
    if world_size is None or saved_world_size == world_size:
        checkpointer.load(step, *states)
    else:
        _load_resized(checkpointer, step, states, saved_world_size, world_size, rank)
    if step >= max_steps and rank == 0:
        print(f"freescale train: checkpoint {checkpointer.step_dir(step)} already reached max_steps "
              f"{max_steps}: nothing left to train, evaluating only", file=sys.stderr, flush=True)
    return step


class ResizedProgress:
    """A K-rank checkpoint's progress, loaded by each rank of a K'-rank run: the step, the
    validation record and the MLflow record go on (rank 0's); each rank's random streams stay
    seeded for its new rank, and its loader starts the re-plan (``freescale.shards.replan``) at its first step."""

    def __init__(self, progress: Any):
        self.progress = progress

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.progress.load_progress(state)


def _load_resized(checkpointer: Checkpointer, step: int, states: tuple[dict[str, Any], dict[str, Any]],
                  saved_world_size: int, world_size: int, rank: int) -> None:
    """Reshard checkpoint ``step`` of ``saved_world_size`` ranks into this run's ``world_size``:
    DCP lays the model's and optimizers' saved shards out for the new placement; of the ranks'
    own state only rank 0's progress carries over. The user feature tables' optimizer state is
    saved per rank for the old placement and starts over."""
    shared, own = states
    checkpointer.load(step, shared, {"trainer": ResizedProgress(own["trainer"])}, own_rank=0)
    own["loader"].start_at_progress()
    if rank == 0:
        note = "; the user feature tables' optimizer state starts over" if "user_table_optimizer" in own else ""
        print(f"freescale train: resharded {checkpointer.step_dir(step)} from {saved_world_size} to "
              f"{world_size} ranks (model, item table and optimizers){note}", file=sys.stderr, flush=True)
