"""The evaluation protocols: full-catalog ranking, and ranking against sampled negatives
(``[evaluation] sampled_negatives``, SASRec's protocol)."""
from __future__ import annotations

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
