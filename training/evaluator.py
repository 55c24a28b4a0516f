"""End-of-run evaluation: HR@10, NDCG@10 and MRR on the leave-one-out test targets, against
the most-popular baseline, over the whole catalog and all ranks' samples."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shards.manifest import Manifest
from training.metrics import RetrievalMetrics, most_popular_baseline
from training.model import SequentialRecommender
from training.shard_reader import build_loader

K = 10


@torch.no_grad()
def evaluate(model: SequentialRecommender, manifest: Manifest, rank: int, world_size: int,
             device: torch.device, max_samples: int | None = None) -> dict[str, float]:
    """Score this rank's shard's test targets, then sum over ranks (a collective: all ranks call it).

    The whole item table is gathered once (a collective lookup); scoring then reads it
    locally, so ranks may hold different numbers of samples. Under the mirror control
    every rank holds the same samples: rank r scores steps r, r+K, ... ``max_samples``
    caps the samples scored per rank; the popularity counts still see the whole shard.
    """
    model.eval()
    raw = model.all_item_embeddings(normalize=False)
    user_tables = model.all_user_feature_tables()
    table = F.normalize(raw, dim=-1)
    mirror = manifest.control == "mirror"
    model_sums = RetrievalMetrics(k=K)
    counts = torch.zeros(manifest.num_items + 1, dtype=torch.float64)
    targets: list[torch.Tensor] = []
    seen = 0
    for batch in build_loader(manifest, rank, prefetch=0):
        if batch.batch_size == 0 or (mirror and batch.step % world_size != rank):
            continue
        counts += torch.bincount(batch.item_ids, minlength=counts.numel()).to(torch.float64)
        if max_samples is not None and seen >= max_samples:
            continue
        batch = batch.to(device)
        model_sums = model_sums + model.evaluate(batch, table, use="test", item_table=raw, user_tables=user_tables)
        targets.append(batch.test_item.cpu())
        seen += batch.batch_size
    model.train()
    result = {_name(name): value for name, value in _summed(model_sums, world_size).items()}
    if world_size > 1:  # the baseline ranks items by their count over every rank's histories
        dist.all_reduce(counts)
    popular_ids = torch.repeat_interleave(torch.arange(counts.numel()), counts.to(torch.int64))
    baseline = most_popular_baseline(popular_ids, manifest.num_items,
                                     torch.cat(targets) if targets else torch.zeros(0, dtype=torch.int64))
    for name, value in _summed(baseline, world_size).items():
        if name != "count":
            result[f"popular_{_name(name)}"] = value
    result["eval_samples"] = result.pop("count")
    return result


def _summed(metrics: RetrievalMetrics, world_size: int) -> dict[str, float]:
    sums = metrics.to_tensor()
    if world_size > 1:
        dist.all_reduce(sums)
    return RetrievalMetrics.from_tensor(sums, k=K).means()


def _name(metric: str) -> str:
    return metric.replace("@", "_at_")  # MLflow metric names allow no "@"
