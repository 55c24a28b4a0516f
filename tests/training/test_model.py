"""Tests for the HSTU encoder, the sequential recommender, its loss and its metrics.

All single-process on CPU: the item table is built on CPU with
``build_local_model`` (no DistributedModelParallel).
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from freescale.training.config import HSTUConfig, ModelConfig
from freescale.training.model.hstu import GroupedAttentionPlan, HSTUEncoder, HSTULayer, log_bucket
from freescale.training.ops.jagged import (
    GroupedPlan,
    check_jagged,
    group_by_length,
    jagged_concat_last,
    next_item_positions,
    offsets_from_lengths,
)
from freescale.training.eval.evaluator import evaluate_batch, history_of, score_queries
from freescale.training.model.losses import sampled_softmax_loss
from freescale.training.eval.ranking_metrics import (
    RetrievalMetrics,
    full_and_unseen_metrics,
    metrics_from_ranks,
    most_popular_baseline,
    ranks_without,
    retrieval_metrics,
    target_ranks,
)
from freescale.training.model.recommender import (
    FEATURE_KEYS,
    ITEM_TABLE,
    SequenceBatch,
    TableLookup,
    build_local_model,
    build_model,
)

NUM_ITEMS = 40
WIDTH = 16  # the model's embedding_dim in these tests
SMALL = HSTUConfig(
    num_layers=2, num_heads=2, attention_dim=8, linear_dim=8, dropout=0.0, max_seq_len=64
)


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one intra-op thread


USER_FEATURES = [("age", 5), ("gender", 3), ("zip", 11)]


def random_batch(lengths: list[int], num_items: int = NUM_ITEMS, seed: int = 0,
                 user_features: list[tuple[str, int]] | None = None) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    total = int(lengths_t.sum())
    batch_size = len(lengths)
    gaps = torch.randint(1, 100_000, (total,), generator=g)
    return SequenceBatch(
        lengths=lengths_t,
        item_ids=torch.randint(1, num_items + 1, (total,), generator=g),
        timestamps=1_000_000_000 + torch.cumsum(gaps, 0),
        ratings=torch.randint(0, 6, (total,), generator=g),
        valid_item=torch.randint(1, num_items + 1, (batch_size,), generator=g),
        test_item=torch.randint(1, num_items + 1, (batch_size,), generator=g),
        valid_timestamp=torch.full((batch_size,), 2_000_000_000),
        test_timestamp=torch.full((batch_size,), 2_000_000_100),
        user_ids=[f"u{i}" for i in range(batch_size)],
        step=0,
        user_features=(torch.stack([torch.randint(0, size, (batch_size,), generator=g) for _, size in user_features],
                                   dim=1) if user_features else None),
    )


def encoder_inputs(lengths: list[int], dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(torch.tensor(lengths))
    total = int(offsets[-1])
    values = torch.randn(total, dim, generator=g)
    timestamps = torch.cumsum(torch.randint(1, 10_000, (total,), generator=g), 0)
    return values, offsets, timestamps


def small_model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_local_model(NUM_ITEMS, ModelConfig(embedding_dim=WIDTH, hstu=SMALL, **overrides))


# ---------------------------------------------------------------- jagged utils


def test_next_item_positions_skip_last_row_of_each_sample() -> None:
    offsets = offsets_from_lengths(torch.tensor([3, 1, 0, 2]))
    queries, targets = next_item_positions(offsets)
    assert queries.tolist() == [0, 1, 4]
    assert targets.tolist() == [1, 2, 5]
    assert next_item_positions(offsets, num_targets=3)[0].tolist() == [0, 1, 4]  # the host's count
    assert next_item_positions(offsets_from_lengths(torch.tensor([], dtype=torch.int64)))[0].numel() == 0


def test_next_item_positions_are_every_row_but_each_samples_last() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        lengths = torch.randint(0, 6, (int(torch.randint(1, 12, (1,), generator=generator)),), generator=generator)
        offsets = offsets_from_lengths(lengths)
        last = {int(offsets[i + 1]) - 1 for i in range(len(lengths)) if lengths[i] > 0}
        expected = [r for r in range(int(offsets[-1])) if r not in last]
        batch_count = int((lengths - 1).clamp(min=0).sum())
        assert next_item_positions(offsets)[0].tolist() == expected
        assert next_item_positions(offsets, batch_count)[0].tolist() == expected


def test_group_by_length_covers_every_row_once_without_padding() -> None:
    offsets = offsets_from_lengths(torch.tensor([4, 2, 0, 4, 1]))
    groups = group_by_length(offsets)
    assert sorted((g.length, g.rows.shape[0]) for g in groups) == [(1, 1), (2, 1), (4, 2)]
    rows = torch.cat([g.rows.flatten() for g in groups])
    assert sorted(rows.tolist()) == list(range(11))


def test_grouped_plan_makes_each_length_group_one_slice_and_leaves_as_it_entered() -> None:
    lengths = [4, 2, 0, 4, 1]
    offsets = offsets_from_lengths(torch.tensor(lengths))
    values = torch.arange(11.0).unsqueeze(1)  # row r holds r
    plan = GroupedPlan.build(offsets)
    pieces = plan.split(plan.enter(values))
    assert [p.shape[0] for p in pieces] == plan.sizes and sum(plan.sizes) == 11
    for group, piece in zip(plan.groups, pieces):  # a group's slice is its samples' rows, in order
        assert piece.view(group.rows.shape).tolist() == group.rows.float().tolist()
    assert torch.equal(plan.leave(plan.enter(values)), values)
    empty = GroupedPlan.build(offsets_from_lengths(torch.tensor([0, 0])))
    assert empty.groups == [] and empty.order.numel() == 0 and empty.split(torch.zeros(0, 3)) == ()


def test_jagged_concat_last_appends_one_row_per_sample() -> None:
    offsets = offsets_from_lengths(torch.tensor([2, 1]))
    values, new_offsets = jagged_concat_last(torch.tensor([10, 11, 20]), offsets, torch.tensor([12, 21]))
    assert values.tolist() == [10, 11, 12, 20, 21]
    assert new_offsets.tolist() == [0, 3, 5]


def test_log_bucket_is_monotone_and_bounded() -> None:
    distances = torch.arange(0, 5000)
    buckets = log_bucket(distances, 64, 1024)
    assert buckets[0] == 0 and buckets[1] > 0
    assert bool((buckets[1:] >= buckets[:-1]).all())
    assert int(buckets.max()) == 63
    # Small distances, which matter most, stay in distinct buckets.
    assert len(set(buckets[:6].tolist())) == 6


# -------------------------------------------------------------------- encoder


def test_encoder_output_shape_and_unit_norm() -> None:
    torch.manual_seed(0)
    encoder = HSTUEncoder(SMALL, WIDTH).eval()
    values, offsets, timestamps = encoder_inputs([5, 1, 7], WIDTH)
    out = encoder(values, offsets, timestamps)
    assert out.shape == values.shape
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(13))


def test_encoder_rejects_mismatched_jagged_shapes() -> None:
    encoder = HSTUEncoder(SMALL, WIDTH)
    values, offsets, timestamps = encoder_inputs([3, 2], WIDTH)
    with pytest.raises(ValueError, match="jagged shapes"):
        encoder(values[:-1], offsets, timestamps[:-1])


def test_jagged_check_reads_offsets_only_on_the_host() -> None:
    """On a GPU, reading offsets[-1] would wait for the GPU once per forward; a device tensor
    (meta here, which cannot be read at all) is left unread, the other lengths still checked."""
    values, offsets, timestamps = encoder_inputs([3, 2], WIDTH)
    check_jagged(values, offsets.to("meta"), timestamps)
    with pytest.raises(ValueError, match="not read on meta"):
        check_jagged(values, offsets.to("meta"), timestamps[:-1])


@pytest.mark.parametrize("block_size", [128, 4])
def test_jagged_batch_equals_each_sample_alone(block_size: int) -> None:
    """No padding leakage: a sample's outputs do not depend on its batch-mates."""
    torch.manual_seed(0)
    encoder = HSTUEncoder(HSTUConfig(**{**SMALL.__dict__, "attention_block_size": block_size}), WIDTH).eval()
    lengths = [5, 1, 9, 5, 12, 3]  # a repeated length exercises the grouped path
    values, offsets, timestamps = encoder_inputs(lengths, WIDTH)
    with torch.no_grad():
        batched = encoder(values, offsets, timestamps)
        for i, length in enumerate(lengths):
            rows = slice(int(offsets[i]), int(offsets[i + 1]))
            alone = encoder(values[rows], torch.tensor([0, length]), timestamps[rows])
            torch.testing.assert_close(batched[rows], alone, rtol=1e-5, atol=1e-5)


def reference_hstu_layer(layer: HSTULayer, x: torch.Tensor, t: torch.Tensor, config: HSTUConfig) -> torch.Tensor:
    """The paper's formula for one sample, written densely and independently of the jagged code
    (with ``attention_activation = "softmax"``, a Transformer's weights over the same scores)."""
    n, heads = x.shape[0], config.num_heads
    dq, dv = config.attention_dim, config.linear_dim
    projected = F.silu(layer.uvqk(layer.input_norm(x)))
    u, v, q, k = torch.split(projected, [heads * dv, heads * dv, heads * dq, heads * dq], dim=-1)
    outputs = []
    for h in range(heads):
        qh, kh, vh = q[:, h * dq:(h + 1) * dq], k[:, h * dq:(h + 1) * dq], v[:, h * dv:(h + 1) * dv]
        softmax = config.attention_activation == "softmax"
        attention = torch.full((n, n), -math.inf) if softmax else torch.zeros(n, n)
        for i in range(n):
            for j in range(i + 1):
                position_bucket = log_bucket(torch.tensor(i - j), config.num_position_buckets, config.max_seq_len)
                time_bucket = log_bucket((t[i] - t[j]).abs(), config.num_time_buckets, config.max_time_gap_seconds)
                bias = (layer.relative_bias.position_bias.weight[position_bucket, h]
                        + layer.relative_bias.time_bias.weight[time_bucket, h])
                attention[i, j] = qh[i] @ kh[j] / math.sqrt(dq) + bias if softmax else F.silu(qh[i] @ kh[j] + bias) / n
        outputs.append((attention.softmax(dim=-1) if softmax else attention) @ vh)
    attended = torch.cat(outputs, dim=-1)
    return x + layer.output(layer.attention_norm(attended) * u)


@pytest.mark.parametrize("activation", ["silu", "softmax"])
@pytest.mark.parametrize("block_size", [128, 4])  # 4: the 6-long sample spans two row blocks
def test_layer_matches_dense_reference_formula(block_size: int, activation: str) -> None:
    config = HSTUConfig(**{**SMALL.__dict__, "attention_block_size": block_size, "attention_activation": activation})
    torch.manual_seed(0)
    layer = HSTULayer(config, WIDTH).eval()
    with torch.no_grad():
        # Make the relative bias large enough that a wrong bucket would show.
        layer.relative_bias.position_bias.weight.normal_(std=1.0)
        layer.relative_bias.time_bias.weight.normal_(std=1.0)
    lengths = [6, 3]
    values, offsets, timestamps = encoder_inputs(lengths, WIDTH)
    with torch.no_grad():
        plan = GroupedAttentionPlan.build(offsets, timestamps, config)
        out = plan.leave(layer(plan.enter(values), plan))
        for i in range(len(lengths)):
            rows = slice(int(offsets[i]), int(offsets[i + 1]))
            expected = reference_hstu_layer(layer, values[rows], timestamps[rows], config)
            torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)


def test_encoder_is_causal() -> None:
    """Changing positions after t (items, times) leaves outputs at <= t unchanged."""
    torch.manual_seed(0)
    encoder = HSTUEncoder(SMALL, WIDTH).eval()
    values, offsets, timestamps = encoder_inputs([10, 6], WIDTH)
    changed_values, changed_times = values.clone(), timestamps.clone()
    cut = 6  # first sample: positions 0..5 kept, 6..9 changed
    changed_values[cut:10] = torch.randn(10 - cut, WIDTH)
    changed_times[cut:10] += 12345
    with torch.no_grad():
        before = encoder(values, offsets, timestamps)
        after = encoder(changed_values, offsets, changed_times)
    torch.testing.assert_close(before[:cut], after[:cut])
    assert not torch.allclose(before[cut:10], after[cut:10])
    torch.testing.assert_close(before[10:], after[10:])  # the other sample is untouched


def test_model_is_causal_in_item_ids_and_ratings() -> None:
    model = small_model().eval()
    batch = random_batch([8, 3])
    changed = random_batch([8, 3])
    changed.item_ids, changed.ratings = batch.item_ids.clone(), batch.ratings.clone()
    changed.timestamps = batch.timestamps
    changed.item_ids[5:8] = (batch.item_ids[5:8] % NUM_ITEMS) + 1
    changed.ratings[5:8] = (batch.ratings[5:8] + 1) % 6
    with torch.no_grad():
        before, after = model.encode(batch), model.encode(changed)
    torch.testing.assert_close(before[:5], after[:5])
    assert not torch.allclose(before[5:8], after[5:8])
    torch.testing.assert_close(before[8:], after[8:])


def test_max_seq_len_normalisation_makes_prefix_outputs_exact() -> None:
    """With a constant divisor, position t of a long sequence equals the last output of its prefix."""
    config = HSTUConfig(**{**SMALL.__dict__, "attention_normalization": "max_seq_len"})
    torch.manual_seed(0)
    encoder = HSTUEncoder(config, WIDTH).eval()
    values, offsets, timestamps = encoder_inputs([9], WIDTH)
    with torch.no_grad():
        full = encoder(values, offsets, timestamps)
        prefix = encoder(values[:4], torch.tensor([0, 4]), timestamps[:4])
    torch.testing.assert_close(full[:4], prefix)


def test_config_rejects_unknown_normalisation() -> None:
    with pytest.raises(ValueError, match="attention_normalization"):
        HSTUConfig(attention_normalization="padded")
    with pytest.raises(ValueError, match="attention_activation"):
        HSTUConfig(attention_activation="relu")


# ---------------------------------------------------------------------- model


def test_build_model_leaves_table_on_meta_for_sharding() -> None:
    model = build_model(NUM_ITEMS, ModelConfig(embedding_dim=WIDTH, hstu=SMALL), device="cpu")
    table = model.embedding_collection.embeddings[ITEM_TABLE]
    assert table.weight.device.type == "meta"
    assert table.weight.shape == (NUM_ITEMS + 1, WIDTH)
    assert next(model.encoder.parameters()).device.type == "cpu"


def test_features_kjt_has_item_and_negative_keys() -> None:
    batch = random_batch([3, 2])
    kjt = batch.features(torch.tensor([7, 8, 9]))
    assert kjt.keys() == FEATURE_KEYS
    assert kjt["item"].values().tolist() == batch.item_ids.tolist()
    assert kjt["item"].lengths().tolist() == [3, 2]
    # Shared negatives spread over the batch's slots: a KJT needs one stride for all keys.
    assert kjt["negative"].values().tolist() == [7, 8, 9]
    assert kjt["negative"].lengths().tolist() == [2, 1]


def test_batch_to_moves_every_tensor() -> None:
    """Every tensor field, optional ones included, whatever fields the batch gains."""
    import dataclasses

    source = dataclasses.replace(random_batch([2, 2], user_features=USER_FEATURES),
                                 valid_rating=torch.tensor([3, 0]))
    batch = source.to("meta")
    tensors = [f.name for f in dataclasses.fields(batch) if isinstance(getattr(source, f.name), torch.Tensor)]
    assert {"valid_rating", "user_features", "item_ids"} <= set(tensors)
    assert all(getattr(batch, name).device.type == "meta" for name in tensors), tensors
    assert batch.user_ids == ["u0", "u1"]


def test_in_batch_negatives_are_capped() -> None:
    batch = random_batch([30, 30, 30])  # far more unique targets than the cap
    capped = small_model(max_in_batch_negatives=5)
    _, stats = capped(batch, num_negatives=16, generator=torch.Generator().manual_seed(0))
    assert stats["num_negatives"].item() == 16 + 5
    uncapped = small_model(max_in_batch_negatives=0)
    _, stats = uncapped(batch, num_negatives=16, generator=torch.Generator().manual_seed(0))
    unique_targets = torch.unique(torch.cat([batch.item_ids[1:30], batch.item_ids[31:60], batch.item_ids[61:90]]))
    assert stats["num_negatives"].item() == 16 + unique_targets.numel()


def test_forward_shapes_and_finite_loss() -> None:
    model = small_model()
    batch = random_batch([5, 1, 7, 3])
    loss, stats = model(batch, num_negatives=16)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert stats["num_targets"].item() == (5 - 1) + 0 + (7 - 1) + (3 - 1)
    assert stats["num_negatives"].item() >= 16
    loss.backward()
    table = model.embedding_collection.embeddings[ITEM_TABLE].weight
    assert table.grad is not None and torch.isfinite(table.grad).all()
    assert all(p.grad is not None for p in model.encoder.parameters())


def test_forward_handles_batch_without_targets() -> None:
    model = small_model()
    loss, stats = model(random_batch([1, 1]), num_negatives=4)
    assert loss.item() == 0.0
    loss.backward()


def test_all_item_embeddings_match_table_in_any_chunking() -> None:
    model = small_model()
    table = model.embedding_collection.embeddings[ITEM_TABLE].weight.detach()
    for chunk_size in (7, 1000):
        embeddings = model.all_item_embeddings(chunk_size=chunk_size)
        assert embeddings.shape == (NUM_ITEMS + 1, WIDTH)
        torch.testing.assert_close(embeddings[1:], F.normalize(table[1:], dim=-1))
        assert embeddings[0].abs().sum() == 0


def test_test_queries_encode_history_followed_by_valid_item() -> None:
    model = small_model().eval()
    batch = random_batch([4, 2])
    extended = random_batch([5, 3])
    extended.item_ids, _ = jagged_concat_last(batch.item_ids, batch.offsets, batch.valid_item)
    extended.timestamps, _ = jagged_concat_last(batch.timestamps, batch.offsets, batch.valid_timestamp)
    extended.ratings, _ = jagged_concat_last(batch.ratings, batch.offsets, torch.zeros(2, dtype=torch.int64))
    with torch.no_grad():
        torch.testing.assert_close(score_queries(model, batch, "test"), score_queries(model, extended, "valid"))


def test_evaluate_returns_sums_over_the_batch() -> None:
    model = small_model().eval()
    batch = random_batch([4, 2, 6])
    result = evaluate_batch(model, batch, model.all_item_embeddings(), use="valid", history=history_of(batch, "valid")).unseen
    assert result.count == 3
    assert 0 <= result.hit_sum <= 3 and 0 < result.reciprocal_rank_sum <= 3


def synthetic_sequences(num_users: int, length: int, seed: int) -> SequenceBatch:
    """Each user walks the catalog in steps of +1 from a random start: next item is predictable."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, NUM_ITEMS, (num_users, 1), generator=g)
    items = (starts + torch.arange(length)) % NUM_ITEMS + 1
    batch = random_batch([length] * num_users, seed=seed)
    batch.item_ids = items.flatten()
    return batch


def test_loss_decreases_with_adam() -> None:
    model = small_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    batch = synthetic_sequences(num_users=16, length=12, seed=1)
    losses = []
    for _ in range(50):
        optimizer.zero_grad()
        loss, _ = model(batch, num_negatives=16)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, f"loss did not fall enough: {first:.3f} -> {last:.3f}"


def test_full_softmax_equals_cross_entropy_over_catalog() -> None:
    model = small_model().eval()
    batch = random_batch([6, 4])
    with torch.no_grad():
        loss, _ = model(batch, full_softmax=True)
        # Independent computation: encoder outputs against every normalised item.
        offsets = batch.offsets
        items = model.embedding_collection.embeddings[ITEM_TABLE].weight
        x = model._input_embeddings(items[batch.item_ids], batch.ratings)
        hidden = model.encoder(x, offsets, batch.timestamps)
        queries, targets = next_item_positions(offsets)
        logits = hidden[queries] @ F.normalize(items[1:], dim=-1).t() / model.config.temperature
        expected = F.cross_entropy(logits, batch.item_ids[targets] - 1)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------- losses


def test_accidental_hits_are_masked() -> None:
    torch.manual_seed(0)
    query = F.normalize(torch.randn(3, 8), dim=-1)
    positive = F.normalize(torch.randn(3, 8), dim=-1)
    negatives = F.normalize(torch.randn(4, 8), dim=-1)
    positive_ids = torch.tensor([5, 6, 7])
    negative_ids = torch.tensor([1, 5, 2, 3])  # id 5 is query 0's target
    loss, stats = sampled_softmax_loss(query, positive, negatives, positive_ids, negative_ids, 0.1)
    assert stats["accidental_hits"].item() == 1
    # By hand: query 0 without negative 1, queries 1 and 2 with all negatives.
    per_query = []
    for i in range(3):
        keep = negative_ids != positive_ids[i]
        logits = torch.cat([(query[i] * positive[i]).sum().view(1), negatives[keep] @ query[i]]) / 0.1
        per_query.append(-torch.log_softmax(logits, 0)[0])
    torch.testing.assert_close(loss, torch.stack(per_query).mean())
    # Without masking the hit the loss would differ (sanity check of the test itself).
    unmasked, _ = sampled_softmax_loss(query, positive, negatives, positive_ids, torch.tensor([1, 9, 2, 3]), 0.1)
    assert not torch.allclose(loss, unmasked)


def test_in_batch_negatives_never_include_own_target_unmasked() -> None:
    """Every query's own target is among the in-batch negatives, so hits >= number of targets."""
    model = small_model()
    _, stats = model(random_batch([5, 4]), num_negatives=0)
    assert stats["accidental_hits"].item() >= stats["num_targets"].item()


# ------------------------------------------------------------------- metrics


def test_metrics_from_ranks_hand_computed() -> None:
    result = metrics_from_ranks(torch.tensor([0, 2, 12]), k=10)
    assert result.count == 3
    assert result.hit_sum == 2
    assert result.ndcg_sum == pytest.approx(1.0 + 1.0 / math.log2(4))  # rank 2 -> 1/log2(4) = 0.5
    assert result.reciprocal_rank_sum == pytest.approx(1.0 + 1.0 / 3 + 1.0 / 13)
    means = result.means()
    assert means["hr@10"] == pytest.approx(2 / 3)
    assert means["ndcg@10"] == pytest.approx(0.5)
    assert means["mrr"] == pytest.approx((1 + 1 / 3 + 1 / 13) / 3)


def test_ranks_without_the_history_match_the_masked_ranking() -> None:
    """From one score matrix: ties, padding and the target listed among the excluded ids, ids listed
    twice, and empty histories, against ``target_ranks`` on a masked copy."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        queries, items = 1 + trial % 7, 2 + trial % 13
        scores = torch.randint(0, 4, (queries, items + 1), generator=generator).to(torch.float32)  # many ties
        targets = torch.randint(1, items + 1, (queries,), generator=generator)
        lengths = torch.randint(0, 6, (queries,), generator=generator)
        ids = torch.randint(0, items + 1, (int(lengths.sum()),), generator=generator)
        ranks = target_ranks(scores, targets)
        assert torch.equal(ranks_without(scores, targets, ranks, (lengths, ids)),
                           target_ranks(scores, targets, (lengths, ids))), trial


@pytest.mark.parametrize("item_chunk_size", [None, 7])
def test_full_and_unseen_metrics_are_the_two_rankings(item_chunk_size) -> None:
    generator = torch.Generator().manual_seed(1)
    query, items = torch.randn(40, 8, generator=generator), torch.randn(31, 8, generator=generator)
    targets = torch.randint(1, 31, (40,), generator=generator)
    lengths = torch.randint(0, 5, (40,), generator=generator)
    history = (lengths, torch.randint(1, 31, (int(lengths.sum()),), generator=generator))
    full, unseen = full_and_unseen_metrics(query, items, targets, history, k=5, query_chunk_size=16,
                                           item_chunk_size=item_chunk_size)
    assert full == retrieval_metrics(query, items, targets, k=5, query_chunk_size=16)
    assert unseen == retrieval_metrics(query, items, targets, k=5, exclude=history, query_chunk_size=16)
    assert unseen.reciprocal_rank_sum > full.reciprocal_rank_sum


def test_retrieval_metrics_hand_computed_ranks() -> None:
    # 1-d embeddings make scores = query * item; items 1..5 score 1..5 for query +1.
    items = torch.tensor([[100.0], [1.0], [2.0], [3.0], [4.0], [5.0]])  # row 0 is padding, never ranked
    query = torch.tensor([[1.0], [1.0], [-1.0]])
    targets = torch.tensor([5, 3, 5])
    result = retrieval_metrics(query, items, targets, k=2)
    # Ranks: 0 (best), 2 (items 5 and 4 above), 4 (query -1 reverses the order).
    assert result.hit_sum == 1
    assert result.ndcg_sum == pytest.approx(1.0)
    assert result.reciprocal_rank_sum == pytest.approx(1 + 1 / 3 + 1 / 5)
    # Chunking queries does not change sums.
    chunked = retrieval_metrics(query, items, targets, k=2, query_chunk_size=1)
    assert chunked == result


def test_ranking_by_item_chunks_gives_the_one_matrix_ranks() -> None:
    """A catalog past ``item_chunk_size`` is ranked chunk by chunk: the same ranks, exclusions and
    exact ties included (targets in every chunk, excluded items in several chunks)."""
    generator = torch.Generator().manual_seed(0)
    items = torch.nn.functional.normalize(torch.randn(41, 8, generator=generator), dim=-1)
    query = torch.nn.functional.normalize(torch.randn(12, 8, generator=generator), dim=-1)
    targets = torch.tensor([1, 7, 30, 40, 9, 10, 11, 19, 20, 21, 2, 30])
    lengths = torch.tensor([0, 3, 1, 0, 2, 0, 5, 0, 0, 1, 0, 2])
    exclude = (lengths, torch.randint(1, 41, (int(lengths.sum()),), generator=generator))
    for excluded in (None, exclude):
        whole = retrieval_metrics(query, items, targets, k=5, exclude=excluded)
        for chunk in (10, 16, 40):
            assert retrieval_metrics(query, items, targets, k=5, exclude=excluded, item_chunk_size=chunk) == whole
    collapsed = torch.zeros(41, 8)  # every item scores 0: ties count against the target, in any chunk
    assert retrieval_metrics(query, collapsed, targets, k=50, item_chunk_size=10) == metrics_from_ranks(
        torch.full((12,), 39), k=50)
    with pytest.raises(ValueError, match="target ids must be in 1..40"):
        retrieval_metrics(query, items, torch.full((12,), 41), item_chunk_size=10)


def test_exclude_removes_items_but_never_the_target() -> None:
    scores = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    target = torch.tensor([3])
    assert target_ranks(scores, target).tolist() == [2]
    exclude = (torch.tensor([3]), torch.tensor([5, 4, 3]))  # lists the target too
    assert target_ranks(scores, target, exclude).tolist() == [0]


def test_ties_count_against_the_target() -> None:
    scores = torch.zeros(1, 6)  # a collapsed model: every item scores the same
    assert target_ranks(scores, torch.tensor([2])).tolist() == [4]


def test_metrics_sums_combine_like_an_all_reduce() -> None:
    a = metrics_from_ranks(torch.tensor([0, 5]))
    b = metrics_from_ranks(torch.tensor([20]))
    combined = RetrievalMetrics.from_tensor(a.to_tensor() + b.to_tensor())
    assert combined == a + b == metrics_from_ranks(torch.tensor([0, 5, 20]))


def test_most_popular_baseline_hand_computed() -> None:
    # Counts: item 3 x3, item 1 x2, items 2 and 4 x1 (tie broken by id), item 5 never.
    train = torch.tensor([3, 3, 3, 1, 1, 2, 4])
    targets = torch.tensor([3, 4, 5, 2])
    result = most_popular_baseline(train, num_items=5, target_ids=targets, k=3)
    # Order 3, 1, 2, 4, 5 -> ranks 0, 3, 4, 2.
    assert result.hit_sum == 2
    assert result.ndcg_sum == pytest.approx(1.0 + 1.0 / math.log2(4))
    assert result.reciprocal_rank_sum == pytest.approx(1 + 1 / 4 + 1 / 5 + 1 / 3)
    exclude = (torch.tensor([2]), torch.tensor([3, 1]))
    excluded = most_popular_baseline(train, 5, torch.tensor([4]), k=3, exclude=exclude)
    assert excluded.reciprocal_rank_sum == pytest.approx(1 / 2)  # only item 2 left above item 4


# --------------------------------------------------------------- determinism


def test_same_seed_same_model_and_loss() -> None:
    batch = random_batch([6, 3, 4])

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        model = small_model(**{})  # seeds 0 before building
        torch.manual_seed(1)
        loss, _ = model(batch, num_negatives=8)
        loss.backward()
        return loss.detach(), model.embedding_collection.embeddings[ITEM_TABLE].weight.grad.clone()

    loss_a, grad_a = run()
    loss_b, grad_b = run()
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)

    model = small_model()
    first = model.sample_negatives(8, torch.device("cpu"), torch.Generator().manual_seed(3))
    second = model.sample_negatives(8, torch.device("cpu"), torch.Generator().manual_seed(3))
    assert torch.equal(first, second)
    assert int(first.min()) >= 1 and int(first.max()) <= NUM_ITEMS


# ------------------------------------------------------------- distributed


def _sharded_check(rank: int, world_size: int, store_path: str, sharding_type: str) -> None:
    """One rank: shard the tables with the trainer's shard_model, train a step, and
    compare with an unsharded copy."""
    import torch.distributed as dist

    from freescale.training.config import OptimizerConfig, ParallelConfig
    from freescale.training.parallel.distributed import DistEnv
    from freescale.training.model.recommender import USER_TABLE
    from freescale.training.parallel.sharding import shard_model

    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        config = ModelConfig(embedding_dim=WIDTH, hstu=SMALL)
        model = build_model(NUM_ITEMS, config, device="cpu", user_features=USER_FEATURES)
        env = DistEnv(rank, world_size, rank, world_size, torch.device("cpu"), "gloo")
        sharded = shard_model(model, OptimizerConfig(sparse_optimizer="sgd", sparse_lr=0.1),
                              ParallelConfig(sharding=sharding_type), env)
        # A trained projection (it starts at zero, which would keep the user tables' gradients zero).
        with torch.no_grad():
            sharded.module.user_projection.weight.normal_(std=0.1, generator=torch.Generator().manual_seed(1))
        # Cost-balanced shards give ranks different batch sizes.
        batch = random_batch([5, 3, 7] if rank == 0 else [12], seed=rank, user_features=USER_FEATURES)

        # An unsharded copy with the same weights must compute the same loss.
        full_table = sharded.module.all_item_embeddings(normalize=False)
        user_tables = sharded.module.all_user_feature_tables()
        local = build_local_model(NUM_ITEMS, config, user_features=USER_FEATURES)
        dense_state = {k: v for k, v in sharded.module.state_dict().items() if "embedding_collection" not in k}
        missing, unexpected = local.load_state_dict(dense_state, strict=False)
        assert not unexpected and all("embedding_collection" in k for k in missing)
        with torch.no_grad():
            local.embedding_collection.embeddings[ITEM_TABLE].weight[1:] = full_table[1:]
            for i, table in enumerate(user_tables):
                local.user_embedding_collection.embedding_bags[USER_TABLE.format(index=i)].weight.copy_(table)
        loss, _ = sharded(batch, num_negatives=7, generator=torch.Generator().manual_seed(5))
        expected, _ = local(batch, num_negatives=7, generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)

        # The fused optimizer updates the looked-up rows of every table during backward.
        loss.backward()
        updated = sharded.module.all_item_embeddings(normalize=False)
        touched = torch.unique(batch.item_ids)
        assert not torch.allclose(updated[touched], full_table[touched])
        updated_users = sharded.module.all_user_feature_tables()
        assert all(not torch.equal(a, b) for a, b in zip(updated_users, user_tables))

        sharded.module.eval()
        with torch.no_grad():
            tables = sharded.module.all_user_feature_tables()
            result = evaluate_batch(sharded.module, batch, sharded.module.all_item_embeddings(), use="test").full
            # Scoring from the gathered tables (no collective) gives the same metrics.
            local_result = evaluate_batch(sharded.module, batch, sharded.module.all_item_embeddings(), use="test",
                                                   item_table=sharded.module.all_item_embeddings(normalize=False),
                                                   user_tables=tables).full
            torch.testing.assert_close(result.to_tensor(), local_result.to_tensor())
            sums = result.to_tensor()
            dist.all_reduce(sums)
        assert sums[3].item() == 4  # every rank's users counted once
        dist.barrier()
    finally:
        dist.destroy_process_group()


SHARDINGS = ("table_wise", "row_wise")


def _sharded_worker(rank: int, world_size: int, folder: str) -> None:
    """One rank of the spawned pair: the check for each sharding, its outcome written to a file
    ("ok" or the traceback)."""
    import traceback
    from pathlib import Path

    from freescale.training.parallel.distributed import exit_without_finalization

    for sharding_type in SHARDINGS:
        try:
            _sharded_check(rank, world_size, f"{folder}/store-{sharding_type}", sharding_type)
            outcome = "ok"
        except BaseException:  # noqa: BLE001 - reported to the test through the file
            outcome = traceback.format_exc()
        Path(folder, f"{sharding_type}-rank{rank}.txt").write_text(outcome)
    # Gloo's worker threads may still be freeing finished collectives: interpreter
    # finalization now would abort this rank (see exit_without_finalization).
    exit_without_finalization(0)


@pytest.fixture(scope="module")
def sharded_outcomes(tmp_path_factory) -> dict[str, list[str]]:
    """Both shardings checked by one pair of spawned ranks (one launch): sharding -> each rank's outcome."""
    import torch.multiprocessing as mp

    folder = tmp_path_factory.mktemp("sharded")
    mp.spawn(_sharded_worker, args=(2, str(folder)), nprocs=2, join=True)
    return {s: [(folder / f"{s}-rank{r}.txt").read_text() for r in range(2)] for s in SHARDINGS}


@pytest.mark.slow
@pytest.mark.parametrize("sharding_type", SHARDINGS)
def test_sharded_model_matches_local_model(sharded_outcomes, sharding_type: str) -> None:
    """build_model + shard_model on CPU/gloo: negatives, user features and full-catalog
    lookups go through the sharded tables, and the loss equals an unsharded copy's."""
    for rank, outcome in enumerate(sharded_outcomes[sharding_type]):
        assert outcome == "ok", f"rank {rank}:\n{outcome}"


def test_user_features_reach_every_position_and_their_tables() -> None:
    torch.manual_seed(0)
    model = build_local_model(NUM_ITEMS, ModelConfig(embedding_dim=WIDTH, hstu=SMALL), user_features=USER_FEATURES)
    model.eval()
    batch = random_batch([4, 6, 3], seed=2, user_features=USER_FEATURES)
    other = replace(batch, user_features=batch.user_features.roll(1, dims=0))
    with torch.no_grad():
        # The projection starts at zero: features have no effect until training moves it.
        torch.testing.assert_close(score_queries(model, other), score_queries(model, batch))
        torch.nn.init.normal_(model.user_projection.weight, std=0.1)
        query = score_queries(model, batch)
        # Other users' features give other queries for the same histories.
        moved = score_queries(model, other)
        assert not torch.allclose(query, moved, atol=1e-4)
        # Reading rows from the gathered tables equals the bag-collection lookup.
        tables = model.all_user_feature_tables(chunk_size=4)
        assert [tuple(t.shape) for t in tables] == [(size, 16) for _, size in USER_FEATURES]
        torch.testing.assert_close(score_queries(model, batch, user_tables=tables), query)
    model.train()
    loss, _ = model(batch, num_negatives=8)
    loss.backward()
    grads = [model.user_embedding_collection.embedding_bags[f"user_feature_{i}"].weight.grad
             for i in range(len(USER_FEATURES))]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    with pytest.raises(ValueError, match="has user features .* but the batch has none"):
        model(replace(batch, user_features=None), num_negatives=8)


def test_dense_span_ends_before_any_table_backward() -> None:
    """The probe's end (last gradient at the lookups' outputs) comes before either
    table's backward, which under DMP is a blocking collective: otherwise the wait for
    the slowest rank would be measured as this rank's dense compute."""
    from freescale.training.timing.bubbles import DenseSpanProbe

    torch.manual_seed(0)
    model = build_local_model(NUM_ITEMS, ModelConfig(embedding_dim=WIDTH, hstu=SMALL), user_features=USER_FEATURES)
    torch.nn.init.normal_(model.user_projection.weight, std=0.1)
    events: list[str] = []
    model.embedding_collection.embeddings[ITEM_TABLE].weight.register_hook(
        lambda g: events.append("item table backward"))
    model.user_embedding_collection.embedding_bags["user_feature_0"].weight.register_hook(
        lambda g: events.append("user table backward"))

    class RecordingProbe(DenseSpanProbe):
        def _grad_arrived(self, grad: torch.Tensor) -> torch.Tensor:
            events.append("dense gradient")
            return super()._grad_arrived(grad)

    loss, _ = model(random_batch([6, 3, 5], seed=4, user_features=USER_FEATURES), num_negatives=8,
                    source=RecordingProbe().timed(TableLookup(model)))
    loss.backward()
    assert events.count("dense gradient") == 3
    last_dense = max(i for i, e in enumerate(events) if e == "dense gradient")
    assert last_dense < events.index("item table backward") and last_dense < events.index("user table backward")


# ------------------------------------------ HSTU options of issue 27 (default off: the paper's formula)


def test_hstu_position_embeddings_and_output_norm_are_off_by_default() -> None:
    """The defaults make no parameters for either option, so the default model (its parameters, its
    random draws and its losses) is the one before the options existed."""
    encoder = HSTUEncoder(SMALL, WIDTH)
    assert encoder.position_embedding is None and encoder.output_norm is None
    assert not any(name.startswith(("position_embedding", "output_norm")) for name, _ in encoder.named_parameters())


def test_hstu_position_embeddings_add_each_rows_clamped_position_and_keep_the_contract() -> None:
    """The option adds position ``min(t, N-1)``'s learned row to input ``t`` (counted from the
    history's oldest item) and nothing else; the encoder stays causal and independent of its
    batch-mates, and the output norm keeps the outputs unit-length."""
    config = replace(SMALL, position_embeddings=4, output_norm=True)
    torch.manual_seed(0)
    encoder = HSTUEncoder(config, WIDTH, position_init_std=1.0).eval()
    assert encoder.position_embedding.weight.shape == (4, WIDTH)
    assert isinstance(encoder.output_norm, torch.nn.LayerNorm)
    # The same layers and output norm without the table, fed the inputs plus the positions by hand.
    plain = HSTUEncoder(replace(config, position_embeddings=0), WIDTH).eval()
    plain.load_state_dict({k: v for k, v in encoder.state_dict().items() if not k.startswith("position_embedding")})
    values, offsets, timestamps = encoder_inputs([6, 3], WIDTH)
    positions = torch.tensor([0, 1, 2, 3, 3, 3, 0, 1, 2])  # 4 and 5 share the table's last row
    with torch.no_grad():
        out = encoder(values, offsets, timestamps)
        torch.testing.assert_close(out, plain(values + encoder.position_embedding.weight[positions], offsets, timestamps))
        torch.testing.assert_close(out.norm(dim=-1), torch.ones(9))
        assert not torch.allclose(out, plain(values, offsets, timestamps))
        # Causal and batch-independent: with a constant 1/n divisor a prefix encodes exactly as the
        # whole history does at its positions, and a sample alone as in the batch.
        exact = HSTUEncoder(replace(config, attention_normalization="max_seq_len"), WIDTH, 1.0).eval()
        full = exact(values[:6], torch.tensor([0, 6]), timestamps[:6])
        torch.testing.assert_close(full[:3], exact(values[:3], torch.tensor([0, 3]), timestamps[:3]))
        torch.testing.assert_close(exact(values, offsets, timestamps)[6:],
                                   exact(values[6:], torch.tensor([0, 3]), timestamps[6:]))


def test_hstu_position_embeddings_refuse_negatives() -> None:
    with pytest.raises(ValueError, match="position_embeddings"):
        HSTUConfig(position_embeddings=-1)


def test_hstu_reference_init_draws_the_reference_spreads() -> None:
    """``init = "reference"``: ``W_uvqk`` ~ N(0, 0.02), ``W_o`` Xavier-uniform, zero biases."""
    assert SMALL.init == "torch"
    config = replace(SMALL, init="reference", linear_dim=64, attention_dim=64)
    reference = HSTUEncoder(config, WIDTH).layers[0]
    assert abs(reference.uvqk.weight.std().item() - 0.02) < 0.002
    fan_in, fan_out = reference.output.weight.shape[1], reference.output.weight.shape[0]
    assert reference.output.weight.abs().max().item() <= (6 / (fan_in + fan_out)) ** 0.5
    assert not reference.uvqk.bias.any() and not reference.output.bias.any()
    # The torch default's weights are Kaiming-uniform: spread 1/sqrt(3 * fan_in), well above 0.02 here.
    assert HSTUEncoder(replace(config, init="torch"), WIDTH).layers[0].uvqk.weight.std().item() > 0.03
    with pytest.raises(ValueError, match="init"):
        HSTUConfig(init="xavier")


def test_hstu_feed_forward_block_is_off_by_default_and_adds_sasrecs_ffn_after_each_layer() -> None:
    """``feed_forward_dim = 0`` makes no parameters and draws no random numbers (the default layer is
    the paper's). With it, each layer's output ``Y`` becomes ``Y + FFN(LayerNorm(Y))`` (eval: no
    dropout), computed here by hand on the same weights, and the encoder stays causal."""
    assert SMALL.feed_forward_dim == 0
    torch.manual_seed(0)
    plain = HSTUEncoder(SMALL, WIDTH).eval()
    assert all(layer.feed_forward is None for layer in plain.layers)
    assert not any("feed_forward" in name for name, _ in plain.named_parameters())
    torch.manual_seed(0)
    config = replace(SMALL, feed_forward_dim=24, attention_normalization="max_seq_len")
    ffn = HSTUEncoder(config, WIDTH).eval()
    assert ffn.layers[0].feed_forward[0].weight.shape == (24, WIDTH)
    values, offsets, timestamps = encoder_inputs([5, 2], WIDTH)
    # The layer without its FFN, then the block by hand.
    no_ffn = HSTULayer(replace(config, feed_forward_dim=0), WIDTH).eval()
    no_ffn.load_state_dict({k: v for k, v in ffn.layers[0].state_dict().items() if "feed_forward" not in k})
    plan = GroupedAttentionPlan.build(offsets, timestamps, config)
    with torch.no_grad():
        x = plan.enter(values)
        y = no_ffn(x, plan)
        layer = ffn.layers[0]
        expected = y + layer.feed_forward[3](torch.relu(layer.feed_forward[0](layer.feed_forward_norm(y))))
        torch.testing.assert_close(layer(x, plan), expected)
        assert not torch.allclose(expected, y)
        out = ffn(values, offsets, timestamps)
        torch.testing.assert_close(out[:3], ffn(values[:3], torch.tensor([0, 3]), timestamps[:3]))
    with pytest.raises(ValueError, match="feed_forward_dim"):
        HSTUConfig(feed_forward_dim=-1)


def test_hstu_norms_without_affine_have_no_parameters_and_match_the_plain_formula() -> None:
    """``norm_affine = false`` (Meta's reference): both LayerNorms normalise only. The same model with
    learned norms left at their initial scale 1 and shift 0 computes the same outputs."""
    assert SMALL.norm_affine
    config = replace(SMALL, norm_affine=False)
    torch.manual_seed(0)
    plain = HSTUEncoder(config, WIDTH).eval()
    assert not any("norm" in name for name, _ in plain.named_parameters())
    affine = HSTUEncoder(SMALL, WIDTH).eval()
    assert {name for name, _ in affine.named_parameters()} - {name for name, _ in plain.named_parameters()} == {
        f"layers.{i}.{norm}.{p}" for i in range(SMALL.num_layers)
        for norm in ("input_norm", "attention_norm") for p in ("weight", "bias")}
    affine.load_state_dict(plain.state_dict(), strict=False)
    values, offsets, timestamps = encoder_inputs([5, 2], WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(plain(values, offsets, timestamps), affine(values, offsets, timestamps))
        for layer in affine.layers:
            layer.input_norm.weight.mul_(2.0)
        assert not torch.allclose(plain(values, offsets, timestamps), affine(values, offsets, timestamps))
