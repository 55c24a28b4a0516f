"""Sequential recommender: TorchRec item table + jagged encoder (``freescale.training.model.encoders``) + loss.

The item table is a TorchRec ``EmbeddingCollection`` so ``DistributedModelParallel``
can shard it (table-wise / row-wise, optimizer fused into backward); every
lookup of item vectors -- history items, sampled negatives, and the whole
catalog at evaluation -- goes through it, so all of them keep working once the
table is sharded. When the data carries user-level features (one categorical id
per feature per user), they are looked up in a TorchRec ``EmbeddingBagCollection``
(one table per feature, sharded the same way), projected to the model width and
added to every input position of that user's history. Everything else (the
encoder, rating embedding, the user projection) is dense and replicated with data
parallelism. The encoder is ``model.encoder``'s (``freescale.training.model.encoders``: HSTU, SASRec or one
registered beside them), the loss ``loss.kind``'s (``freescale.training.model.losses.LOSSES``: sampled softmax
or SASRec's binary cross-entropy); every encoder trains with either loss. The encoder computes at
``training.precision`` (``"bf16"``: under autocast, from fp32 weights); the rest in fp32.

Single-process use (tests, cost calibration)::

    model = build_local_model(num_items, ModelConfig())
    loss, stats = model(batch, num_negatives=128)                  # sampled softmax
    loss, stats = model(batch, loss_kind="bce")                     # one negative per position

Distributed use: ``build_model(num_items, config, device)`` puts the table on the
``meta`` device for ``DistributedModelParallel`` to shard and materialise. Under
DMP, ``all_item_embeddings`` and the lookups of ``encode`` (and of the evaluator's
``score_queries`` without local tables) are collectives: every rank must call them, the same
number of times. Scoring held-out items is the evaluator's (``freescale.training.eval.evaluator``).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from freescale.training.data.batch import (
    FEATURE_KEYS,
    ITEM_FEATURE,
    NEGATIVE_FEATURE,
    SequenceBatch,
    item_features,
    user_feature_kjt,
)
from freescale.training.config import ConfigError, CudaGraphs, LossKind, ModelConfig, Precision
from freescale.training.model.encoder_graphs import GraphedEncoder
from freescale.training.model.encoders import Encoder
from freescale.training.model.registry import build_encoder
from freescale.training.ops.jagged import next_item_positions
from freescale.training.model.losses import LOSSES, LossHead
from freescale.training.model.precision import encoder_autocast

if TYPE_CHECKING:  # TorchRec loads when a model builds its tables (tables=False builds none)
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

# Not "items": EmbeddingCollection keeps tables in a ModuleDict, whose .items() it would shadow.
ITEM_TABLE = "item_embedding"
# User feature tables are named by position: feature names come from data and may
# hold characters a module name cannot.
USER_TABLE = "user_feature_{index}"
NUM_RATINGS = 6  # 0 = unknown, 1..5
PADDING_ID = 0


class EmbeddingSource(Protocol):
    """Where one training forward's embedding rows come from: the model's own tables
    (``TableLookup``) or rows looked up elsewhere (the comm layer's exchange)."""

    def inputs(self, batch: SequenceBatch, negative_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``([T, D] history item rows, [B, F * D] user feature rows or None)``: what the encoder needs."""
        ...

    def negatives(self) -> torch.Tensor:
        """``[M, D]`` rows of the ``negative_ids`` given to ``inputs``; first needed by the loss,
        so a source may still be receiving them while the encoder runs."""
        ...


class _SparseBoundary(torch.autograd.Function):
    """Identity on the sparse lookups' outputs whose backward runs once all their
    gradients are in. Without it the autograd engine may start one table's backward
    (a blocking collective under DMP) while the dense backward still owes another
    output its gradient, so the wait for the slowest rank would be counted as dense
    compute."""

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


class TableLookup:
    """The model's tables as the embedding source: TorchRec's lookups (blocking collectives
    under DMP), every table's rows in one go."""

    def __init__(self, model: "SequentialRecommender"):
        self.model = model
        self._negatives: torch.Tensor | None = None

    def inputs(self, batch: SequenceBatch, negative_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        items, negatives = self.model.lookup(batch.lengths, batch.item_ids, negative_ids)
        users = self.model.lookup_users(batch.user_features)
        outputs = [items, negatives] + ([users] if users is not None else [])
        if torch.is_grad_enabled():
            outputs = list(_SparseBoundary.apply(*outputs))
        self._negatives = outputs[1]
        return outputs[0], (outputs[2] if users is not None else None)

    def negatives(self) -> torch.Tensor:
        assert self._negatives is not None, "inputs() looks the negatives up"
        return self._negatives


class LocalItemTable(nn.Module):
    """The item table as a plain ``nn.Embedding`` (sparse gradients, as TorchRec's fused update
    touches only the looked-up rows), for one process without TorchRec: cost calibration on a bare
    GPU machine, where only the dense span is timed. Initialised as the TorchRec table is
    (uniform +-``embedding_init_scale``)."""

    def __init__(self, num_items: int, config: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__()
        scale = config.embedding_init_scale
        self.table = nn.Embedding(num_items + 1, config.embedding_dim, sparse=True, device=device)
        nn.init.uniform_(self.table.weight, -scale, scale)

    def source(self) -> "EmbeddingSource":
        """A forward's rows from this table (no user features: it holds none)."""
        return _LocalLookup(self.table)


class _LocalLookup:
    def __init__(self, table: nn.Embedding):
        self.table = table
        self._negatives: torch.Tensor | None = None

    def inputs(self, batch: SequenceBatch, negative_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if batch.user_features is not None:
            raise ValueError("LocalItemTable holds no user feature tables; the batch has user features")
        outputs = [self.table(batch.item_ids.to(torch.int64)), self.table(negative_ids.to(torch.int64))]
        if torch.is_grad_enabled():
            outputs = list(_SparseBoundary.apply(*outputs))
        self._negatives = outputs[1]
        return outputs[0], None

    def negatives(self) -> torch.Tensor:
        assert self._negatives is not None, "inputs() looks the negatives up"
        return self._negatives


class SequentialRecommender(nn.Module):
    """Next-item retrieval model: item table (TorchRec) -> encoder (``model.encoder``) -> loss.

    Args:
        num_items: catalog size; item ids are ``1..num_items`` and 0 is padding.
        config: model configuration.
        device: device of the dense part (encoder, rating embedding).
        embedding_device: device the item table is created on; ``meta`` when
            ``DistributedModelParallel`` will shard and materialise it.
        user_features: ``(name, table size)`` of each user feature, as listed in
            the shard manifest; empty for data without user features.
        precision: the encoder's arithmetic (``training.precision``; ``"bf16"`` runs it under
            autocast, ``training.precision.encoder_autocast``); every other part, the tables
            and the loss included, computes in fp32.
        cuda_graphs: ``training.cuda_graphs``; ``"encoder"`` replays the encoder's training forward
            and backward as CUDA graphs per padded shape (``freescale.training.model.encoder_graphs``). CUDA only.
        tables: False builds no TorchRec tables (and loads no TorchRec): every forward then
            takes its rows from a ``source``, e.g. ``LocalItemTable``'s (``build_dense_model``).
    """

    def __init__(
        self,
        num_items: int,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        embedding_device: torch.device | str | None = None,
        user_features: list[tuple[str, int]] | tuple = (),
        precision: Precision = "fp32",
        tables: bool = True,
        cuda_graphs: CudaGraphs = "off",
    ) -> None:
        super().__init__()
        if num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {num_items}")
        self.num_items = num_items
        self.config = config
        self.precision = precision
        table_device = torch.device(embedding_device if embedding_device is not None else device)
        self.embedding_collection: EmbeddingCollection | None = None
        if tables:
            self.embedding_collection = _build_item_table(num_items, config, table_device)
        self.rating_embedding: nn.Embedding | None = None
        if config.use_rating_feature:
            self.rating_embedding = _build_rating_embedding(config, device)
        self.user_feature_names = [name for name, _ in user_features]
        self.user_feature_sizes = [int(size) for _, size in user_features]
        self.user_embedding_collection: EmbeddingBagCollection | None = None
        self.user_projection: nn.Linear | None = None
        if user_features:
            if not tables:
                raise ValueError("user features need the model's tables (tables=True)")
            self.user_embedding_collection = _build_user_tables(user_features, config, table_device)
            self.user_projection = _build_user_projection(len(user_features), config.embedding_dim, device)
        self.encoder = build_encoder(config).to(device)
        # A kernel that cannot run on this device stops the job here, not at the first step.
        self.attention_kernel = self.encoder.kernel(device)
        # A plain attribute, not a submodule: the graphs run the encoder's own parameters, and the
        # state dict stays the encoder's.
        self.graphed_encoder: GraphedEncoder | None = None
        if cuda_graphs == "encoder":
            self.graphed_encoder = _build_graphed_encoder(self.encoder, config, device)

    # ------------------------------------------------------------------ lookups

    def fused_optimizers(self) -> list[Any]:
        """The tables' optimizers, fused into their backward (TorchRec's, once the model is
        sharded): the item table's, then the user feature tables' if any."""
        collections = (self.embedding_collection, self.user_embedding_collection)  # none without tables
        return [collection.fused_optimizer for collection in collections if collection is not None]

    def lookup(
        self, lengths: torch.Tensor, item_ids: torch.Tensor, negatives: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Item and negative embeddings, ``[T, D]`` and ``[M, D]``, through the (possibly sharded) table."""
        if self.embedding_collection is None:
            raise ValueError("this model was built without tables: give its forward a source of rows")
        embeddings = self.embedding_collection(item_features(lengths, item_ids, negatives))
        return embeddings[ITEM_FEATURE].values(), embeddings[NEGATIVE_FEATURE].values()

    def lookup_users(self, user_features: torch.Tensor | None,
                     user_tables: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """``[B, F * D]`` the user features' embeddings side by side; None without user features.

        Looks ids up through the (possibly sharded) bag collection, a collective
        under DMP; with ``user_tables`` (from ``all_user_feature_tables()``) it
        reads the rows from them instead, with no collective.
        """
        if self.user_projection is None:
            return None
        if user_features is None:
            raise ValueError(f"the model has user features {self.user_feature_names} but the batch has none")
        if user_tables is not None:
            return torch.cat([table[user_features[:, i]] for i, table in enumerate(user_tables)], dim=1)
        pooled = self.user_embedding_collection(user_feature_kjt(self.user_feature_names, user_features))
        per_feature = pooled.to_dict()
        vectors = torch.cat([per_feature[name] for name in self.user_feature_names], dim=1)
        return vectors[: user_features.shape[0]]  # an empty batch kept one empty slot

    def user_vectors(self, user_embeddings: torch.Tensor | None) -> torch.Tensor | None:
        """``[B, D]``: ``lookup_users``'s output projected to the model width (None passes through)."""
        return None if user_embeddings is None else self.user_projection(user_embeddings)

    @torch.no_grad()
    def all_user_feature_tables(self, chunk_size: int = 65536) -> list[torch.Tensor] | None:
        """Every row of every user feature table, ``[size, D]`` each (None without user features).

        Looked up through the bag collection in chunks, so it works sharded; under
        DMP all ranks must call it together.
        """
        if self.user_embedding_collection is None:
            return None
        from torchrec import KeyedJaggedTensor

        device = self._dense_device()
        pieces: list[list[torch.Tensor]] = [[] for _ in self.user_feature_names]
        for start in range(0, max(self.user_feature_sizes), chunk_size):
            # One id per slot; a feature whose table is shorter gets empty slots.
            ids = torch.arange(start, start + chunk_size, device=device)
            valid = torch.stack([ids < size for size in self.user_feature_sizes])
            kjt = KeyedJaggedTensor(keys=self.user_feature_names, values=ids.expand_as(valid)[valid],
                                    lengths=valid.to(torch.int64).reshape(-1))
            pooled = self.user_embedding_collection(kjt).to_dict()
            for i, name in enumerate(self.user_feature_names):
                pieces[i].append(pooled[name][valid[i]])
        return [torch.cat(rows) for rows in pieces]

    def _input_embeddings(self, item_embeddings: torch.Tensor, ratings: torch.Tensor,
                          user_vectors: torch.Tensor | None = None, lengths: torch.Tensor | None = None
                          ) -> torch.Tensor:
        x = item_embeddings
        if user_vectors is not None:
            x = x + torch.repeat_interleave(user_vectors, lengths, dim=0, output_size=item_embeddings.shape[0])
        if self.rating_embedding is not None:
            x = x + self.rating_embedding(ratings.clamp(0, NUM_RATINGS - 1).to(torch.int64))
        # sqrt(D) as in the reference HSTU preprocessor: puts inputs at unit-ish
        # scale on the residual stream whatever the init scale of the table.
        return x * math.sqrt(self.config.embedding_dim)

    def encode_rows(
        self, item_embeddings: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor, ratings: torch.Tensor,
        user_vectors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, D]`` L2-normalised encoder output at every position of the jagged rows
        ``item_embeddings`` ``[T, D]`` (the item table's rows of the positions, however looked up),
        in fp32 whatever ``precision``."""
        lengths = offsets[1:] - offsets[:-1]
        values = self._input_embeddings(item_embeddings, ratings, user_vectors, lengths)
        encoder = self.graphed_encoder or self.encoder
        with encoder_autocast(self.precision, values.device):
            hidden = encoder(values, offsets, timestamps)
        # The loss's logits (cosines / temperature) and the rankings in fp32: in bf16 a logit of
        # 20 would be off by up to 0.06, more than the gaps between close candidates.
        return hidden.float()

    def encode(self, batch: SequenceBatch) -> torch.Tensor:
        """``[T, D]`` L2-normalised encoder output at every history position."""
        empty = torch.zeros(0, dtype=torch.int64, device=batch.item_ids.device)
        item_embeddings, _ = self.lookup(batch.lengths, batch.item_ids, empty)
        return self.encode_rows(item_embeddings, batch.offsets, batch.timestamps, batch.ratings,
                                self.user_vectors(self.lookup_users(batch.user_features)))

    def sample_negatives(
        self, num_negatives: int, device: torch.device, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """``num_negatives`` ids uniform in ``1..num_items`` (never padding).

        Uses ``generator`` if given, else the global RNG of ``device``, so
        ``torch.manual_seed`` makes training reproducible. A generator on another device (the
        CPU generator calibrate and the trainer seed, with a model on CUDA) draws there and the ids
        are moved: torch refuses a CPU generator for a CUDA draw.
        """
        drawn_on = generator.device if generator is not None else device
        return torch.randint(1, self.num_items + 1, (num_negatives,), device=drawn_on, generator=generator).to(device)

    @torch.no_grad()
    def all_item_embeddings(self, chunk_size: int = 65536, normalize: bool = True) -> torch.Tensor:
        """``[num_items + 1, D]`` embedding of every id (row 0, padding, is zeros).

        Looks ids up through the EmbeddingCollection in chunks, so it works when
        the table is sharded (each rank then receives the whole table; under DMP
        all ranks must call this together).
        """
        device = self._dense_device()
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        rows = [torch.zeros(1, self.config.embedding_dim, device=device)]
        for start in range(1, self.num_items + 1, chunk_size):
            ids = torch.arange(start, min(start + chunk_size, self.num_items + 1), device=device)
            _, embeddings = self.lookup(empty, empty, ids)
            rows.append(embeddings)
        table = torch.cat(rows)
        return F.normalize(table, dim=-1) if normalize else table

    def _dense_device(self) -> torch.device:
        return next(self.encoder.parameters()).device

    # ----------------------------------------------------------------- training

    def forward(
        self,
        batch: SequenceBatch,
        num_negatives: int = 128,
        *,
        full_softmax: bool = False,
        generator: torch.Generator | None = None,
        negative_ids: torch.Tensor | None = None,
        source: EmbeddingSource | None = None,
        loss_kind: LossKind = "sampled_softmax",
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Next-item loss over every position of every history, mean over the targets.

        Positions ``0..L-2`` of a sample predict positions ``1..L-1``. ``loss_kind``
        (``loss.kind``) chooses the head (``freescale.training.model.losses.LOSSES``):

        * ``"sampled_softmax"`` (``SampledSoftmax``): negatives are ``num_negatives`` uniform ids
          plus (``config.in_batch_negatives``) the batch's unique targets, shared by all
          queries; a negative equal to a query's target is masked. With
          ``full_softmax=True`` the negatives are instead the whole catalog (looked up
          through the table every step -- only for small catalogs), which makes the loss
          the exact full softmax.
        * ``"bce"`` (``BinaryCrossEntropy``): one uniform negative per position (``T`` ids, row
          ``r``'s negative is ``negative_ids[r]``), binary cross-entropy of the target against it.

        ``negative_ids`` (default: sampled here) are the uniform negatives. ``source``
        supplies the rows (default: ``TableLookup(self)``, the model's own tables); the
        comm layer's exchange is the other source; ``DenseSpanProbe.timed(source)`` times
        the dense span of a forward through either.

        Returns ``(loss, stats)``; stats are detached scalar tensors (no host
        sync), so the trainer decides when to read or all-reduce them.
        """
        device = batch.item_ids.device
        head = LOSSES[loss_kind].from_config(self.config, full_softmax)
        negative_ids = self._negative_ids(head, batch, num_negatives, full_softmax, negative_ids, generator)
        if source is None:
            source = TableLookup(self)
        item_embeddings, user_embeddings = source.inputs(batch, negative_ids)
        user_vectors = self.user_vectors(user_embeddings)

        offsets = batch.offsets
        # The targets and what the loss draws from them, before the encoder: on a GPU the in-batch
        # negatives' unique ids wait for the queued work, here the lookups; after the encoder they
        # would wait for its whole forward, and the GPU would idle while the host issued the rest.
        query_rows, target_rows = next_item_positions(offsets, batch.num_targets)
        target_ids = batch.item_ids[target_rows]
        prepared = head.prepare(target_ids, generator)
        hidden = self.encode_rows(item_embeddings, offsets, batch.timestamps, batch.ratings, user_vectors)
        positive = F.normalize(item_embeddings[target_rows], dim=-1)
        # Asked for only now: a source may still be receiving the negatives while the encoder runs.
        loss, used_negatives, stats = head(hidden, query_rows, positive, target_ids, source.negatives(),
                                           negative_ids, prepared)
        return loss, _loss_stats(loss, target_ids.numel(), used_negatives, stats, device)

    def _negative_ids(self, head: LossHead, batch: SequenceBatch, num_negatives: int, full_softmax: bool,
                      negative_ids: torch.Tensor | None, generator: torch.Generator | None) -> torch.Tensor:
        """A forward's uniform negatives: the whole catalog under ``full_softmax``, else
        ``negative_ids`` when given, else ``head.negative_count`` ids drawn here."""
        device = batch.item_ids.device
        if full_softmax:
            return torch.arange(1, self.num_items + 1, device=device)
        if negative_ids is None:
            count = head.negative_count(num_negatives, batch.num_tokens)
            return self.sample_negatives(count, device, generator)
        return negative_ids

    @staticmethod
    def negative_count(loss_kind: LossKind, num_negatives: int, num_tokens: int) -> int:
        """Uniform negatives one forward draws under ``loss_kind`` (``freescale.training.model.losses.LossHead``)."""
        return LOSSES[loss_kind].negative_count(num_negatives, num_tokens)


def _build_item_table(num_items: int, config: ModelConfig, device: torch.device) -> EmbeddingCollection:
    """The item table (ids ``0..num_items``), a TorchRec collection of one table looked up by both
    features (``FEATURE_KEYS``), rows uniform in ``+-embedding_init_scale``."""
    from torchrec import EmbeddingCollection, EmbeddingConfig

    scale = config.embedding_init_scale
    return EmbeddingCollection(
        tables=[EmbeddingConfig(name=ITEM_TABLE, num_embeddings=num_items + 1, embedding_dim=config.embedding_dim,
                                feature_names=list(FEATURE_KEYS), weight_init_min=-scale,
                                weight_init_max=scale)],
        device=device,
    )


def _build_rating_embedding(config: ModelConfig, device: torch.device | str) -> nn.Embedding:
    """One row per rating (row 0, unknown, zero and never trained)."""
    scale = config.embedding_init_scale
    rating_embedding = nn.Embedding(NUM_RATINGS, config.embedding_dim, padding_idx=0, device=device)
    # Same spread as item rows (uniform +-scale has std scale/sqrt(3)), so
    # neither input dominates at initialisation.
    with torch.no_grad():
        nn.init.normal_(rating_embedding.weight, std=scale / math.sqrt(3.0))
        rating_embedding.weight[0].zero_()
    return rating_embedding


def _build_user_tables(user_features: list[tuple[str, int]] | tuple, config: ModelConfig,
                       device: torch.device) -> EmbeddingBagCollection:
    """One summed bag table per user feature, named by position (``USER_TABLE``), rows uniform in
    ``+-embedding_init_scale``."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    scale = config.embedding_init_scale
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=USER_TABLE.format(index=i), num_embeddings=size,
                                   embedding_dim=config.embedding_dim, feature_names=[name],
                                   pooling=PoolingType.SUM, weight_init_min=-scale, weight_init_max=scale)
                for i, (name, size) in enumerate(user_features)],
        device=device,
    )


def _build_user_projection(num_features: int, dim: int, device: torch.device | str) -> nn.Linear:
    """The user features' embeddings side by side (``num_features * dim``) to the model width."""
    projection = nn.Linear(num_features * dim, dim, device=device)
    # Zero at start: training begins from the item-only model and lets the
    # features in as far as they help (measured: a random start lost HR@10).
    nn.init.zeros_(projection.weight)
    nn.init.zeros_(projection.bias)
    return projection


def _build_graphed_encoder(encoder: Encoder, config: ModelConfig, device: torch.device | str) -> GraphedEncoder:
    """``encoder`` replayed as CUDA graphs (``training.cuda_graphs = 'encoder'``); ConfigError when
    the device is not CUDA or the encoder cannot be captured."""
    if torch.device(device).type != "cuda":
        raise ConfigError(f"training.cuda_graphs = 'encoder' needs a CUDA device; this model is on "
                          f"{torch.device(device).type} (set training.cuda_graphs = 'off')")
    reason = encoder.not_capturable(device)
    if reason is not None:
        raise ConfigError(f"training.cuda_graphs = 'encoder' cannot capture model.encoder = "
                          f"'{config.encoder}': {reason} (set training.cuda_graphs = 'off')")
    return GraphedEncoder(encoder)


def _loss_stats(loss: torch.Tensor, num_targets: int, used_negatives: int, head_stats: dict[str, torch.Tensor],
                device: torch.device) -> dict[str, torch.Tensor]:
    """A forward's stats: its loss (detached), target and negative counts, then the head's own."""
    return {  # filled on the device: a host number copied in would wait for the GPU
        "loss": loss.detach(),
        "num_targets": torch.full((), float(num_targets), device=device),
        "num_negatives": torch.full((), float(used_negatives), device=device),
        **head_stats,
    }


def build_model(num_items: int, config: ModelConfig, device: torch.device | str,
                user_features: list[tuple[str, int]] | tuple = (), precision: Precision = "fp32",
                cuda_graphs: CudaGraphs = "off") -> SequentialRecommender:
    """Model for ``DistributedModelParallel``: item table on ``meta``, dense part on ``device``.

    DMP shards the table and materialises its shards (initialised from the
    table's ``weight_init_min/max``). The unsharded result cannot run forward
    by itself; for single-process use call ``build_local_model``.
    """
    return SequentialRecommender(num_items, config, device=device, embedding_device=torch.device("meta"),
                                 user_features=user_features, precision=precision, cuda_graphs=cuda_graphs)


def build_local_model(
    num_items: int, config: ModelConfig, device: torch.device | str = "cpu",
    user_features: list[tuple[str, int]] | tuple = (), precision: Precision = "fp32",
) -> SequentialRecommender:
    """Single-process model (tests, cost calibration): everything, tables included, on ``device``."""
    return SequentialRecommender(num_items, config, device=device, embedding_device=device,
                                 user_features=user_features, precision=precision)


def build_dense_model(num_items: int, config: ModelConfig, device: torch.device | str = "cpu",
                      precision: Precision = "fp32", cuda_graphs: CudaGraphs = "off",
                      ) -> tuple[SequentialRecommender, LocalItemTable]:
    """The model without TorchRec tables, and a plain item table to feed its forwards
    (``model(batch, source=table.source())``): what timing the dense span needs, with torch alone."""
    table = LocalItemTable(num_items, config, device)
    return (SequentialRecommender(num_items, config, device=device, precision=precision, tables=False,
                                  cuda_graphs=cuda_graphs), table)
