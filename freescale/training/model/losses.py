"""Training losses for next-item retrieval: the loss functions, and one head per ``loss.kind``.

A head is what the model's forward needs of a loss kind (``LossHead``): how many uniform
negatives a forward draws, and the loss of the encoder's outputs at the query positions against
their targets and those negatives. ``LOSSES`` maps ``loss.kind`` to its head; either encoder trains
with either head. Every score is a cosine similarity (queries and item rows L2-normalised) divided
by ``model.temperature``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from freescale.training.config import LossKind, ModelConfig, keyed_by


def sampled_softmax_loss(
    query: torch.Tensor,
    positive: torch.Tensor,
    negatives: torch.Tensor,
    positive_ids: torch.Tensor,
    negative_ids: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Softmax over each query's positive and a negative set shared by all queries.

    Args:
        query: ``[N, D]`` query embeddings.
        positive: ``[N, D]`` embedding of each query's target item.
        negatives: ``[M, D]`` negative item embeddings, shared by every query
            (uniformly sampled ids, in-batch targets, or the whole catalog).
        positive_ids: ``[N]`` item id of each target.
        negative_ids: ``[M]`` item id of each negative.
        temperature: logits are dot products divided by this.

    A negative whose id equals the query's target (an "accidental hit") is
    removed from that query's softmax; otherwise the model would be pushed away
    from the very item it should score highest. With the whole catalog as
    negatives this makes the loss exactly the full softmax.

    Returns ``(mean loss, stats)``; stats are detached scalars.
    """
    if query.shape[0] == 0:
        # Keep the graph so backward() still works on a batch without targets.
        zero = query.sum() * 0.0
        return zero, {"accidental_hits": zero.detach(), "positive_logit": zero.detach()}
    positive_logits = (query * positive).sum(dim=-1, keepdim=True) / temperature  # [N, 1]
    negative_logits = query @ negatives.t() / temperature  # [N, M]
    accidental = positive_ids.unsqueeze(1) == negative_ids.unsqueeze(0)
    negative_logits = negative_logits.masked_fill(accidental, float("-inf"))
    logits = torch.cat([positive_logits, negative_logits], dim=1)
    # The positive is column 0; -inf columns add exp(-inf) = 0 to the partition.
    target = torch.zeros(query.shape[0], dtype=torch.int64, device=query.device)
    loss = F.cross_entropy(logits, target)
    stats = {
        "accidental_hits": accidental.sum().detach().to(torch.float32),
        "positive_logit": positive_logits.mean().detach(),
    }
    return loss, stats


def binary_cross_entropy_loss(
    query: torch.Tensor,
    positive: torch.Tensor,
    negative: torch.Tensor,
    positive_ids: torch.Tensor,
    negative_ids: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SASRec's loss: each query's target against one negative of its own, as two binary labels.

    Args:
        query: ``[N, D]`` query embeddings.
        positive: ``[N, D]`` embedding of each query's target item.
        negative: ``[N, D]`` embedding of each query's own negative item.
        positive_ids: ``[N]`` item id of each target.
        negative_ids: ``[N]`` item id of each query's negative.
        temperature: logits are dot products divided by this.

    Per query ``-log sigmoid(s+) - log(1 - sigmoid(s-))`` (Kang & McAuley 2018, eq. 4),
    with ``s = <query, item> / temperature``. A negative whose id equals the query's target
    (an accidental hit, probability ``1 / num_items`` under uniform draws) is masked, not
    re-drawn: that query keeps its positive term alone, so the draw stays a function of
    the step and the count of positions, never of the batch's ids.

    Returns ``(mean over the N queries, stats)``, the same normalisation as
    ``sampled_softmax_loss``; stats are detached scalars.
    """
    if query.shape[0] == 0:
        zero = query.sum() * 0.0
        return zero, {"accidental_hits": zero.detach(), "positive_logit": zero.detach()}
    positive_logits = (query * positive).sum(dim=-1) / temperature  # [N]
    negative_logits = (query * negative).sum(dim=-1) / temperature  # [N]
    accidental = positive_ids == negative_ids
    # -log sigmoid(s) = softplus(-s); -log(1 - sigmoid(s)) = softplus(s): stable for large |s|.
    per_query = F.softplus(-positive_logits) + F.softplus(negative_logits).masked_fill(accidental, 0.0)
    stats = {
        "accidental_hits": accidental.sum().detach().to(torch.float32),
        "positive_logit": positive_logits.mean().detach(),
    }
    return per_query.mean(), stats


class LossHead(Protocol):
    """One ``loss.kind`` as the model's forward runs it."""

    @staticmethod
    def negative_count(num_negatives: int, num_tokens: int) -> int:
        """Uniform negatives one forward draws, from ``loss.num_negatives`` and the batch's positions
        ``T``. Per sample, so a rank's work stays the sum of its samples' (the balancer's cost model)."""
        ...

    def prepare(self, target_ids: torch.Tensor, generator: torch.Generator | None) -> object:
        """What the head draws from the targets alone, before the encoder runs, handed back to the
        call: a size that depends on the data (``unique``) makes a GPU step wait for its queued work,
        which before the encoder is the lookups, after it the whole forward. ``generator``: its draws'."""
        ...

    def __call__(self, hidden: torch.Tensor, query_rows: torch.Tensor, positive: torch.Tensor,
                 target_ids: torch.Tensor, negatives: torch.Tensor, negative_ids: torch.Tensor,
                 prepared: object) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        """``(mean loss over the targets, negatives per query, stats)``.

        ``hidden`` ``[T, D]`` the encoder's L2-normalised outputs; ``query_rows`` ``[N]`` the rows
        that predict a next item, ``positive`` ``[N, D]`` their targets' normalised rows and
        ``target_ids`` ``[N]`` their ids; ``negatives`` ``[M, D]`` the rows (not normalised) of the
        ``negative_count`` uniform ids ``negative_ids`` ``[M]``; ``prepared`` what ``prepare`` gave.
        Stats are detached scalars."""
        ...


@dataclass(frozen=True)
class SampledSoftmax:
    """Each query's target against negatives shared by every query: the uniform ids, plus (with
    ``in_batch``) the batch's unique targets, at most ``max_in_batch`` of them (0 = all). With the
    whole catalog as the uniform ids (``loss.full_softmax``) and no in-batch negatives this is the
    exact full softmax."""

    temperature: float
    in_batch: bool
    max_in_batch: int

    @classmethod
    def from_config(cls, model: ModelConfig, full_softmax: bool) -> "SampledSoftmax":
        return cls(model.temperature, model.in_batch_negatives and not full_softmax, model.max_in_batch_negatives)

    @staticmethod
    def negative_count(num_negatives: int, num_tokens: int) -> int:
        return num_negatives

    def prepare(self, target_ids: torch.Tensor,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The in-batch negatives: their ids and, for each, one of its target rows (None without)."""
        if not self.in_batch:
            return None
        # Unique, so a popular item is not counted several times in each partition function.
        unique_ids, first = _unique_with_first_index(target_ids)
        if self.max_in_batch and unique_ids.numel() > self.max_in_batch:
            keep = torch.randperm(unique_ids.numel(), generator=generator)[:self.max_in_batch].to(target_ids.device)
            unique_ids, first = unique_ids[keep], first[keep]
        return unique_ids, first

    def __call__(self, hidden: torch.Tensor, query_rows: torch.Tensor, positive: torch.Tensor,
                 target_ids: torch.Tensor, negatives: torch.Tensor, negative_ids: torch.Tensor,
                 prepared: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        negatives = F.normalize(negatives, dim=-1)
        if prepared is not None:
            unique_ids, first = prepared
            negatives = torch.cat([negatives, positive[first]])
            negative_ids = torch.cat([negative_ids, unique_ids])
        loss, stats = sampled_softmax_loss(hidden[query_rows], positive, negatives, target_ids, negative_ids,
                                           self.temperature)
        return loss, negative_ids.numel(), stats


@dataclass(frozen=True)
class BinaryCrossEntropy:
    """SASRec's loss: each query's target against one uniform negative of its own, the negative
    drawn for its row (``negative_ids[r]`` for row ``r``; a sample's last row has no target and its
    negative goes unused)."""

    temperature: float

    @classmethod
    def from_config(cls, model: ModelConfig, full_softmax: bool) -> "BinaryCrossEntropy":
        if full_softmax:
            raise ValueError("full_softmax applies to the sampled softmax, not to loss kind 'bce'")
        return cls(model.temperature)

    @staticmethod
    def negative_count(num_negatives: int, num_tokens: int) -> int:
        return num_tokens

    def prepare(self, target_ids: torch.Tensor, generator: torch.Generator | None) -> None:
        """Nothing: each query's negative is its row's uniform one."""
        return None

    def __call__(self, hidden: torch.Tensor, query_rows: torch.Tensor, positive: torch.Tensor,
                 target_ids: torch.Tensor, negatives: torch.Tensor, negative_ids: torch.Tensor,
                 prepared: None) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        if negative_ids.numel() != hidden.shape[0]:
            raise ValueError(f"loss kind 'bce' takes one negative per position: got {negative_ids.numel()} "
                             f"negatives for {hidden.shape[0]} positions")
        negatives = F.normalize(negatives[query_rows], dim=-1)
        loss, stats = binary_cross_entropy_loss(hidden[query_rows], positive, negatives, target_ids,
                                                negative_ids[query_rows], self.temperature)
        return loss, query_rows.numel(), stats


# loss.kind -> its head.
LOSSES = keyed_by(LossKind, {"sampled_softmax": SampledSoftmax, "bce": BinaryCrossEntropy})


def _unique_with_first_index(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids and, for each, the index of one occurrence in ``ids``."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    positions = torch.arange(ids.numel(), device=ids.device)
    first = torch.full_like(unique, ids.numel()).scatter_reduce(0, inverse, positions, reduce="amin")
    return unique, first
