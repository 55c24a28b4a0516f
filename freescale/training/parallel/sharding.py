"""Sharding the embedding tables with TorchRec and keeping the dense part replicated."""
from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from freescale.runtime import logs
from freescale.training.config import OptimizerConfig, ParallelConfig, ShardingName, SparseOptimizerName, keyed_by
from freescale.training.parallel.distributed import DistEnv
from freescale.training.model.recommender import ITEM_TABLE, USER_TABLE, SequentialRecommender

# The implementation of each config choice; the config rejects any other name when it loads.
SPARSE_OPTIMIZERS: dict[SparseOptimizerName, type[torch.optim.Optimizer]] = keyed_by(SparseOptimizerName, {
    "adagrad": RowWiseAdagrad, "sgd": torch.optim.SGD, "adam": torch.optim.Adam})
SHARDING_TYPES: dict[ShardingName, ShardingType] = keyed_by(ShardingName, {
    "row_wise": ShardingType.ROW_WISE, "table_wise": ShardingType.TABLE_WISE})


# What every planned run prints and no one acts on: the planner's advice to build the topology
# with TopologyFactory and pass a dense tensor estimate (WARNING logs), its FutureWarning about
# HeuristicalStorageReservation, and torch.fx's note on is_fx_tracing (once per rank, from
# TorchRec's modules). Python's warnings filter and these loggers' levels are process-wide: a
# rank is one process.
_NOISY_LOGGERS = ("torchrec.distributed.planner", "torch.fx._symbolic_trace")
_NOISY_WARNING_MODULES = r"torchrec\.distributed\.planner\."


def apply_quiet_third_party_logs() -> None:
    """Silence the warnings above, unless --verbose (FREESCALE_VERBOSE), which shows them all."""
    if logs.verbose():
        return
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=_NOISY_WARNING_MODULES)


def build_planner(parallel: ParallelConfig, env: DistEnv, model: SequentialRecommender) -> EmbeddingShardingPlanner:
    """The planner with the item table's sharding type from the config and every user feature
    table whole on one rank."""
    constraints = {ITEM_TABLE: ParameterConstraints(sharding_types=[SHARDING_TYPES[parallel.sharding].value])}
    # User feature tables are small (a category per row), so each lives whole on one
    # rank; TorchRec's bag sharder also offers no row-wise kernel on CPU.
    for i in range(len(model.user_feature_names)):
        constraints[USER_TABLE.format(index=i)] = ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value])
    return EmbeddingShardingPlanner(
        topology=Topology(world_size=env.world_size, compute_device=env.device.type), constraints=constraints)


def apply_fused_sparse_optimizer(model: SequentialRecommender, config: OptimizerConfig) -> None:
    """The tables' optimizer runs inside their backward (fbgemm), so no sparse gradient is materialised."""
    tables = list(model.embedding_collection.parameters())
    if model.user_embedding_collection is not None:
        tables += list(model.user_embedding_collection.parameters())
    apply_optimizer_in_backward(SPARSE_OPTIMIZERS[config.sparse_optimizer], tables, {"lr": config.sparse_lr})


def shard_model(model: SequentialRecommender, optimizer: OptimizerConfig, parallel: ParallelConfig,
                env: DistEnv) -> DistributedModelParallel:
    """Plan and shard the item table (row- or table-wise) and user feature tables (table-wise);
    leave data parallelism of the dense part to the training step.

    DDP is not used (init_data_parallel=False): the training step all-reduces dense
    gradients itself after backward, so the time ranks spend waiting for each other
    is measured in one place rather than hidden inside DDP's backward hooks.
    """
    apply_quiet_third_party_logs()
    optimizer.check_device(env.device.type)
    apply_fused_sparse_optimizer(model, optimizer)
    sharders = [EmbeddingCollectionSharder(), EmbeddingBagCollectionSharder()]
    planner = build_planner(parallel, env, model)
    # The plan is a Python object (host memory); the sharded tables exchange device tensors.
    plan = planner.collective_plan(model, sharders, env.host_group or dist.GroupMember.WORLD)
    sharding_env = ShardingEnv.from_process_group(env.device_group or dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=env.device, plan=plan, sharders=sharders, env=sharding_env,
                                    init_data_parallel=False)


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters not updated by a fused in-backward optimizer: the replicated dense part.

    ``_in_backward_optimizers`` is TorchRec's private mark (tests/training/test_torchrec_private.py pins it)."""
    return [p for _, p in model.named_parameters()
            if p.requires_grad and getattr(p, "_in_backward_optimizers", None) is None]


def broadcast_dense(params: list[nn.Parameter], src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Start every rank from rank 0's dense weights (``group``: one serving their device, ``DistEnv.device_group``)."""
    if dist.get_world_size(group) > 1:
        for p in params:
            dist.broadcast(p.data, src, group=group)


class DenseGradSync:
    """Averages dense gradients over ranks with one flat all-reduce per step, through ``group``
    (one serving the gradients' device, ``DistEnv.device_group``)."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None = None):
        self.params = params
        self.group = group

    def __call__(self) -> None:
        world = dist.get_world_size(self.group)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if world > 1:
            dist.all_reduce(flat, group=self.group)
            flat /= world
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p)
            offset += n
