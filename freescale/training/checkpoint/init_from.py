"""A warm start (``training.init_from``): a new run, from step 0, whose weights come from another run's
checkpoint or exported model (``freescale.training.checkpoint.init_source`` finds and checks it), and
whose optimizers' state comes from the checkpoint's where the shapes allow.

Not a resume: the run's progress (step, random streams, loader position, MLflow run, validation
record), its learning-rate schedule and its hyperparameters are its own. Each rank reads the source's
tensors whole -- DCP assembles a checkpoint's shards of any world size in this process (``no_dist``)
through the safe reader and planner (``freescale.training.checkpoint.safe_load``); an exported
model's ``weights.pt`` goes through the weights-only unpickler -- and copies into its own shards of the
model and optimizers the rows they hold. So any world size and table placement loads any source, for
the cost of one whole item table in each rank's memory while it loads.

The tables may grow: rows ``0..N_old`` (the source's items, under the same ids) come from the source,
the rows of new items keep the values a cold start gives them, and their optimizer state starts at
zero. Every other tensor must have the source's shape, and the model the source's keys; a table that
would shrink is refused (``check_init_items``). Carried over: the dense optimizer's state (Adam's
moments and step count) and the item table's fused optimizer state of the old rows. An exported model
holds no optimizer state: both start fresh. The user feature tables' fused optimizer state (each
rank's own file, laid out for the source's ranks) always starts fresh.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from freescale.runtime.errors import InputError, one_line
from freescale.training.checkpoint.checkpointer import materialize_optimizer_state
from freescale.training.checkpoint.init_source import (CHECKPOINT, InitSource, check_init_items, check_init_shape,
                                                       find_init_source)
from freescale.training.config import TrainConfig
from freescale.training.eval.validation import is_sharded
from freescale.training.export.exporter import ITEM_KEY, USER_KEY
from freescale.training.export.layout import ITEM_TABLE, USER_TABLE, WEIGHTS_FILE
from freescale.training.model.recommender import USER_TABLE as CHECKPOINT_USER_TABLE
from freescale.training.parallel.distributed import all_ranks_ok

LOADED = ("model", "sparse_optimizer", "dense_optimizer")
"""The checkpoint's shared states a warm start loads (``freescale.training.checkpoint.resume.checkpoint_states``):
not the best validation's weights, which are the new run's own."""
GROWING = ("model.embedding_collection.", "model.user_embedding_collection.", "sparse_optimizer.")
"""Keys of the tables and of the item table's fused optimizer state: their first dimension is the table's rows."""
ITEM_WEIGHTS = f"model.{ITEM_KEY}"


@dataclass
class Loaded:
    """What a warm start copied, for its line."""

    model: int = 0
    item_rows: tuple[int, int] = (0, 0)
    """The source's item table rows and this run's (ids 0..num_items, 0 the padding)."""
    optimizers: dict[str, bool | None] = field(default_factory=dict)
    """``dense_optimizer``, ``sparse_optimizer`` (the item table's): whether the source held all of that
    optimizer's state, which was then loaded; None where this run's optimizer keeps none (SGD)."""


def warm_start(path: str, shared: dict[str, Any], dense_optimizer: torch.optim.Optimizer, config: TrainConfig,
               num_items: int, rank: int, group: Any = None) -> None:
    """Load ``path``'s weights and optimizer state into ``shared`` (``checkpoint_states``'s shared states) on
    every rank; rank 0 says what it loaded. Any rank's refusal stops all with its line."""
    error: Exception | None = None
    loaded, source = Loaded(), None
    live = {name: shared[name].state_dict() for name in LOADED}
    try:
        source = find_init_source(path)
        check_init_shape(source, config)
        if source.kind == CHECKPOINT:  # Adam's moments exist to be copied into
            materialize_optimizer_state(dense_optimizer)
            live["dense_optimizer"] = dense_optimizer.state_dict()
        loaded = copy_source(source, _leaves(live), num_items)
    except InputError as exc:
        error = exc
    if not all_ranks_ok(error is None, group):
        raise error or InputError(f"init-from {path}: another rank refused it (its error says why)")
    with torch.no_grad():
        for name in LOADED:  # as DCP does after loading in place: each object's own checks and hooks
            shared[name].load_state_dict(live[name])
    if rank == 0:
        user_tables = any(key.startswith("user_embedding_collection.") for key in live["model"])
        print(describe(source, loaded, user_tables), file=sys.stderr, flush=True)


def _leaves(live: dict[str, Any]) -> dict[str, Any]:
    """The tensors (and sharded tensors) of ``live`` under the keys DCP saves them with."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(live)
    return {key: value for key, value in flat.items() if is_sharded(value) or isinstance(value, torch.Tensor)}


def copy_source(source: InitSource, targets: dict[str, Any], num_items: int) -> Loaded:
    """Copy ``source``'s tensors into ``targets`` (DCP's keys -> this rank's tensors or sharded tensors, the
    model's and optimizers'); the model's must all be there with the same keys, the optimizers' where present."""
    saved = read_checkpoint(source, targets) if source.kind == CHECKPOINT else read_exported(source)
    model = {key for key in targets if key.startswith("model.")}
    missing = sorted(model - set(saved))
    extra = sorted(key for key in saved if key.startswith("model.") and key not in model)
    if missing or extra:
        what = (f"holds no {missing[0][len('model.'):]}" if missing
                else f"holds {extra[0][len('model.'):]}, which this run's model has not")
        raise InputError(f"init-from {source.path} {what} (another model: user features or inputs differ)")
    if ITEM_WEIGHTS in saved:
        check_init_items(source, int(saved[ITEM_WEIGHTS].shape[0]) - 1, num_items)
    loaded = Loaded(model=len(model), item_rows=(int(saved[ITEM_WEIGHTS].shape[0]), num_items + 1))
    for name in LOADED[1:]:
        keys = [key for key in targets if key.startswith(f"{name}.")]
        loaded.optimizers[name] = all(key in saved for key in keys) if keys else None
    for key, target in targets.items():
        state = key.split(".", 1)[0]
        if state == "model" or loaded.optimizers[state]:
            copy_rows(key, target, saved[key], source)
    return loaded


def copy_rows(key: str, target: Any, saved: torch.Tensor, source: InitSource) -> None:
    """Copy ``saved`` (the source's whole tensor) into this rank's part of ``target``: the same shape, or for
    a table (``GROWING``) as many rows or fewer, the rest left as they are."""
    size = tuple(target.size())
    grows = key.startswith(GROWING) and saved.dim() == len(size) > 0 and saved.shape[1:] == size[1:]
    if tuple(saved.shape) != size and not (grows and saved.shape[0] <= size[0]):
        raise InputError(f"init-from {source.path}: {key} is {tuple(saved.shape)} there, {size} here (another "
                         "model or optimizer shape)")
    parts = ([(shard.tensor, shard.metadata.shard_offsets) for shard in target.local_shards()] if is_sharded(target)
             else [(target, [0] * target.dim())])
    for tensor, offsets in parts:
        if tensor.dim() == 0:
            tensor.detach().copy_(saved)
            continue
        first, end = offsets[0], min(offsets[0] + tensor.shape[0], saved.shape[0])
        if end <= first:  # rows of new items only: kept as they are
            continue
        region = (slice(first, end), *(slice(o, o + n) for o, n in zip(offsets[1:], tensor.shape[1:])))
        tensor.detach()[:end - first].copy_(saved[region])


def read_checkpoint(source: InitSource, targets: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under ``targets``' keys that it holds, and its other model tensors, whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from freescale.training.checkpoint.safe_load import SafePlanner, SafeReader

    reader = SafeReader(source.path)
    held = {key: meta for key, meta in reader.metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata) and (key in targets or key.startswith("model."))}
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in held.items()}
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process's read is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, planner=SafePlanner(source.path), no_dist=True)
    except CheckpointException as failed:  # a BaseException: the job's one line would miss it
        first = next(iter(failed.failures.values()))[0]
        raise (first if isinstance(first, InputError) else InputError(
            f"init-from {source.path} cannot be read ({one_line(first).split('. ')[0][:160]}): it is damaged; "
            "name another step")) from None
    return state


def read_exported(source: InitSource) -> dict[str, torch.Tensor]:
    """The exported model's weights under the checkpoint's keys (``model.`` and the trainer's table names)."""
    import pickle

    path = source.path / WEIGHTS_FILE
    try:
        weights = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise InputError(f"init-from {path} cannot be read ({one_line(exc).split('. ')[0][:160]})") from None
    return {f"model.{_checkpoint_key(key)}": value for key, value in weights.items()}


def _checkpoint_key(key: str) -> str:
    """An exported weight's key as the trainer's model names it (``freescale.training.export.exporter.exported_state``
    renamed the tables)."""
    user_table = USER_TABLE.format(index="")
    if key == ITEM_TABLE:
        return ITEM_KEY
    if key.startswith(user_table) and key[len(user_table):].isdigit():
        return USER_KEY.format(table=CHECKPOINT_USER_TABLE.format(index=int(key[len(user_table):])))
    return key


def describe(source: InitSource, loaded: Loaded, user_tables: bool) -> str:
    """Rank 0's line: what the warm start loaded."""
    old, new = loaded.item_rows
    grown = f"{old - 1} -> {new - 1} items ({new - old} new)" if new > old else f"{new - 1} items"
    if source.kind != CHECKPOINT:
        state = "none (an exported model holds none: both optimizers start fresh)"
    else:
        dense, sparse = loaded.optimizers.get("dense_optimizer"), loaded.optimizers.get("sparse_optimizer")
        rows = (f"item table rows 0..{old - 1}" + (f" (rows {old}..{new - 1} start fresh)" if new > old else "")
                if sparse else "none (this run's sparse optimizer keeps none)" if sparse is None
                else "no (another sparse optimizer's: starts fresh)")
        state = f"dense {'yes' if dense else 'no (not in the checkpoint: starts fresh)'}, embeddings {rows}"
    note = "; the user feature tables' optimizer state starts fresh" if user_tables else ""
    return (f"freescale train: init-from {source.path} ({source.kind}): model {loaded.model} tensors, item table "
            f"{grown}; optimizer state: {state}{note}")
