"""The comm layer applied to the sharded model: which features the exchange carries, in which groups.

    comm = CommLayer(config.comm, dmp_model, env, dense_params, timeout)
    exchange = comm.start(batch, negatives)  # a step ahead: ids leave during the previous step
    exchange.send_ids()
    exchange.look_up()                       # rows come back, highest priority first
    loss, _ = model(batch, negative_ids=negatives, source=exchange)
    loss.backward()                          # gradients leave as they become ready
    exchange.finish_backward(); freescale.comm.dense_sync.finish()

``freescale.training.loop.step.OverlappedStep`` places these calls in a step.

This is the only module that knows both the model's tables and the comm layer:
the item table carries the ``item`` and ``negative`` features, each user feature
has its own table, and all of them share one width.
"""
from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn
from torchrec.distributed.comm_ops import get_gradient_division

from freescale.comm.backend import BackendUnavailable, build_backend
from freescale.comm.clock import CommClock
from freescale.comm.dense_sync import BucketedGradSync
from freescale.comm.exchange import EmbeddingExchange, ExchangedFeature, StepExchange, priority_groups
from freescale.comm.routes import local_lookup, table_route
from freescale.training.data.batch import FEATURE_KEYS, ITEM_FEATURE, NEGATIVE_FEATURE, SequenceBatch
from freescale.training.config import CommConfig, ConfigError
from freescale.training.parallel.distributed import DistEnv
from freescale.training.model.recommender import ITEM_TABLE, USER_TABLE

USER_ALIAS = "user"  # stands for every user feature in comm.priority_groups


class CommLayer:
    def __init__(self, config: CommConfig, model: nn.Module, env: DistEnv, dense: list[nn.Parameter],
                 timeout: timedelta):
        module = model.module
        self.mode = config.mode
        prioritized = config.mode == "prioritized"
        # Everything checkable is checked before the first collective (creating groups), so
        # a bad setting stops every rank with its one line instead of leaving peers waiting.
        item_route = table_route(module.embedding_collection, ITEM_TABLE)
        features = [ExchangedFeature(name, item_route, 0) for name in FEATURE_KEYS]
        lookups = [local_lookup(module.embedding_collection, pooled=False)]
        self.user_feature_names = list(module.user_feature_names)
        if module.user_embedding_collection is not None:
            lookups.append(local_lookup(module.user_embedding_collection, pooled=True))
            features += [ExchangedFeature(name, table_route(module.user_embedding_collection,
                                                            USER_TABLE.format(index=i)), 1)
                         for i, name in enumerate(self.user_feature_names)]
        names = [f.name for f in features]
        if prioritized:
            try:
                groups = priority_groups(config.priority_groups, names, {USER_ALIAS: self.user_feature_names})
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        else:
            groups = [names]
        self.backend = build_backend(config.backend, timeout)
        if self.backend.name == "gloo" and env.device.type != "cpu":
            raise BackendUnavailable(f"comm.backend gloo moves CPU tensors; this run's device is {env.device}")
        self.clock = CommClock()
        # Groups are created collectively, in the same order on every rank.
        self.embedding_group = self.backend.new_group("embedding", high_priority=True)
        self.dense_group = self.backend.new_group("dense")
        self.dense_sync = BucketedGradSync(dense, self.backend, self.dense_group, self.clock, env.world_size,
                                           bucket_bytes=config.bucket_kb * 1024, hold_last=prioritized)
        self.exchange = EmbeddingExchange(
            features, lookups, groups, self.backend, self.embedding_group, self.clock, env.rank, env.world_size,
            dim=module.config.embedding_dim, device=env.device,
            gradient_divisor=env.world_size if get_gradient_division() else 1,
            on_gradients_issued=self.dense_sync.release if prioritized else None)

    def describe(self) -> str:
        groups = " > ".join(f"[{g}]" for g in self.exchange.group_names)
        return f"comm mode {self.mode}, backend {self.backend.name}: {self.backend.path}; exchange groups {groups}"

    def start(self, batch: SequenceBatch, negatives: torch.Tensor) -> BatchExchange:
        """Phase 1 of ``batch``'s exchange: its ids' counts leave now."""
        ids = {ITEM_FEATURE: batch.item_ids, NEGATIVE_FEATURE: negatives}
        for i, name in enumerate(self.user_feature_names):
            ids[name] = batch.user_features[:, i] if batch.user_features is not None and batch.batch_size \
                else torch.zeros(0, dtype=torch.int64, device=negatives.device)
        return BatchExchange(self.exchange.start(ids), self.user_feature_names)


class BatchExchange:
    """One batch's exchange: its phases, and the model's embedding source
    (``freescale.training.model.recommender.EmbeddingSource``) over the rows it brings back."""

    def __init__(self, exchange: StepExchange, user_feature_names: list[str]):
        self.exchange = exchange
        self.user_feature_names = user_feature_names

    def send_ids(self) -> None:
        self.exchange.send_ids()

    def look_up(self) -> None:
        self.exchange.look_up()

    def finish_backward(self) -> None:
        self.exchange.finish_backward()

    def inputs(self, batch: SequenceBatch, negative_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The history items' and user features' groups (waits for those groups only)."""
        items = self.exchange.feature(ITEM_FEATURE)
        users = None
        if self.user_feature_names:
            users = torch.cat([self.exchange.feature(name) for name in self.user_feature_names], dim=1)
        return items, users

    def negatives(self) -> torch.Tensor:
        """The lowest-priority group in the prioritized mode: waited for at the loss."""
        return self.exchange.feature(NEGATIVE_FEATURE)
