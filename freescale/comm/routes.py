"""Where an id's embedding row lives, and what each rank's TorchRec shards can look up locally.

Both come from what ``DistributedModelParallel`` built: the sharding plan of a
sharded module names, per table, which rows each rank holds (row-wise: one block
per rank; table-wise: the whole table on one rank), and the module's local lookup
(a fused TBE kernel, optimizer included) takes those rows' local ids. The exchange
moves ids and rows between ranks itself and calls only these local lookups, so the
fused optimizer, the checkpoint format and the sharding stay TorchRec's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TableRoute:
    """Shard ``i`` of a table holds rows ``starts[i] ..`` (up to the next start) on rank ``ranks[i]``."""

    starts: torch.Tensor
    ranks: torch.Tensor

    def owners(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rank holding each id's row, the id's row within that rank's shard)``."""
        shard = torch.searchsorted(self.starts, ids, right=True) - 1
        return self.ranks[shard], ids - self.starts[shard]


def table_route(sharded_module: nn.Module, table: str) -> TableRoute:
    """The route of ``table`` from a TorchRec sharded module's plan (row- or table-wise only)."""
    sharding = sharded_module.module_sharding_plan[table]
    shards = sorted(sharding.sharding_spec.shards, key=lambda s: s.shard_offsets[0])
    if any(s.shard_offsets[1] != 0 for s in shards):
        raise ValueError(f"table {table}: sharding {sharding.sharding_type} splits columns; the exchange "
                         "routes whole rows (row_wise or table_wise)")
    return TableRoute(starts=torch.tensor([s.shard_offsets[0] for s in shards], dtype=torch.int64),
                      ranks=torch.tensor([s.placement.rank() for s in shards], dtype=torch.int64))


@dataclass(frozen=True)
class LocalLookup:
    """One sharded module's lookup on this rank: the TorchRec kernel and the feature order it takes."""

    kernel: nn.Module | None
    """The module's grouped lookup, or None when this rank holds none of its tables."""
    keys: tuple[str, ...]
    """Features the kernel looks up, in the order it expects them."""
    pooled: bool
    """A bag (pooled) kernel: one id per bag here, so each bag's output is that id's row."""


def local_lookup(sharded_module: nn.Module, pooled: bool) -> LocalLookup:
    """The module's TorchRec kernel: its private ``_lookups`` (tests/training/test_torchrec_private.py pins it)."""
    lookups = list(sharded_module._lookups)
    if len(lookups) != 1:
        raise ValueError(f"{type(sharded_module).__name__} mixes {len(lookups)} sharding types; the exchange "
                         "expects one per module")
    kernel = lookups[0]
    keys = tuple(name for config in kernel.grouped_configs for table in config.embedding_tables
                 for name in table.feature_names)
    return LocalLookup(kernel if keys else None, keys, pooled)
