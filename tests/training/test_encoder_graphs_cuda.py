"""``freescale.training.model.encoder_graphs`` captured as CUDA graphs, against the eager encoder on the same GPU with the
Triton kernel (skips without a GPU). Run on the GPU machine with only torch, triton, numpy and pytest:
``python -m pytest -q tests/training/test_encoder_graphs_cuda.py``. The same plumbing without the capture
is tests/training/test_encoder_graphs.py's, on CPU."""
from __future__ import annotations

import os

import pytest
import torch

from freescale.training.config import HSTUConfig
from freescale.training.model.encoder_graphs import GraphedEncoder, ShapeBuckets
from freescale.training.model.hstu import HSTUEncoder
from tests.training import test_encoder_graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (CUDA graphs)")

WIDTH = 256
CONFIG = HSTUConfig(num_layers=2, num_heads=4, attention_dim=64, linear_dim=64, dropout=0.0, max_seq_len=1024,
                    attention_kernel="triton")
# Two batches in one bucket (the second shorter), one in a higher rung, then the first bucket again.
SEQUENCE = [[300, 200, 7, 1], [100, 250, 90, 2], [1024, 700, 65, 64], [64, 63, 128, 1]]


def batch(lengths: list[int], seed: int):
    return [t.cuda() for t in test_encoder_graphs.batch(lengths, seed, WIDTH)]


def step(encoder, values, offsets, timestamps, grad, params):
    values = values.clone().requires_grad_()
    out = encoder(values, offsets, timestamps)
    out.backward(grad)
    result = out.detach().float().clone(), values.grad.float(), [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return result


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_replayed_graphs_give_the_eager_encoders_numbers(dtype) -> None:
    torch.manual_seed(0)
    eager = HSTUEncoder(CONFIG, WIDTH).cuda()
    torch.manual_seed(0)
    plain = HSTUEncoder(CONFIG, WIDTH).cuda()
    graphed = GraphedEncoder(plain, ShapeBuckets(min_rows=512, growth=1.25))
    tolerance = 2e-2 if dtype is not None else 5e-3  # TF32 / bf16 dots over differently padded shapes
    autocast = (torch.autocast("cuda", dtype=dtype) if dtype is not None else torch.autocast("cuda", enabled=False))
    for seed, lengths in enumerate(SEQUENCE):
        inputs = batch(lengths, seed)
        with autocast:
            expected = step(eager, *inputs, list(eager.parameters()))
            got = step(graphed, *inputs, list(plain.parameters()))
        assert relative_error(got[0], expected[0]) < tolerance, lengths
        assert relative_error(got[1], expected[1]) < tolerance, lengths
        worst = max(relative_error(g, e) for g, e in zip(got[2], expected[2]))
        assert worst < 5 * tolerance, (lengths, worst)  # sums over every row: a little more rounding
    assert graphed.stats.graphed == 4 and graphed.stats.captures == 2 and not graphed.stats.eager


def test_a_graphed_step_launches_a_handful_of_ops_not_the_layers() -> None:
    from freescale.training.timing.launches import kernel_launches

    torch.manual_seed(0)
    graphed = GraphedEncoder(HSTUEncoder(CONFIG, WIDTH).cuda())
    values, offsets, timestamps, grad = batch([300, 200, 7, 1], 0)
    values.requires_grad_()

    def run() -> None:
        graphed(values, offsets, timestamps).backward(grad)

    run()  # captures
    eager_ops = kernel_launches(lambda: graphed.encoder(values, offsets, timestamps).backward(grad))
    graphed_ops = kernel_launches(run)
    # copies in, the padding's offsets, the output gradient's copy and zeroing, one accumulate per parameter
    assert graphed_ops <= 12 + 2 * len(list(graphed.encoder.parameters())) < eager_ops, (graphed_ops, eager_ops)
