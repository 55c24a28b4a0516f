"""``freescale.training.model.encoder_graphs`` on CPU: the bucket ladder, and a graphed encoder replayed by rerunning its
captured functions (``replay="rerun"``) against the eager encoder. Everything but the capture runs here:
padding, the fixed tensors a graph reads and writes across batches, the gradients' way back. The CUDA
capture itself is tests/training/test_encoder_graphs_cuda.py's (skips without a GPU)."""
from __future__ import annotations

import pytest
import torch

from freescale.training.config import HSTUConfig
from freescale.training.model.encoder_graphs import GraphedEncoder, ShapeBuckets
from freescale.training.model.hstu import HSTUEncoder
from freescale.training.ops.jagged import offsets_from_lengths

WIDTH = 32
CONFIG = HSTUConfig(num_layers=2, num_heads=2, attention_dim=16, linear_dim=16, dropout=0.0, max_seq_len=64,
                    num_position_buckets=16, num_time_buckets=16, max_time_gap_seconds=10**7)
BUCKETS = ShapeBuckets(min_rows=64, growth=1.5, row_multiple=16, pad_sample_rows=8, max_graphs=3)


def test_every_total_fits_its_bucket_and_its_padding_samples() -> None:
    buckets = ShapeBuckets(min_rows=100, growth=1.125, row_multiple=64, pad_sample_rows=64)
    for total in range(1, 6000):
        rows = buckets.rows(total)
        assert rows >= total and rows % 64 == 0
        assert buckets.pad_samples(total) * 64 >= rows - total  # the padding fits its samples
        if total > 128:  # past the first rung, padding stays under the growth (plus a tile's rounding)
            assert rows < total * 1.125 + 64
    assert buckets.rows(1) == buckets.rows(128) == 128 and buckets.rows(129) == 192
    # a rung's samples cover its widest gap: the rung below's rows + 1 up to its own
    assert buckets.pad_samples(129) == 1 and buckets.pad_samples(3000) == buckets.pad_samples(buckets.rows(3000))
    assert [ShapeBuckets.samples(b) for b in (1, 2, 3, 4, 5, 32, 33)] == [1, 2, 4, 4, 8, 32, 64]


@pytest.mark.parametrize("bad", [dict(growth=1.0), dict(min_rows=0), dict(pad_sample_rows=0), dict(max_graphs=-1)])
def test_bucket_settings_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError, match="ShapeBuckets"):
        ShapeBuckets(**bad)


def batch(lengths: list[int], seed: int, width: int = WIDTH):
    """``values [T, width]``, offsets, timestamps and an output gradient of a batch of ``lengths``."""
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(torch.tensor(lengths))
    total = int(offsets[-1])
    values = torch.randn(total, width, generator=generator)
    timestamps = torch.cumsum(torch.randint(0, 10**5, (total,), generator=generator), 0)
    grad = torch.randn(total, width, generator=generator)
    return values, offsets, timestamps, grad


def encoder_pair():
    torch.manual_seed(0)
    eager = HSTUEncoder(CONFIG, WIDTH)
    torch.manual_seed(0)
    graphed = HSTUEncoder(CONFIG, WIDTH)
    return eager, graphed


def step(encoder, values, offsets, timestamps, grad):
    """Forward+backward; the output, the input's gradient and the parameters' (then cleared)."""
    values = values.clone().requires_grad_()
    out = encoder(values, offsets, timestamps)
    out.backward(grad)
    return out.detach().clone(), values.grad, [p.grad.clone() for p in encoder_params(encoder)]


def encoder_params(encoder):
    return list((encoder.encoder if isinstance(encoder, GraphedEncoder) else encoder).parameters())


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max().clamp(min=1e-6))


# Two batches in one bucket (the second shorter: rows the first wrote stay behind as padding), one in
# a higher rung, one of fewer samples (padded with empty ones), one of fewer slots, then the first again.
SEQUENCE = [[30, 20, 14], [5, 40, 3], [60, 30, 10], [7, 9, 1, 1], [7, 9], [1, 2, 3]]


def test_graphed_steps_give_the_eager_encoders_numbers_batch_after_batch() -> None:
    eager, plain = encoder_pair()
    graphed = GraphedEncoder(plain, BUCKETS, replay="rerun")
    for seed, lengths in enumerate(SEQUENCE):
        inputs = batch(lengths, seed)
        expected, got = step(eager, *inputs), step(graphed, *inputs)
        assert close(got[0], expected[0]), lengths
        assert close(got[1], expected[1]), lengths
        assert all(close(g, e) for g, e in zip(got[2], expected[2])), lengths
        eager.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
    stats = graphed.stats
    # buckets (rows, sample slots): (64, 4), (144, 4), (64, 2)
    assert stats.graphed == 6 and stats.captures == 3 and not stats.eager
    assert stats.real_rows == sum(map(sum, SEQUENCE)) and stats.padded_rows == 64 + 64 + 144 + 64 + 64 + 64


def test_gradients_accumulate_into_grad_as_autograd_does_and_hooks_fire() -> None:
    eager, plain = encoder_pair()
    graphed = GraphedEncoder(plain, BUCKETS, replay="rerun")
    fired = []
    plain.layers[0].uvqk.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    inputs = batch([12, 30], 3)
    once = step(eager, *inputs)[2]
    step(graphed, *inputs)
    twice = step(graphed, *inputs)[2]  # no zero_grad between: the second adds
    assert all(close(t, 2 * o) for t, o in zip(twice, once))
    assert len(fired) == 2 and close(fired[1], 2 * fired[0])
    # .grad is autograd's own tensor, never the graph's, which the next replay overwrites
    grad_address = plain.layers[0].uvqk.weight.grad.data_ptr()
    bucket = next(iter(graphed._graphs.values()))
    assert grad_address not in {g.data_ptr() for g in bucket.grad_params if g is not None}


def test_no_grad_eval_empty_and_past_max_graphs_run_eagerly_and_are_counted() -> None:
    _, plain = encoder_pair()
    graphed = GraphedEncoder(plain, BUCKETS, replay="rerun")
    values, offsets, timestamps, _ = batch([10, 20], 0)
    with torch.no_grad():
        graphed(values, offsets, timestamps)
    plain.eval()
    graphed(values, offsets, timestamps)
    plain.train()
    graphed(values[:0], torch.zeros(1, dtype=torch.int64), timestamps[:0])
    for total in (64, 96, 144, 216):  # four rungs, three graphs allowed
        graphed(*batch([total], 1)[:3])
    assert dict(graphed.stats.eager) == {"no grad": 1, "eval mode": 1, "empty batch": 1, "past max_graphs": 1}
    assert graphed.stats.captures == 3 and graphed.stats.graphed == 3
    assert "3 graphed calls over 3 captures (0 dropped)" in graphed.stats.summary()


def test_a_moved_parameter_drops_the_graphs() -> None:
    eager, plain = encoder_pair()
    graphed = GraphedEncoder(plain, BUCKETS, replay="rerun")
    inputs = batch([12, 30], 3)
    step(graphed, *inputs)
    plain.layers[1].output.weight = torch.nn.Parameter(plain.layers[1].output.weight.detach().clone())
    plain.zero_grad(set_to_none=True)
    got = step(graphed, *inputs)
    assert graphed.stats.dropped == 1 and graphed.stats.captures == 2
    assert close(got[0], step(eager, *inputs)[0])


def test_bf16_autocast_is_part_of_the_bucket_and_matches_eager_within_bf16() -> None:
    eager, plain = encoder_pair()
    graphed = GraphedEncoder(plain, BUCKETS, replay="rerun")
    inputs = batch([25, 17], 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = step(eager, *inputs), step(graphed, *inputs)
    step(graphed, *inputs)  # fp32 now: another bucket
    assert graphed.stats.captures == 2
    assert float((got[0].float() - expected[0].float()).abs().max()) < 3e-2
    assert float((got[1] - expected[1]).abs().max() / expected[1].abs().max()) < 5e-2


def test_the_models_training_step_through_graphs_gives_the_eager_loss_and_gradients() -> None:
    """``SequentialRecommender`` with a graphed encoder (as ``training.cuda_graphs = "encoder"`` builds on
    CUDA; rerun here): the same loss and dense gradients as the eager model, step after step."""
    from freescale.training.calibration.calibrate import synthetic_batch
    from freescale.training.config import ModelConfig
    from freescale.training.model.recommender import build_dense_model

    config = ModelConfig(embedding_dim=WIDTH, hstu=CONFIG)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_dense_model(50, config))
    (eager, eager_table), (graphed, graphed_table) = models
    graphed.graphed_encoder = GraphedEncoder(graphed.encoder, BUCKETS, replay="rerun")
    for seed, lengths in enumerate(SEQUENCE[:4]):
        batch = synthetic_batch(lengths, 50, seed=seed)
        results = []
        for model, table in models:
            loss, _ = model(batch, 8, generator=torch.Generator().manual_seed(seed), source=table.source())
            loss.backward()
            results.append((float(loss.detach()), [p.grad.clone() for p in model.encoder.parameters()]))
            model.zero_grad(set_to_none=True)
            table.zero_grad(set_to_none=True)
        (eager_loss, eager_grads), (graphed_loss, graphed_grads) = results
        assert abs(graphed_loss - eager_loss) <= 1e-5 * abs(eager_loss)
        assert all(close(g, e) for g, e in zip(graphed_grads, eager_grads))
    assert graphed.graphed_encoder.stats.graphed == 4


def test_only_an_encoder_that_reads_nothing_on_the_host_is_capturable() -> None:
    from freescale.training.config import ModelConfig
    from freescale.training.model.registry import build_encoder

    hstu = HSTUEncoder(HSTUConfig(attention_kernel="grouped"), WIDTH)
    assert "grouped attention kernel reads the batch's lengths" in hstu.not_capturable("cpu")
    sasrec = build_encoder(ModelConfig(encoder="sasrec"))
    assert "reads the batch's lengths on the host" in sasrec.not_capturable("cuda")


def test_freezing_a_parameter_drops_the_graphs_and_it_gets_no_gradient() -> None:
    eager, plain = encoder_pair()
    graphed = GraphedEncoder(plain, BUCKETS, replay="rerun")
    inputs = batch([12, 30], 3)
    step(graphed, *inputs)
    plain.zero_grad(set_to_none=True)
    for module in (eager, plain):
        module.layers[0].uvqk.weight.requires_grad_(False)
    values = inputs[0].clone().requires_grad_()
    graphed(values, *inputs[1:3]).backward(inputs[3])
    assert graphed.stats.dropped == 1 and plain.layers[0].uvqk.weight.grad is None
    eager_values = inputs[0].clone().requires_grad_()
    eager(eager_values, *inputs[1:3]).backward(inputs[3])
    assert close(values.grad, eager_values.grad) and close(plain.layers[1].uvqk.weight.grad,
                                                            eager.layers[1].uvqk.weight.grad)


# Operators that make a CUDA host wait for the GPU's queued work: a host-side read of a value
# (item), or an output whose size depends on the data.
WAITS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "_unique2", "unique_dim",
         "unique_consecutive", "masked_select"}


def test_after_the_encoder_the_training_step_issues_nothing_that_waits_for_the_gpu() -> None:
    """With the encoder graphed its replay waits for nothing, so the host could queue the loss and the
    backward while the GPU runs it, unless the rest of the step reads the device. The model's step
    reads it only before the encoder (the in-batch negatives' unique ids, with the default loss)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from freescale.training.calibration.calibrate import synthetic_batch
    from freescale.training.config import ModelConfig
    from freescale.training.model.recommender import build_dense_model

    torch.manual_seed(0)
    model, table = build_dense_model(50, ModelConfig(embedding_dim=WIDTH, hstu=CONFIG))
    model.train()
    ops: list[str] = []
    called_at: list[int] = []

    def replayed_encoder(values, offsets, timestamps):  # stands in for the graphs' replay, which reads nothing
        called_at.append(len(ops))
        return torch.nn.functional.normalize(values, dim=-1)

    model.graphed_encoder = replayed_encoder

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    batch = synthetic_batch([12, 1, 0, 30, 7], 50, seed=0).to("cpu")  # counted on the host, as the loader's
    with Record():
        loss, _ = model(batch, 8, generator=torch.Generator().manual_seed(0), source=table.source())
        loss.backward()
    (start,) = called_at
    assert not WAITS & set(ops[start:]), sorted(WAITS & set(ops[start:]))
    assert "_unique2" in ops[:start]  # the default loss's in-batch negatives: read before the encoder
