"""The evaluation protocols: full-catalog ranking, and ranking against sampled negatives
(``[evaluation] sampled_negatives``, SASRec's protocol)."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from freescale.shards.manifest import load_manifest
from freescale.training.data.batch import SequenceBatch
from freescale.training.config import ConfigError, EvaluationConfig, HSTUConfig, ModelConfig
from freescale.training.eval import evaluator
from freescale.training.eval.evaluator import NegativeDraws, batch_negatives, check_protocol, evaluate
from freescale.training.eval.ranking_metrics import most_popular_baseline, sampled_retrieval_metrics, unseen_negatives
from freescale.training.model.recommender import build_local_model

METRICS = ("hr_at_10", "ndcg_at_10", "mrr")
pytestmark = pytest.mark.usefixtures("single_thread")  # one intra-op thread, as in the model tests


def history_batch(histories: list[list[int]], valid: list[int], test: list[int], users: list[str]) -> SequenceBatch:
    lengths = torch.tensor([len(h) for h in histories])
    total = int(lengths.sum())
    return SequenceBatch(
        lengths=lengths, item_ids=torch.tensor([i for h in histories for i in h]),
        timestamps=torch.arange(total), ratings=torch.zeros(total, dtype=torch.int64),
        valid_item=torch.tensor(valid), test_item=torch.tensor(test),
        valid_timestamp=torch.full((len(users),), total), test_timestamp=torch.full((len(users),), total + 1),
        user_ids=users)


def test_sampled_metrics_hand_worked() -> None:
    # Item i scores i against the query [1, 0]: ranks follow from the ids alone.
    table = torch.tensor([[0.0, 0.0]] + [[float(i), 0.0] for i in range(1, 8)])
    query = torch.tensor([[1.0, 0.0]] * 3)
    targets = torch.tensor([7, 3, 4])
    negatives = torch.tensor([[1, 2, 6], [1, 4, 5], [4, 1, 2]])  # target above all; below 2; tied with one
    result = sampled_retrieval_metrics(query, table, targets, negatives, k=2)
    # ranks 0, 2, 1 (a tie counts against the target): hits at k=2 for ranks 0 and 1
    assert result.count == 3 and result.hit_sum == 2
    assert result.ndcg_sum == pytest.approx(1.0 + 1.0 / math.log2(3))
    assert result.reciprocal_rank_sum == pytest.approx(1.0 + 1.0 / 3 + 1.0 / 2)
    at_10 = sampled_retrieval_metrics(query, table, targets, negatives, k=10)
    assert at_10.hit_sum == 3 and at_10.ndcg_sum == pytest.approx(1.0 + 0.5 + 1.0 / math.log2(3))


def test_popular_baseline_among_sampled_negatives() -> None:
    train = torch.tensor([5, 5, 5, 2, 2, 3])  # popularity 5 > 2 > 3 > 1 = 4 (ties by id)
    targets = torch.tensor([2, 4])
    negatives = torch.tensor([[5, 1, 3], [1, 3, 5]])
    result = most_popular_baseline(train, 5, targets, k=1, negative_ids=negatives)
    # target 2 is below 5 only (rank 1); target 4 is below 1, 3 and 5 (rank 3)
    assert result.hit_sum == 0 and result.reciprocal_rank_sum == pytest.approx(1 / 2 + 1 / 4)


def test_negatives_never_include_the_users_items() -> None:
    histories = [list(range(1, 21)), [3, 9, 9, 27], list(range(5, 40, 2))]
    batch = history_batch(histories, valid=[25, 4, 2], test=[26, 9, 1], users=["dense", "light", "odd"])
    negatives = batch_negatives(batch, num_items=40, count=15, seed=3)
    assert negatives.shape == (3, 15) and negatives.dtype == torch.int64
    for row, history, valid, test in zip(negatives.tolist(), histories, [25, 4, 2], [26, 9, 1]):
        assert len(set(row)) == 15 and all(1 <= i <= 40 for i in row)
        assert not set(row) & (set(history) | {valid, test})
    # 22 items used by "dense": 18 left, fewer than twice 15, so drawn from the exact pool
    assert set(negatives[0].tolist()) <= set(range(21, 41)) - {25, 26}
    with pytest.raises(ValueError, match="user dense interacted with 22 of 40 items"):
        batch_negatives(batch, num_items=40, count=19, seed=3)


def test_negatives_are_seeded_per_user_whatever_the_batch() -> None:
    alone = history_batch([[1, 2, 3]], [4], [5], ["u7"])
    mixed = history_batch([[8, 9, 10, 11], [1, 2, 3]], [12, 4], [13, 5], ["u2", "u7"])
    first = batch_negatives(alone, 500, 100, seed=0)[0]
    assert torch.equal(batch_negatives(mixed, 500, 100, seed=0)[1], first)
    assert not torch.equal(batch_negatives(alone, 500, 100, seed=1)[0], first)  # the training seed counts
    other_user = history_batch([[1, 2, 3]], [4], [5], ["u8"])
    assert not torch.equal(batch_negatives(other_user, 500, 100, seed=0)[0], first)
    lengths, ids = torch.tensor([5]), torch.tensor([1, 2, 3, 4, 5])
    assert torch.equal(unseen_negatives(["u7"], (lengths, ids), 500, 100, seed=0)[0], first)


def test_joined_batches_keep_every_sample_in_order() -> None:
    batches = [history_batch([[1, 2], [3]], [4, 5], [6, 7], ["a", "b"]), history_batch([[8]], [9], [10], ["c"]),
               history_batch([[11, 12, 13]], [14], [15], ["d"])]
    whole = list(evaluator.joined(batches, 3))
    assert [b.user_ids for b in whole] == [["a", "b", "c"], ["d"]]
    assert whole[0].item_ids.tolist() == [1, 2, 3, 8] and whole[0].lengths.tolist() == [2, 1, 1]
    assert whole[0].valid_item.tolist() == [4, 5, 9] and whole[0].test_timestamp.shape == (3,)
    assert [b.user_ids for b in evaluator.joined(batches, 0)] == [["a", "b"], ["c"], ["d"]]


def test_negative_draws_are_drawn_once_per_batch_and_redrawn_for_other_users(monkeypatch) -> None:
    draws = NegativeDraws(num_items=500, count=100, seed=0)
    first = history_batch([[1, 2, 3], [4, 5]], [6, 7], [8, 9], ["u1", "u2"])
    expected = batch_negatives(first, 500, 100, seed=0)
    calls = []
    monkeypatch.setattr(evaluator, "batch_negatives",
                        lambda *args: calls.append(args) or batch_negatives(*args))
    assert torch.equal(draws.of(0, first), expected) and draws.of(0, first).dtype == torch.int64
    assert len(calls) == 1  # the second pass over the same batch reused the draw
    other = history_batch([[1, 2, 3]], [6], [8], ["u3"])
    assert torch.equal(draws.of(0, other), batch_negatives(other, 500, 100, seed=0))
    assert len(calls) == 2 and draws.drawn[0][0] == ["u3"]


@pytest.mark.slow
def test_protocol_zero_keeps_the_full_catalog_summary(movielens_shards) -> None:
    """One rank's shard, in process: the full-catalog metrics do not depend on the protocol,
    sampled_* keys appear only with sampled negatives, and ranking against a sample is never
    harder than against the catalog (the sample is a subset of the catalog's other items)."""
    manifest = load_manifest(movielens_shards, 2, 0)
    torch.manual_seed(0)
    model = build_local_model(manifest.num_items, ModelConfig(hstu=HSTUConfig(num_layers=1)),
                              user_features=[(f.name, f.num_ids) for f in manifest.user_features])
    args = (model, manifest, 0, 1, torch.device("cpu"), 64)
    full = evaluate(*args, EvaluationConfig(sampled_negatives=0), seed=0)
    both = evaluate(*args, EvaluationConfig(sampled_negatives=100), seed=0)
    assert not [key for key in full if "sampled" in key]
    # Scored in the shards' batches of 64 instead of 512 at once: the same sums, in another order.
    for name, value in evaluate(*args, EvaluationConfig(sampled_negatives=100), seed=0, batch_samples=0).items():
        assert value == pytest.approx(both[name], rel=1e-12, abs=1e-12), name
    kept = NegativeDraws(manifest.num_items, 100, seed=0)  # as a run's validations share them
    assert evaluate(*args, EvaluationConfig(sampled_negatives=100), seed=0, negatives=kept) == both
    assert kept.drawn and evaluate(*args, EvaluationConfig(sampled_negatives=100), seed=0, negatives=kept) == both
    assert {key: both[key] for key in full} == full
    for name in METRICS:
        assert 0.0 <= both[f"sampled_{name}"] <= 1.0 and both[f"sampled_{name}"] >= full[name]
        assert both[f"popular_sampled_{name}"] >= full[f"popular_{name}"]
        # The validation item, scored from its own (one item shorter) history, by both protocols.
        assert 0.0 <= both[f"valid_{name}"] <= both[f"valid_sampled_{name}"] <= 1.0
    assert both["sampled_hr_at_10"] > both["hr_at_10"]  # an untrained model: ~10/101 vs ~10/1682
    assert both["valid_mrr"] != both["mrr"]  # another target, another query: not the test numbers again
    # The unseen ranking leaves the query's own history out of the catalog (no MovieLens user rates an
    # item twice, so no target is left out): beside the unchanged numbers, each rank can only improve,
    # the baseline's included.
    with_unseen = evaluate(*args, EvaluationConfig(sampled_negatives=100, unseen_ranking=True), seed=0)
    assert {key: with_unseen[key] for key in both} == both
    added = {f"{prefix}unseen_{name}" for prefix in ("", "valid_", "popular_") for name in METRICS}
    assert with_unseen.keys() - both.keys() == added
    for name in METRICS:
        for prefix in ("", "valid_", "popular_"):
            assert with_unseen[f"{prefix}unseen_{name}"] >= both[f"{prefix}{name}"], f"{prefix}{name}"
    assert with_unseen["popular_unseen_mrr"] > both["popular_mrr"] and with_unseen["unseen_mrr"] > both["mrr"]
    too_many = manifest.num_items - 2
    with pytest.raises(ConfigError, match=f"evaluation.sampled_negatives={too_many} is more than"):
        check_protocol(EvaluationConfig(sampled_negatives=too_many), manifest)
    check_protocol(EvaluationConfig(sampled_negatives=too_many - 1), manifest)


@pytest.mark.slow
def test_two_rank_run_reports_both_protocols(row_run) -> None:
    """The session's row-wise run evaluated every user with 100 sampled negatives too."""
    summary = row_run.log["summary"]
    assert summary["eval_samples"] == 943 - 943 % 32  # both ranks' users, once each
    for name in METRICS:
        for key in (f"sampled_{name}", f"popular_sampled_{name}", name, f"valid_{name}", f"valid_sampled_{name}"):
            assert 0.0 <= summary[key] <= 1.0, key
        assert summary[f"sampled_{name}"] >= summary[name]
        assert summary[f"valid_sampled_{name}"] >= summary[f"valid_{name}"]
    assert summary["sampled_hr_at_10"] > summary["hr_at_10"]


# ------------------------------------------------ the item table in slices: today's numbers, no gather


def _sliced_ranks(rows: torch.Tensor, query: torch.Tensor, targets: torch.Tensor, history, slices: int):
    """``global_ranks`` of ``slices`` ranks' slices, summed in one process as the ranks' all_reduce would."""
    from freescale.training.eval.catalog_slice import CatalogSlice, slice_bounds

    parts = [CatalogSlice(first, rows[first:last]) for first, last in
             (slice_bounds(rows.shape[0], r, slices) for r in range(slices))]
    scores = sum(part.target_scores(query, targets) for part in parts)
    counts = [part.counts(query, targets, scores, history) for part in parts]
    at_or_above = sum(c[0] for c in counts)
    seen = None if history is None else sum(c[1] for c in counts)
    return at_or_above - 1, None if seen is None else at_or_above - 1 - seen


@pytest.mark.parametrize("slices", [1, 2, 3, 7])
def test_slices_rank_as_the_whole_table_ties_included(slices: int, monkeypatch) -> None:
    """Integer-valued rows and queries: every score is exact, so ties are real ties, within a slice
    and across slices; chunks of 5 items and 4 queries put slice and chunk edges everywhere."""
    from freescale.training.eval import catalog_slice
    from freescale.training.eval.ranking_metrics import target_ranks

    monkeypatch.setattr(catalog_slice, "ITEM_CHUNK", 5)
    monkeypatch.setattr(catalog_slice, "QUERY_CHUNK", 4)
    generator = torch.Generator().manual_seed(slices)
    rows = torch.randint(-2, 3, (41, 3), generator=generator).float()
    rows[0] = 0.0
    query = torch.randint(-2, 3, (11, 3), generator=generator).float()
    targets = torch.randint(1, 41, (11,), generator=generator)
    lengths = torch.randint(0, 6, (11,), generator=generator)
    lengths[0] = 3
    ids = torch.randint(0, 41, (int(lengths.sum()),), generator=generator)
    ids[:2] = targets[0]  # a target listed in its own history, twice, is still ranked
    full, unseen = _sliced_ranks(rows, query, targets, (lengths, ids), slices)
    scores = query @ rows.t()
    assert torch.equal(full, target_ranks(scores, targets))
    assert torch.equal(unseen, target_ranks(scores, targets, (lengths, ids)))
    assert len(set(scores.flatten().tolist())) < scores.numel() // 4  # ties galore


def _old_rank_sums(model, manifest, rank: int, world_size: int, evaluation, uses, batch_samples: int):
    """c32ca2f's evaluation of one rank's shard, its sums: the whole table gathered (raw and
    normalised), every batch scored against it (``evaluate_batch``), the baseline from every
    history item listed (``popular_ids``)."""
    import torch.nn.functional as F

    from freescale.training.eval.evaluator import evaluate_batch, history_of, joined
    from freescale.training.eval.ranking_metrics import ProtocolMetrics, RetrievalMetrics

    sampled, unseen = evaluation.sampled_negatives, evaluation.unseen_ranking
    model.eval()
    raw = model.all_item_embeddings(normalize=False)
    table, user_tables = F.normalize(raw, dim=-1), model.all_user_feature_tables()
    sums = {use: ProtocolMetrics(RetrievalMetrics(), RetrievalMetrics() if sampled else None,
                                 RetrievalMetrics() if unseen else None) for use in uses}
    counts = torch.zeros(manifest.num_items + 1, dtype=torch.float64)
    draws = NegativeDraws(manifest.num_items, sampled, 0)
    targets, histories, drawn_rows = [], [], []
    batches = evaluator._scored_batches(manifest, rank, world_size, None, counts)
    for ordinal, batch in enumerate(joined(batches, batch_samples)):
        drawn = draws.of(ordinal, batch) if sampled else None
        for use in uses:
            sums[use] = sums[use] + evaluate_batch(model, batch, table, use=use, item_table=raw, user_tables=user_tables,
                                                   history=history_of(batch, use) if unseen else None,
                                                   negative_ids=drawn)
        targets.append(batch.test_item)
        histories.append(history_of(batch, "test"))
        drawn_rows.append(drawn)
    model.train()
    return sums, counts, targets, histories, drawn_rows


def _old_evaluate(model, manifest, world_size: int, evaluation, uses=("test", "valid"), batch_samples: int = 512):
    """c32ca2f's ``evaluate`` on ``world_size`` ranks, in one process: each rank's sums, added in rank
    order as its all_reduce adds them, then named as the evaluator names them."""
    per_rank = [_old_rank_sums(model, manifest, r, world_size, evaluation, uses, batch_samples)
                for r in range(world_size)]
    sums = {use: functools.reduce(lambda a, b: a + b, (p[0][use] for p in per_rank)) for use in uses}
    result = evaluator._model_summary(sums, uses, 1, None)
    popular_ids = torch.repeat_interleave(torch.arange(manifest.num_items + 1),
                                          sum(p[1] for p in per_rank).to(torch.int64))
    protocols = {"popular_": {}}
    if evaluation.unseen_ranking:
        protocols["popular_unseen_"] = {"exclude": "histories"}
    if evaluation.sampled_negatives:
        protocols["popular_sampled_"] = {"negative_ids": "drawn"}
    for prefix, kind in protocols.items():
        total = None
        for _, _, targets, histories, drawn_rows in per_rank:
            extra = {}
            if kind.get("exclude"):
                extra["exclude"] = (torch.cat([h[0] for h in histories]), torch.cat([h[1] for h in histories]))
            if kind.get("negative_ids"):
                extra["negative_ids"] = torch.cat(drawn_rows)
            part = most_popular_baseline(popular_ids, manifest.num_items, torch.cat(targets), k=10, **extra)
            total = part if total is None else total + part
        result.update(evaluator._named(total, 1, prefix, None))
    result["eval_samples"] = result.pop("count")
    return result


EVALUATION = EvaluationConfig(sampled_negatives=5, unseen_ranking=True)


def _small_model(num_items: int, user_features=()):
    torch.manual_seed(0)
    return build_local_model(num_items, ModelConfig(embedding_dim=16, hstu=HSTUConfig(num_layers=1)),
                             user_features=list(user_features))


def test_sliced_evaluation_equals_the_gathered_one_on_one_rank(tmp_path) -> None:
    """Every number of today's evaluation, to the bit: the model's under all three protocols and
    the baseline's, with user features, in joined batches and in the shards' own."""
    from tests.helpers import write_shards

    shards = write_shards(tmp_path / "shards", num_steps=5, num_items=60, user_features=[("age", 7)])
    manifest = load_manifest(shards)
    model = _small_model(manifest.num_items, [(f.name, f.num_ids) for f in manifest.user_features])
    for batch_samples in (512, 0):
        new = evaluate(model, manifest, 0, 1, torch.device("cpu"), evaluation=EVALUATION, batch_samples=batch_samples)
        assert new == _old_evaluate(model, manifest, 1, EVALUATION, batch_samples=batch_samples)
        assert new["eval_samples"] > 0 and new["unseen_mrr"] >= new["mrr"]


def _two_rank_evaluation(rank: int, folder: str, shards: str) -> None:
    import json
    import os
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    root = Path(folder)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 2), rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))
        manifest = load_manifest(shards, 2, rank)
        result = evaluate(_small_model(manifest.num_items), manifest, rank, 2, torch.device("cpu"),
                          evaluation=EVALUATION, batch_samples=0, group=dist.group.WORLD)
        (root / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        import traceback

        (root / f"rank{rank}.json").write_text(json.dumps({"error": traceback.format_exc()}))


@pytest.mark.spawns
def test_sliced_evaluation_equals_the_gathered_one_on_two_ranks(tmp_path) -> None:
    """2 gloo ranks, each holding half the table, the second with fewer batches than the first (it
    sits out the last rounds): every number equals today's 2-rank evaluation, on both ranks."""
    import json

    import torch.multiprocessing as mp

    from tests.helpers import write_shards

    shards = write_shards(tmp_path / "shards", num_steps=6, num_items=61, empty_steps={1: {3, 4, 5}})
    manifest = load_manifest(shards)
    mp.spawn(_two_rank_evaluation, args=(str(tmp_path), str(shards)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert "error" not in results[0], results[0].get("error")
    assert "error" not in results[1], results[1].get("error")
    expected = _old_evaluate(_small_model(manifest.num_items), manifest, 2, EVALUATION, batch_samples=0)
    assert results[0] == results[1] == expected


def test_the_baselines_ranks_are_the_score_matrixs_without_it() -> None:
    """c32ca2f ranked the baseline through a [queries, items] matrix of the shared scores: the same
    ranks, history excluded or not (an id twice, the target itself and padding in it)."""
    from freescale.training.eval.ranking_metrics import _shared_ranking_ranks, popularity_scores, target_ranks

    generator = torch.Generator().manual_seed(3)
    scores = popularity_scores(torch.randint(1, 30, (200,), generator=generator), 50)
    targets = torch.randint(1, 51, (40,), generator=generator)
    lengths = torch.randint(0, 8, (40,), generator=generator)
    lengths[0] = 3
    ids = torch.randint(0, 51, (int(lengths.sum()),), generator=generator)
    ids[:3] = torch.tensor([targets[0], 0, int(targets[0]) % 50 + 1])
    matrix = scores.unsqueeze(0).expand(40, -1)
    assert torch.equal(_shared_ranking_ranks(scores, targets, None), target_ranks(matrix, targets))
    assert torch.equal(_shared_ranking_ranks(scores, targets, (lengths, ids)), target_ranks(matrix, targets, (lengths, ids)))
