"""The compiled Triton HSTU kernel on a CUDA GPU against its PyTorch reference, the grouped path, both
through ``freescale.training.ops.attention.hstu_attention`` (skips without a GPU).

Shapes are the GPU check's model (4 heads of 64) and lengths around the 64-row tiles and up
to 1024. Run on the GPU machine with only torch, triton, numpy and pytest:
``python -m pytest -q tests/training/test_hstu_kernel_cuda.py``. tests/training/test_hstu_kernel.py checks the
same equalities on CPU through the interpreter.
"""
from __future__ import annotations

import os

import pytest
import torch

from freescale.training.config import HSTUConfig
from freescale.training.model.hstu import HSTUEncoder, RelativeAttentionBias, bias_spec
from freescale.training.ops.jagged import offsets_from_lengths
from freescale.training.ops.attention import hstu_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    from freescale.training.ops import hstu_attention as ops  # the kernel module, for its kernel_dtype

WIDTH = 256  # the encoder's width, the model's embedding_dim
CONFIG = HSTUConfig(num_layers=2, num_heads=4, attention_dim=64, linear_dim=64, dropout=0.0,
                    max_seq_len=1024)
LENGTHS = [1, 2, 63, 64, 65, 127, 128, 129, 300, 1024, 7, 7, 7]
NAMES = ("output", "grad q", "grad k", "grad v", "grad position table", "grad time table")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-30))


@pytest.fixture(scope="module")
def problem():
    generator = torch.Generator().manual_seed(0)
    offsets = offsets_from_lengths(torch.tensor(LENGTHS))
    total, heads, width = int(offsets[-1]), CONFIG.num_heads, CONFIG.attention_dim
    qkv = torch.randn(total, 3 * heads * width, generator=generator)
    timestamps = torch.cumsum(torch.randint(0, 10**6, (total,), generator=generator), 0)
    grad = torch.randn(total, heads * width, generator=generator)
    torch.manual_seed(0)
    bias = RelativeAttentionBias(CONFIG)
    with torch.no_grad():
        bias.position_bias.weight.normal_(std=0.5)
        bias.time_bias.weight.normal_(std=0.5)
    device = torch.device("cuda")
    return (qkv.to(device), offsets.to(device), timestamps.to(device), grad.to(device), bias.to(device))


def run(problem, kernel: str, dtype=torch.float32, precise: bool = False, backward: str = "two_phase"):
    qkv, offsets, timestamps, grad, bias = problem
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in qkv.split(CONFIG.num_heads * CONFIG.attention_dim, 1))
    bias.zero_grad(set_to_none=True)
    previous = torch.backends.cuda.matmul.allow_tf32
    # The reference's matmuls (torch's) in full fp32, forward and backward; the kernel's dots follow `precise`.
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        variant = {"backward": backward} if kernel == "triton" else {}
        out = hstu_attention(q, k, v, offsets, timestamps, bias.position_bias.weight, bias.time_bias.weight,
                             bias_spec(CONFIG), kernel=kernel, precise=precise, **variant)
        out.backward(grad.to(out.dtype))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return [out.detach(), q.grad, k.grad, v.grad, bias.position_bias.weight.grad.clone(),
            bias.time_bias.weight.grad.clone()]


BACKWARDS = pytest.mark.parametrize("backward", ["two_phase", "atomic_dq"])


@BACKWARDS
def test_full_fp32_dots_equal_grouped(problem, backward: str) -> None:
    for name, a, b in zip(NAMES, run(problem, "triton", precise=True, backward=backward), run(problem, "reference")):
        assert relative_error(a, b) <= 1e-4, f"{name}: {relative_error(a, b):.2e}"


@BACKWARDS
def test_tf32_dots_stay_within_tf32_rounding(problem, backward: str) -> None:
    for name, a, b in zip(NAMES, run(problem, "triton", backward=backward), run(problem, "reference")):
        assert relative_error(a, b) <= 1e-2, f"{name}: {relative_error(a, b):.2e}"


@BACKWARDS
def test_bf16_is_as_close_as_bf16_can_be(problem, backward: str) -> None:
    """bf16 carries 8 bits: the kernel in bf16 against fp32 stays within a few bf16 steps."""
    for name, a, b in zip(NAMES, run(problem, "triton", dtype=torch.bfloat16, backward=backward),
                          run(problem, "reference")):
        assert relative_error(a, b) <= 5e-2, f"{name}: {relative_error(a, b):.2e}"


def test_q_k_v_gradients_are_deterministic(problem) -> None:
    """Only the bias tables' gradients use atomics; everything else is bitwise repeatable."""
    first, second = run(problem, "triton"), run(problem, "triton")
    for name, a, b in list(zip(NAMES, first, second))[:4]:
        assert torch.equal(a, b), name


def test_encoder_under_bf16_autocast_runs_the_kernel_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """``training.precision = "bf16"``: the encoder under bf16 autocast hands the kernel bf16 q, k, v,
    and its output and fp32 parameter gradients stay near the fp32 grouped encoder's (full fp32
    dots). Not yet run on a GPU: the bounds come from this encoder and batch through the grouped
    path under CPU bf16 autocast against fp32 (relative L2: output 1.8e-3, parameter gradients at
    most 5.3e-2, the attention LayerNorms'; tests/training/test_precision.py checks that path on CPU)."""
    from freescale.training.model.precision import encoder_autocast

    dtypes = []
    kernel_dtype = ops.kernel_dtype

    def spy(*qkv: torch.Tensor) -> torch.dtype:
        dtypes.append(kernel_dtype(*qkv))
        return dtypes[-1]

    monkeypatch.setattr(ops, "kernel_dtype", spy)
    offsets = offsets_from_lengths(torch.tensor(LENGTHS)).cuda()
    total = int(offsets[-1])
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(total, WIDTH, generator=generator).cuda()
    timestamps = torch.cumsum(torch.randint(0, 10**6, (total,), generator=generator), 0).cuda()
    grad = torch.randn(total, WIDTH, generator=generator).cuda()

    def run(kernel: str, precision: str):
        torch.manual_seed(0)
        encoder = HSTUEncoder(HSTUConfig(**{**CONFIG.__dict__, "attention_kernel": kernel}), WIDTH).cuda()
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference in full fp32
        try:
            with encoder_autocast(precision, "cuda"):
                out = encoder(values, offsets, timestamps)
            out.backward(grad)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        assert out.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in encoder.parameters())
        return out.detach(), {name: p.grad for name, p in encoder.named_parameters()}

    reference, reference_grads = run("grouped", "fp32")
    dtypes.clear()
    out, grads = run("triton", "bf16")
    assert dtypes == [torch.bfloat16] * CONFIG.num_layers

    def l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
        return float((actual - expected).norm() / expected.norm())

    assert 1e-4 < l2(out, reference) <= 1e-2
    for name, g in grads.items():
        assert l2(g, reference_grads[name]) <= 0.15, f"{name}: {l2(g, reference_grads[name]):.2e}"


def test_auto_runs_the_kernel_in_the_encoder() -> None:
    encoder = HSTUEncoder(HSTUConfig(**{**CONFIG.__dict__, "attention_kernel": "auto"}), WIDTH).cuda()
    assert encoder.kernel("cuda") == "triton"
    offsets = offsets_from_lengths(torch.tensor([5, 700, 1])).cuda()
    values = torch.randn(int(offsets[-1]), WIDTH, device="cuda", requires_grad=True)
    timestamps = torch.arange(int(offsets[-1]), device="cuda") * 1000
    out = encoder(values, offsets, timestamps)
    out.square().sum().backward()
    assert torch.isfinite(values.grad).all() and out.shape == values.shape
