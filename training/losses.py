"""Training losses for next-item retrieval."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
