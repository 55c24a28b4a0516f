"""End-of-run evaluation: HR@10, NDCG@10 and MRR on the leave-one-out targets, against the
most-popular baseline, over all ranks' samples, under the configured protocol.

Both held-out items are scored, in one pass: the test item (``hr_at_10``, ...: the number to
publish) and the validation item (``valid_hr_at_10``, ...: the one to choose models and
hyperparameters by without looking at test), each from its own query (the test item's
history includes the validation item). Full catalog always (``hr_at_10``, ``ndcg_at_10``,
``mrr``). With
``evaluation.sampled_negatives = N > 0`` also SASRec's protocol: each target ranked against
N items drawn uniformly from those its user never interacted with (``sampled_hr_at_10``,
``sampled_ndcg_at_10``, ``sampled_mrr``, and the baseline's ``popular_sampled_*``).

"Interacted with" is every item of the sample: its history, its validation item and its test
item. So a user's negatives are the same for validation and test, and neither target is ever
another's negative. (SASRec's code excludes only the training history, so its test target
can be ranked against its own validation item.) Items older than the history the shards kept
(``prepare --max-seq-len``) are not known here and may be drawn.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from freescale.shards.manifest import Manifest
from freescale.training.data.batch import SequenceBatch
from freescale.training.config import ConfigError, EvaluationConfig
from freescale.training.ops.jagged import jagged_concat_last, last_positions
from freescale.training.model.recommender import SequentialRecommender
from freescale.training.eval.catalog_slice import QUERY_CHUNK, CatalogSlice, global_ranks, item_rows
from freescale.training.eval.ranking_metrics import (
    ExcludeIds,
    ProtocolMetrics,
    RetrievalMetrics,
    full_and_unseen_metrics,
    metrics_from_ranks,
    most_popular_baseline,
    retrieval_metrics,
    sampled_retrieval_metrics,
    unseen_negatives,
)
from freescale.training.data.shard_reader import build_loader

K = 10
EVAL_BATCH_SAMPLES = 512
"""Samples scored at once: consecutive shard batches are joined up to this many. One rank's
validation pass on Amazon Beauty encoded 1.8x faster in batches of 512 than in the shards' 64
(``benchmarks/eval_bench.py``): the encoder's per-batch overhead is paid 8 times less often."""
# The summary's names per held-out item: test unprefixed (what papers report), validation prefixed.
SPLIT_PREFIX = {"test": "", "valid": "valid_"}


def check_protocol(evaluation: EvaluationConfig, manifest: Manifest) -> None:
    """Refuse, before training, a sample size the catalog cannot supply (ConfigError)."""
    # Every user interacted with at least 3 items (history, validation, test).
    available = manifest.num_items - 3
    if evaluation.sampled_negatives > available:
        raise ConfigError(f"evaluation.sampled_negatives={evaluation.sampled_negatives} is more than the "
                          f"{available} items a user with 3 interactions leaves of the {manifest.num_items} "
                          f"in {manifest.root or 'the shards'} (0 = full-catalog ranking only)")


def batch_negatives(batch: SequenceBatch, num_items: int, count: int, seed: int) -> torch.Tensor:
    """``[B, count]`` each sample's negatives: uniform over the items its user never interacted
    with (history, validation and test item), seeded by ``(seed, user id)``."""
    ids, offsets = jagged_concat_last(batch.item_ids, batch.offsets, batch.valid_item)
    ids, _ = jagged_concat_last(ids, offsets, batch.test_item)
    return unseen_negatives(batch.user_ids, (batch.lengths + 2, ids), num_items, count, seed)


class NegativeDraws:
    """The sampled protocol's negatives of one rank's shard, drawn at its first evaluation and
    reused by every later one of the run (each validation, then the test).

    A sample's draw depends on the seed, its user and the items it holds alone
    (``batch_negatives``), and a rank reads its shard in the same order every pass, so the
    draws are kept by the batch's place in that order; the user ids are checked against the
    batch's, and a batch that differs is drawn again. Redrawing every validation cost 38% of a
    validation pass on Amazon Beauty (``benchmarks/eval_bench.py``). Holds ``count`` ids per sample
    of the shard (int32: 400 bytes per sample at 100 negatives)."""

    def __init__(self, num_items: int, count: int, seed: int) -> None:
        self.num_items, self.count, self.seed = num_items, count, seed
        self.drawn: dict[int, tuple[list[str], torch.Tensor]] = {}

    def of(self, ordinal: int, batch: SequenceBatch) -> torch.Tensor:
        """``[B, count]`` int64 negatives of the ``ordinal``-th batch of this rank's pass."""
        kept = self.drawn.get(ordinal)
        if kept is None or kept[0] != batch.user_ids:
            kept = (list(batch.user_ids), batch_negatives(batch, self.num_items, self.count, self.seed).to(torch.int32))
            self.drawn[ordinal] = kept
        return kept[1].to(torch.int64)


def score_queries(model: SequentialRecommender, batch: SequenceBatch, use: Literal["valid", "test"] = "test",
                  item_table: torch.Tensor | None = None,
                  user_tables: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``[B, D]`` query embedding per sample: the encoder's output at its last position.

    ``"valid"`` encodes the history; ``"test"`` encodes the history followed by the validation
    item (leave-one-out: the test history includes it), whose rating is ``batch.valid_rating`` or
    unknown. Call under ``torch.no_grad()`` and ``eval()``. With ``item_table`` (the raw rows from
    ``model.all_item_embeddings(normalize=False)``) history items are read from it instead of the
    table, and with ``user_tables`` (``model.all_user_feature_tables()``) user features likewise: no
    collective, so ranks may score different counts.
    """
    if use not in ("valid", "test"):
        raise ValueError(f"use must be 'valid' or 'test', got {use!r}")
    lengths, item_ids, timestamps, ratings = batch.lengths, batch.item_ids, batch.timestamps, batch.ratings
    offsets = batch.offsets
    if use == "test":
        valid_rating = batch.valid_rating if batch.valid_rating is not None else torch.zeros_like(batch.valid_item)
        item_ids, new_offsets = jagged_concat_last(item_ids, offsets, batch.valid_item)
        timestamps, _ = jagged_concat_last(timestamps, offsets, batch.valid_timestamp)
        ratings, _ = jagged_concat_last(ratings, offsets, valid_rating)
        offsets, lengths = new_offsets, lengths + 1
    if bool((lengths == 0).any()):
        raise ValueError("score_queries needs every sample to have at least one position")
    if item_table is None:
        empty = torch.zeros(0, dtype=torch.int64, device=item_ids.device)
        item_embeddings, _ = model.lookup(lengths, item_ids, empty)
    else:
        item_embeddings = item_table[item_ids]
    user_vectors = model.user_vectors(model.lookup_users(batch.user_features, user_tables))
    hidden = model.encode_rows(item_embeddings, offsets, timestamps, ratings, user_vectors)
    return hidden[last_positions(offsets)]


def history_of(batch: SequenceBatch, use: Literal["valid", "test"]) -> ExcludeIds:
    """``(lengths, ids)`` of the history each sample's ``use`` target is ranked from: the test
    item's ends with the validation item."""
    if use == "test":
        ids, _ = jagged_concat_last(batch.item_ids, batch.offsets, batch.valid_item)
        return batch.lengths + 1, ids
    return batch.lengths, batch.item_ids


@torch.no_grad()
def evaluate_batch(model: SequentialRecommender, batch: SequenceBatch, all_item_embeddings: torch.Tensor,
                   use: Literal["valid", "test"] = "test", k: int = K, history: ExcludeIds | None = None,
                   item_table: torch.Tensor | None = None, user_tables: list[torch.Tensor] | None = None,
                   negative_ids: torch.Tensor | None = None) -> ProtocolMetrics:
    """HR@k / NDCG@k / MRR sums of ``batch``'s valid or test targets, per protocol, all from the
    same query embeddings.

    ``all_item_embeddings`` comes from ``model.all_item_embeddings()`` (computed once per
    evaluation, not per batch). ``full``: ranked against the whole catalog. ``unseen`` (only with
    ``history``, the query's own: ``history_of(batch, use)``): against the catalog less its items. ``sampled`` (only with ``negative_ids``, ``[B, N]`` from ``batch_negatives``):
    against each sample's own negatives.
    """
    query = score_queries(model, batch, use, item_table, user_tables)
    targets = batch.valid_item if use == "valid" else batch.test_item
    sampled = None if negative_ids is None else sampled_retrieval_metrics(query, all_item_embeddings, targets,
                                                                          negative_ids, k)
    if history is None:
        return ProtocolMetrics(retrieval_metrics(query, all_item_embeddings, targets, k=k), sampled)
    full, without_history = full_and_unseen_metrics(query, all_item_embeddings, targets, history, k)
    return ProtocolMetrics(full, sampled, without_history)


@torch.no_grad()
def evaluate(model: SequentialRecommender, manifest: Manifest, rank: int, world_size: int,
             device: torch.device, max_samples: int | None = None,
             evaluation: EvaluationConfig | None = None, seed: int = 0,
             uses: tuple[str, ...] = tuple(SPLIT_PREFIX), negatives: NegativeDraws | None = None,
             batch_samples: int = EVAL_BATCH_SAMPLES, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Score this rank's shard's ``uses`` targets (test and validation), then sum over ranks (a
    collective: all ranks call it; the sums are CPU tensors, summed through ``group``, one serving
    them: ``DistEnv.host_group``). The most-popular baseline comes with the test item.

    No rank holds the item table: each holds a 1/K slice (``catalog_slice.CatalogSlice``) and the
    ranks score in rounds, each rank's next batch per round (none once its shard is done): a
    round looks up the rows its queries read (a collective lookup), exchanges the queries, and
    each rank counts its slice's items above every query's target; the counts are summed. Under
    the mirror control every rank holds the same samples: rank r scores steps r, r+K, ...
    ``max_samples`` caps the samples scored per rank; the popularity counts still see the whole shard.
    ``seed`` (the training seed) seeds the sampled protocol's negatives; ``negatives`` keeps them
    from one evaluation to the next (a run's validations pass the same one). Consecutive batches
    are scored together, ``batch_samples`` samples at a time (0: the shards' batches).
    """
    evaluation = evaluation or EvaluationConfig()
    sampled, unseen = evaluation.sampled_negatives, evaluation.unseen_ranking
    model.eval()
    user_tables = model.all_user_feature_tables()
    ranks = _Ranks(CatalogSlice.of(model, rank, world_size, device), rank, world_size, group)
    tally = _Tally.empty(manifest.num_items, uses, sampled, unseen)
    if sampled and negatives is None:
        negatives = NegativeDraws(manifest.num_items, sampled, seed)
    batches = _scored_batches(manifest, rank, world_size, max_samples, tally.counts)
    for ordinal, batch in enumerate(_rounds(joined(batches, batch_samples), world_size, group)):
        drawn = negatives.of(ordinal, batch) if sampled and batch is not None else None
        tally.add(model, None if batch is None else batch.to(device), drawn, device, ranks, user_tables)
    model.train()
    result = _model_summary(tally.sums, uses, world_size, group)
    if "test" not in uses:
        return result
    result.update(_baseline_summary(tally, manifest.num_items, world_size, group))
    result["eval_samples"] = result.pop("count")
    return result


def _rounds(batches: Iterable[SequenceBatch], world_size: int,
            group: dist.ProcessGroup | None) -> Iterator[SequenceBatch | None]:
    """This rank's batches, then None, until no rank has a batch left (a collective per round)."""
    batches = iter(batches)
    while True:
        batch = next(batches, None)
        more = torch.tensor([0 if batch is None else 1])
        if world_size > 1:
            dist.all_reduce(more, op=dist.ReduceOp.MAX, group=group)
        if not int(more):
            return
        yield batch


@dataclass
class _Ranks:
    """Full-catalog ranks of one rank's queries among every rank's slice (``catalog_slice``)."""

    catalog: CatalogSlice
    rank: int
    world_size: int
    group: dist.ProcessGroup | None

    def of(self, query: torch.Tensor, targets: torch.Tensor,
           history: ExcludeIds | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's queries' ranks, and without their ``history`` (a collective: every rank's
        queries are gathered and ranked against every slice)."""
        mine = (query.cpu(), targets.cpu(), None if history is None else tuple(t.cpu() for t in history))
        parts = [mine]
        if self.world_size > 1:
            parts = [None] * self.world_size
            dist.all_gather_object(parts, mine, group=self.group)
        first = sum(part[1].numel() for part in parts[:self.rank])
        device = self.catalog.rows.device
        everyone = (torch.cat([part[0] for part in parts]).to(device), torch.cat([part[1] for part in parts]).to(device),
                    None if history is None else tuple(torch.cat([part[2][i] for part in parts]).to(device)
                                                       for i in range(2)))
        full, unseen = global_ranks(self.catalog, *everyone, self.group, self.world_size)
        last = first + targets.numel()
        return full[first:last], None if unseen is None else unseen[first:last]


def _metrics(ranks: torch.Tensor, k: int = K) -> RetrievalMetrics:
    """``metrics_from_ranks`` summed a query chunk at a time, as ``retrieval_metrics`` sums (the same bits)."""
    total = RetrievalMetrics(k=k)
    for start in range(0, ranks.numel(), QUERY_CHUNK):
        total = total + metrics_from_ranks(ranks[start:start + QUERY_CHUNK], k)
    return total


def _batch_queries(model: SequentialRecommender, batch: SequenceBatch | None, uses: tuple[str, ...],
                   drawn: torch.Tensor | None, device: torch.device,
                   user_tables: list[torch.Tensor] | None) -> dict[str, tuple[torch.Tensor, RetrievalMetrics | None]]:
    """Per use, ``batch``'s query embeddings and its sampled protocol's sums (with ``drawn``), from
    the rows its history, targets and negatives read, looked up once (a collective lookup: a rank
    with no batch looks up nothing and gets nothing)."""
    parts = [] if batch is None else [batch.item_ids, batch.valid_item, batch.test_item]
    parts += [] if drawn is None else [drawn.to(device).flatten()]
    ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    unique, local = torch.unique(ids, return_inverse=True)
    raw = item_rows(model, unique)
    if batch is None:
        return {}
    n, b = batch.item_ids.numel(), batch.batch_size
    renamed = replace(batch, item_ids=local[:n], valid_item=local[n:n + b])
    normalized = None if drawn is None else F.normalize(raw, dim=-1)
    out = {}
    for use in uses:
        query = score_queries(model, renamed, use, raw, user_tables)
        targets = local[n:n + b] if use == "valid" else local[n + b:n + 2 * b]
        out[use] = (query, None if drawn is None else
                    sampled_retrieval_metrics(query, normalized, targets, local[n + 2 * b:].view(b, -1), K))
    return out


def _scored_batches(manifest: Manifest, rank: int, world_size: int, max_samples: int | None,
                    counts: torch.Tensor) -> Iterator[SequenceBatch]:
    """This rank's batches to score (under the mirror control, steps ``rank``, ``rank + K``, ...;
    at most ``max_samples`` samples); every batch's histories count towards the baseline:
    added to ``counts``, item by item. A run on another world size than the shards' (a resume
    that re-planned) scores shards ``rank``, ``rank + K'``, ...: every user once."""
    mirror = manifest.control == "mirror"
    shards = (rank,) if mirror or world_size == manifest.world_size else range(rank, manifest.world_size, world_size)
    seen = 0
    for batch in (batch for shard in shards for batch in build_loader(manifest, shard, prefetch=0)):
        if batch.batch_size == 0 or (mirror and batch.step % world_size != rank):
            continue
        counts.add_(torch.bincount(batch.item_ids, minlength=counts.numel()).to(torch.float64))
        if max_samples is None or seen < max_samples:
            seen += batch.batch_size
            yield batch


@dataclass
class _Tally:
    """One rank's scoring pass, added up: the metric sums of each held-out item in ``uses``, and
    what the most-popular baseline needs: the item counts of every history (``counts``), the test
    targets, their histories (the unseen ranking's baseline leaves these out) and the sampled
    protocol's negatives."""

    uses: tuple[str, ...]
    sampled: int
    unseen: bool
    sums: dict[str, ProtocolMetrics]
    counts: torch.Tensor
    targets: list[torch.Tensor] = field(default_factory=list)
    drawn_rows: list[torch.Tensor] = field(default_factory=list)
    test_histories: list[ExcludeIds] = field(default_factory=list)

    @classmethod
    def empty(cls, num_items: int, uses: tuple[str, ...], sampled: int, unseen: bool) -> "_Tally":
        sums = {use: ProtocolMetrics(RetrievalMetrics(k=K), RetrievalMetrics(k=K) if sampled else None,
                                     RetrievalMetrics(k=K) if unseen else None) for use in uses}
        return cls(uses, sampled, unseen, sums, torch.zeros(num_items + 1, dtype=torch.float64))

    def add(self, model: SequentialRecommender, batch: SequenceBatch | None, drawn: torch.Tensor | None,
            device: torch.device, ranks: _Ranks, user_tables: list[torch.Tensor] | None) -> None:
        """Score ``batch`` (on ``device``; None: this rank has none this round, and takes part in
        the round's collectives) with its negatives ``drawn`` (None: no sampled protocol)."""
        queries = _batch_queries(model, batch, self.uses, drawn, device, user_tables)
        histories = {use: history_of(batch, use) for use in self.uses} if self.unseen and batch is not None else {}
        none = torch.zeros(0, dtype=torch.int64, device=device)  # this rank's part of a round it has no batch for
        for use in self.uses:  # one draw of negatives for both: none is either target
            query, sampled = queries.get(use, (torch.zeros(0, model.config.embedding_dim, device=device), None))
            targets = none if batch is None else (batch.valid_item if use == "valid" else batch.test_item)
            history = histories.get(use, (none, none) if self.unseen else None)
            full, unseen = ranks.of(query, targets, history)
            if batch is not None:
                self.sums[use] = self.sums[use] + ProtocolMetrics(
                    _metrics(full), sampled, None if unseen is None else _metrics(unseen))
        if batch is None:
            return
        self.targets.append(batch.test_item.cpu())
        if "test" in histories:
            self.test_histories.append(tuple(t.cpu() for t in histories["test"]))
        if drawn is not None:
            self.drawn_rows.append(drawn)


def _model_summary(sums: dict[str, ProtocolMetrics], uses: tuple[str, ...], world_size: int,
                   group: dist.ProcessGroup | None) -> dict[str, float]:
    """The model's means over every rank, per held-out item and protocol (a collective)."""
    result: dict[str, float] = {}
    for use in uses:
        prefix = SPLIT_PREFIX[use]
        result.update(_named(sums[use].full, world_size, prefix, group))
        if sums[use].sampled is not None:
            result.update(_named(sums[use].sampled, world_size, f"{prefix}sampled_", group))
        if sums[use].unseen is not None:
            result.update(_named(sums[use].unseen, world_size, f"{prefix}unseen_", group))
    return result


def _baseline_summary(tally: _Tally, num_items: int, world_size: int,
                      group: dist.ProcessGroup | None) -> dict[str, float]:
    """The most-popular baseline's means on the test targets, under each protocol the model was
    scored by (a collective)."""
    counts = tally.counts
    if world_size > 1:  # the baseline ranks items by their count over every rank's histories
        dist.all_reduce(counts, group=group)
    popular_ids = torch.zeros(0, dtype=torch.int64)  # the counts say it all
    all_targets = torch.cat(tally.targets) if tally.targets else torch.zeros(0, dtype=torch.int64)
    baseline = most_popular_baseline(popular_ids, num_items, all_targets, k=K, item_counts=counts)
    result = _named(baseline, world_size, "popular_", group)
    if tally.unseen:
        empty = torch.zeros(0, dtype=torch.int64)
        exclude = (torch.cat([lengths for lengths, _ in tally.test_histories] or [empty]),
                   torch.cat([ids for _, ids in tally.test_histories] or [empty]))
        baseline = most_popular_baseline(popular_ids, num_items, all_targets, k=K, exclude=exclude,
                                         item_counts=counts)
        result.update(_named(baseline, world_size, "popular_unseen_", group))
    if tally.sampled:
        all_negatives = (torch.cat(tally.drawn_rows) if tally.drawn_rows
                         else torch.zeros(0, tally.sampled, dtype=torch.int64))
        baseline = most_popular_baseline(popular_ids, num_items, all_targets, k=K,
                                         negative_ids=all_negatives, item_counts=counts)
        result.update(_named(baseline, world_size, "popular_sampled_", group))
    return result


def joined(batches: Iterable[SequenceBatch], samples: int) -> Iterator[SequenceBatch]:
    """Consecutive ``batches`` joined (``SequenceBatch.concat``) until each holds at least
    ``samples`` samples (the last may hold fewer); 0: each batch as it is."""
    pending: list[SequenceBatch] = []
    held = 0
    for batch in batches:
        pending.append(batch)
        held += batch.batch_size
        if held >= samples:
            yield SequenceBatch.concat(pending)
            pending, held = [], 0
    if pending:
        yield SequenceBatch.concat(pending)


def _named(metrics: RetrievalMetrics, world_size: int, prefix: str,
           group: dist.ProcessGroup | None) -> dict[str, float]:
    """The means over every rank's queries, under MLflow-safe names with ``prefix``."""
    sums = metrics.to_tensor()
    if world_size > 1:
        dist.all_reduce(sums, group=group)
    means = RetrievalMetrics.from_tensor(sums, k=K).means()
    if prefix:  # one count, the model's full-catalog one: every protocol scores the same queries
        means.pop("count")
    return {f"{prefix}{_name(name)}": value for name, value in means.items()}


def _name(metric: str) -> str:
    return metric.replace("@", "_at_")  # MLflow metric names allow no "@"
