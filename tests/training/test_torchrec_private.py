"""Every private (or internal) attribute of TorchRec -- and of torchdata -- that the code reads,
pinned in one place: an upgrade that renames or drops one fails here, naming the reader.

TorchRec's:
* ``ShardedEmbeddingCollection._lookups`` / ``ShardedEmbeddingBagCollection._lookups``, and
  each lookup's ``grouped_configs[*].embedding_tables[*].feature_names``: the local kernels the
  exchange calls (freescale/comm/routes.py ``local_lookup``).
* ``module_sharding_plan[table].sharding_spec.shards[*]`` with ``shard_offsets`` and
  ``placement.rank()``: where a row lives (freescale/comm/routes.py ``table_route``).
* ``Parameter._in_backward_optimizers``: set on the tables' parameters by
  ``apply_optimizer_in_backward``; what tells dense from sparse (freescale/training/parallel/sharding.py
  ``dense_parameters``).
* ``torchrec.distributed.comm_ops.get_gradient_division``: the gradient scaling the
  exchange copies (freescale/training/parallel/comm_layer.py).
* ``fused_optimizer`` of a sharded collection: checkpointed (freescale/training/checkpoint/resume.py).

torchdata's: ``Prefetcher._it._shutdown()`` (freescale/training/data/shard_reader.py ``stop_prefetch``).
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def sharded(tmp_path):
    """The trainer's sharding of a small model with user features, on a process group of one."""
    from freescale.training.config import ModelConfig, OptimizerConfig, ParallelConfig
    from freescale.training.parallel.distributed import DistEnv
    from freescale.training.model.recommender import build_model
    from freescale.training.parallel.sharding import shard_model

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    threads = torch.get_num_threads()
    try:
        torch.manual_seed(0)
        config = ModelConfig()
        config.hstu.num_layers = 1
        model = build_model(50, config, "cpu", user_features=[("age", 8), ("gender", 3)])
        env = DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo")
        yield shard_model(model, OptimizerConfig(), ParallelConfig(sharding="row_wise"), env)
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()


def test_sharded_collections_expose_their_local_lookups(sharded):
    from freescale.comm.routes import local_lookup

    for module, pooled in ((sharded.module.embedding_collection, False),
                           (sharded.module.user_embedding_collection, True)):
        assert hasattr(module, "_lookups"), f"{type(module).__name__}._lookups is gone: freescale/comm/routes.py local_lookup"
        [kernel] = list(module._lookups)
        features = [name for config in kernel.grouped_configs for table in config.embedding_tables
                    for name in table.feature_names]
        assert features, f"{type(kernel).__name__}.grouped_configs[*].embedding_tables[*].feature_names"
        assert local_lookup(module, pooled).keys == tuple(features)


def test_sharding_plans_name_each_rows_rank(sharded):
    from freescale.comm.routes import table_route
    from freescale.training.model.recommender import ITEM_TABLE, USER_TABLE

    for module, table in ((sharded.module.embedding_collection, ITEM_TABLE),
                          (sharded.module.user_embedding_collection, USER_TABLE.format(index=0))):
        shards = module.module_sharding_plan[table].sharding_spec.shards
        assert [(s.shard_offsets, s.placement.rank()) for s in shards][0] == ([0, 0], 0)
        route = table_route(module, table)
        assert route.ranks.tolist() == [0] and route.starts.tolist() == [0]


def test_fused_tables_are_marked_and_dense_parameters_are_not(sharded):
    from freescale.training.parallel.sharding import dense_parameters

    tables = list(sharded.module.embedding_collection.parameters())
    tables += list(sharded.module.user_embedding_collection.parameters())
    assert tables and all(getattr(p, "_in_backward_optimizers", None) is not None for p in tables), \
        "Parameter._in_backward_optimizers is gone: freescale/training/parallel/sharding.py dense_parameters"
    dense = dense_parameters(sharded)
    assert dense and not {id(p) for p in dense} & {id(p) for p in tables}
    assert {id(p) for p in dense} == {id(p) for p in sharded.module.encoder.parameters()} | \
        {id(p) for p in sharded.module.user_projection.parameters()} | \
        ({id(p) for p in sharded.module.rating_embedding.parameters()} if sharded.module.rating_embedding else set())


def test_gradient_division_and_fused_optimizers(sharded):
    from torchrec.distributed.comm_ops import get_gradient_division

    assert isinstance(get_gradient_division(), bool)
    for module in (sharded.module.embedding_collection, sharded.module.user_embedding_collection):
        assert callable(module.fused_optimizer.state_dict)


def test_prefetcher_thread_can_be_stopped():
    from torchdata.nodes import IterableWrapper, Loader, Prefetcher

    from freescale.training.data.shard_reader import stop_prefetch

    loader = Loader(Prefetcher(IterableWrapper(range(100)), prefetch_factor=2))
    assert next(iter(loader)) == 0
    running = getattr(loader.root, "_it", None)
    assert running is not None and callable(getattr(running, "_shutdown", None)), \
        "torchdata Prefetcher._it._shutdown is gone: freescale/training/data/shard_reader.py stop_prefetch"
    stop_prefetch(loader)
