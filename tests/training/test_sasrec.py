"""The SASRec encoder and the loss kinds: shapes, causality, no leakage between samples, a dense
reference, the binary cross-entropy by hand, every encoder x loss training, calibration with SASRec.

All single-process on CPU (``build_local_model``, no DistributedModelParallel), tiny shapes.
"""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from freescale.jobs import calibrate
from freescale.training.data.batch import SequenceBatch
from freescale.training.config import ConfigError, LossConfig, ModelConfig, SASRecConfig, load_config
from freescale.training.model.hstu import HSTUEncoder
from freescale.training.ops.jagged import next_item_positions, offsets_from_lengths
from freescale.training.model.losses import binary_cross_entropy_loss
from freescale.training.model.recommender import build_local_model
from freescale.training.ops.jagged import jagged_positions
from freescale.training.model.sasrec import SASRecEncoder
from freescale.training.loop.seeding import StepNegatives
from tests.helpers import sqlite_store

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one intra-op thread

NUM_ITEMS = 40
WIDTH = 16
SMALL = SASRecConfig(num_layers=2, num_heads=2, dropout=0.0, max_seq_len=32)


def model_config(encoder: str = "sasrec", dropout: float = 0.0) -> ModelConfig:
    config = ModelConfig(encoder=encoder, embedding_dim=WIDTH,
                         sasrec=SASRecConfig(num_layers=2, num_heads=2, dropout=dropout, max_seq_len=32))
    config.hstu.num_layers, config.hstu.num_heads = 1, 2
    config.hstu.attention_dim = config.hstu.linear_dim = 8
    config.hstu.dropout, config.hstu.max_seq_len = dropout, 64
    return config


def make_batch(lengths: list[int], seed: int = 0, items: torch.Tensor | None = None) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    total, size = int(lengths_t.sum()), len(lengths)
    return SequenceBatch(
        lengths=lengths_t,
        item_ids=items if items is not None else torch.randint(1, NUM_ITEMS + 1, (total,), generator=g),
        timestamps=torch.cumsum(torch.randint(1, 1000, (total,), generator=g), 0),
        ratings=torch.randint(1, 6, (total,), generator=g),
        valid_item=torch.randint(1, NUM_ITEMS + 1, (size,), generator=g),
        test_item=torch.randint(1, NUM_ITEMS + 1, (size,), generator=g),
        valid_timestamp=torch.zeros(size, dtype=torch.int64),
        test_timestamp=torch.zeros(size, dtype=torch.int64),
        user_ids=[f"u{i}" for i in range(size)],
    )


def encoder_inputs(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int64))
    total = int(offsets[-1])
    return torch.randn(total, WIDTH, generator=g), offsets, torch.arange(total, dtype=torch.int64) * 60


def small_encoder(seed: int = 0, config: SASRecConfig = SMALL) -> SASRecEncoder:
    torch.manual_seed(seed)
    return SASRecEncoder(config, WIDTH).eval()


# ------------------------------------------------------------------------------ encoder


def test_output_shape_unit_norm_and_jagged_checks() -> None:
    encoder = small_encoder()
    values, offsets, times = encoder_inputs([3, 1, 7, 5])
    out = encoder(values, offsets, times)
    assert out.shape == values.shape and torch.isfinite(out).all()
    assert torch.allclose(out.norm(dim=-1), torch.ones(out.shape[0]), atol=1e-5)
    with pytest.raises(ValueError, match="jagged shapes disagree"):
        encoder(values[:-1], offsets, times)
    empty = encoder(values[:0], torch.zeros(1, dtype=torch.int64), times[:0])
    assert empty.shape == (0, WIDTH)


def test_positions_count_from_the_oldest_item_and_clamp() -> None:
    offsets = offsets_from_lengths(torch.tensor([3, 0, 1, 6]))
    assert jagged_positions(offsets, 4).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 3, 3]


def test_jagged_batch_equals_each_sample_alone() -> None:
    """No padding and no leakage: a sample's outputs do not depend on its batch-mates."""
    encoder = small_encoder()
    lengths = [5, 2, 5, 9, 1, 40]  # equal lengths share a group; 40 > max_seq_len clamps positions
    values, offsets, times = encoder_inputs(lengths)
    together = encoder(values, offsets, times)
    for i in range(len(lengths)):
        rows = slice(int(offsets[i]), int(offsets[i + 1]))
        alone = encoder(values[rows], torch.tensor([0, lengths[i]]), times[rows])
        torch.testing.assert_close(together[rows], alone, rtol=1e-5, atol=1e-6)


def test_encoder_is_causal_and_a_prefix_encodes_as_the_whole() -> None:
    encoder = small_encoder()
    values, offsets, times = encoder_inputs([12])
    out = encoder(values, offsets, times)
    changed = values.clone()
    changed[8:] = torch.randn(4, WIDTH)
    torch.testing.assert_close(encoder(changed, offsets, times)[:8], out[:8], rtol=0, atol=0)
    assert not torch.allclose(encoder(changed, offsets, times)[8:], out[8:])
    prefix = encoder(values[:5], torch.tensor([0, 5]), times[:5])
    torch.testing.assert_close(prefix, out[:5], rtol=1e-5, atol=1e-6)


def reference_sasrec(encoder: SASRecEncoder, x: torch.Tensor) -> torch.Tensor:
    """One sample, dense, from the paper's equations with plain matrix ops (no SDPA, no grouping)."""
    n, width = x.shape
    heads = encoder.config.num_heads
    dh = width // heads
    h = x + encoder.position_embedding.weight[:n]
    for block in encoder.blocks:
        def layer_norm(t, norm):
            mean = t.mean(-1, keepdim=True)
            var = ((t - mean) ** 2).mean(-1, keepdim=True)
            return (t - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias

        z = layer_norm(h, block.attention_norm)
        w, b = block.qkv.weight, block.qkv.bias
        q, k, v = z @ w[:width].T + b[:width], z @ w[width:2 * width].T + b[width:2 * width], z @ w[2 * width:].T + b[2 * width:]
        heads_out = []
        for head in range(heads):
            cols = slice(head * dh, (head + 1) * dh)
            scores = q[:, cols] @ k[:, cols].T / math.sqrt(dh)
            future = torch.arange(n).unsqueeze(0) > torch.arange(n).unsqueeze(1)  # j > i
            weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            heads_out.append(weights @ v[:, cols])
        attended = torch.cat(heads_out, dim=1) @ block.attention_output.weight.T + block.attention_output.bias
        h = h + attended
        first, second = block.feed_forward[0], block.feed_forward[3]
        z = layer_norm(h, block.feed_forward_norm)
        h = h + (torch.relu(z @ first.weight.T + first.bias) @ second.weight.T + second.bias)
    h = layer_norm(h, encoder.output_norm)
    return h / h.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("heads,feed_forward", [(1, 0), (2, 24)])
def test_encoder_matches_dense_reference(heads: int, feed_forward: int) -> None:
    encoder = small_encoder(seed=3, config=SASRecConfig(num_layers=2, num_heads=heads, feed_forward_dim=feed_forward,
                                                        dropout=0.0, max_seq_len=32))
    values, offsets, times = encoder_inputs([11], seed=4)
    torch.testing.assert_close(encoder(values, offsets, times), reference_sasrec(encoder, values),
                               rtol=1e-4, atol=1e-5)


def test_dropout_only_in_training() -> None:
    encoder = small_encoder(config=SASRecConfig(num_layers=1, num_heads=2, dropout=0.5, max_seq_len=32))
    values, offsets, times = encoder_inputs([6, 4])
    torch.testing.assert_close(encoder(values, offsets, times), encoder(values, offsets, times), rtol=0, atol=0)
    encoder.train()
    assert not torch.equal(encoder(values, offsets, times), encoder(values, offsets, times))


# ------------------------------------------------------------------------------ config


def test_encoder_and_loss_choices() -> None:
    assert ModelConfig().encoder == "hstu" and LossConfig().kind == "sampled_softmax"
    assert isinstance(build_local_model(NUM_ITEMS, model_config("hstu")).encoder, HSTUEncoder)
    model = build_local_model(NUM_ITEMS, model_config("sasrec"))
    assert isinstance(model.encoder, SASRecEncoder) and model.attention_kernel == "grouped"
    config = load_config(None, ["--model.encoder", "sasrec", "--loss.kind", "bce", "--model.sasrec.max_seq_len", "50"])
    assert (config.model.encoder, config.loss.kind, config.model.max_seq_len) == ("sasrec", "bce", 50)
    assert load_config(None, []).model.max_seq_len == 1024  # hstu's
    with pytest.raises(ConfigError, match="sasrec.num_heads 3 must divide the model width embedding_dim 64"):
        load_config(None, ["--model.encoder", "sasrec", "--model.sasrec.num_heads", "3"])
    with pytest.raises(ConfigError, match="full_softmax applies to kind 'sampled_softmax' only"):
        load_config(None, ["--loss.kind", "bce", "--loss.full_softmax", "true"])
    with pytest.raises(ConfigError, match="model.sasrec: dropout must be in"):
        load_config(None, ["--model.sasrec.dropout", "1.0"])


# ------------------------------------------------------------------------------ losses


def test_bce_loss_by_hand() -> None:
    query = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    positive = torch.tensor([[0.6, 0.8], [0.0, 1.0], [1.0, 0.0]])
    negative = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.6, 0.8]])
    positive_ids, negative_ids = torch.tensor([4, 5, 6]), torch.tensor([7, 8, 6])  # the third is an accidental hit
    loss, stats = binary_cross_entropy_loss(query, positive, negative, positive_ids, negative_ids, temperature=0.5)
    # s+ = (0.6, 1.0, 0.6) / 0.5; s- = (0.0, 0.0, -) / 0.5; the third keeps only its positive term.
    sigmoid = lambda s: 1.0 / (1.0 + math.exp(-s))  # noqa: E731
    terms = [-math.log(sigmoid(1.2)) - math.log(1 - sigmoid(0.0)),
             -math.log(sigmoid(2.0)) - math.log(1 - sigmoid(0.0)),
             -math.log(sigmoid(1.2))]
    assert loss.item() == pytest.approx(sum(terms) / 3, rel=1e-6)
    assert stats["accidental_hits"].item() == 1.0
    assert stats["positive_logit"].item() == pytest.approx((1.2 + 2.0 + 1.2) / 3, rel=1e-6)
    empty, _ = binary_cross_entropy_loss(query[:0].requires_grad_(), positive[:0], negative[:0],
                                         positive_ids[:0], negative_ids[:0], 0.5)
    empty.backward()
    assert empty.item() == 0.0


@pytest.mark.parametrize("encoder", ["hstu", "sasrec"])
def test_model_bce_pairs_each_position_with_its_own_negative(encoder: str) -> None:
    torch.manual_seed(0)
    model = build_local_model(NUM_ITEMS, model_config(encoder)).eval()
    batch = make_batch([4, 1, 6])
    negative_ids = torch.randint(1, NUM_ITEMS + 1, (batch.num_tokens,), generator=torch.Generator().manual_seed(2))
    negative_ids[0] = batch.item_ids[1]  # position 0's negative is its own target: masked
    loss, stats = model(batch, loss_kind="bce", negative_ids=negative_ids)
    hidden = model.encode(batch)
    table = model.all_item_embeddings()
    queries, targets = next_item_positions(batch.offsets)
    logits_pos = (hidden[queries] * table[batch.item_ids[targets]]).sum(-1) / model.config.temperature
    logits_neg = (hidden[queries] * table[negative_ids[queries]]).sum(-1) / model.config.temperature
    masked = negative_ids[queries] == batch.item_ids[targets]
    expected = (F.softplus(-logits_pos) + torch.where(masked, 0.0, F.softplus(logits_neg))).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert stats["num_targets"].item() == 8 and stats["num_negatives"].item() == 8
    assert stats["accidental_hits"].item() == float(masked.sum()) >= 1
    with pytest.raises(ValueError, match="one negative per position"):
        model(batch, loss_kind="bce", negative_ids=negative_ids[:5])
    with pytest.raises(ValueError, match="full_softmax applies to the sampled softmax"):
        model(batch, loss_kind="bce", full_softmax=True)
    # Drawn by the model: one id per position, from the generator.
    drawn = model.sample_negatives(batch.num_tokens, torch.device("cpu"), torch.Generator().manual_seed(5))
    torch.testing.assert_close(model(batch, loss_kind="bce", generator=torch.Generator().manual_seed(5))[0],
                               model(batch, loss_kind="bce", negative_ids=drawn)[0], rtol=0, atol=0)


def test_step_negatives_follow_the_loss_kind() -> None:
    model = build_local_model(NUM_ITEMS, model_config())
    batch = make_batch([4, 1, 6])
    softmax = StepNegatives(model, LossConfig(num_negatives=7), seed=3, rank=1, device=torch.device("cpu"))
    bce = StepNegatives(model, LossConfig(kind="bce"), seed=3, rank=1, device=torch.device("cpu"))
    assert softmax(5, batch).numel() == 7 and bce(5, batch).numel() == batch.num_tokens == 11
    assert torch.equal(bce(5, batch), bce(5, make_batch([4, 1, 6], seed=9)))  # the count matters, not the ids
    assert torch.equal(bce(5, batch)[:7], softmax(5, batch))  # one stream per (seed, rank, step)
    assert not torch.equal(bce(5, batch), bce(6, batch))


def walking_batch(num_users: int, length: int, seed: int) -> SequenceBatch:
    """Each user walks the catalog in steps of +1 from a random start: the next item is predictable."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, NUM_ITEMS, (num_users, 1), generator=g)
    items = ((starts + torch.arange(length)) % NUM_ITEMS + 1).flatten()
    return make_batch([length] * num_users, seed=seed, items=items)


@pytest.mark.parametrize("encoder,loss_kind", list(itertools.product(["hstu", "sasrec"], ["sampled_softmax", "bce"])))
def test_every_encoder_trains_with_every_loss(encoder: str, loss_kind: str) -> None:
    torch.manual_seed(0)
    model = build_local_model(NUM_ITEMS, model_config(encoder, dropout=0.1)).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    batch = walking_batch(num_users=12, length=10, seed=1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        loss, _ = model(batch, num_negatives=16, generator=generator, loss_kind=loss_kind)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, f"{encoder} + {loss_kind}: loss did not fall enough: {first:.3f} -> {last:.3f}"


# ------------------------------------------------------------------------------ calibration


@pytest.mark.spawns  # in process, but its record runs git (code_version)
def test_calibrate_runs_with_sasrec_and_bce(tmp_path, capsys) -> None:
    out = tmp_path / "cost_model.json"
    rc = calibrate.main(["--output", str(out), "--lengths", "8,32,128", "--repeats", "2", "--warmup", "1",
                         "--replicates", "1", "--held-out-batches", "3", "--num-items", "60",
                         "--tracking-uri", sqlite_store(tmp_path / "mlflow.db"),
                         "--model.encoder", "sasrec", "--loss.kind", "bce", "--model.embedding_dim", "16",
                         "--model.sasrec.num_layers", "1", "--model.sasrec.max_seq_len", "128"])
    captured = capsys.readouterr()
    report = captured.out
    assert rc == 0, captured.err
    provenance = json.loads(out.read_text())["provenance"]
    assert provenance["config"]["model"]["encoder"] == "sasrec" and provenance["config"]["loss"]["kind"] == "bce"
    assert "attention kernel grouped" in report
