"""The Triton HSTU attention kernel against its PyTorch reference (the grouped path), on CPU under
TRITON_INTERPRET=1, both through the one entry ``freescale.training.ops.attention.hstu_attention``.

The interpreter runs program instances one by one in NumPy, so shapes stay tiny
(16-row tiles, two heads of 16) and every case below runs in about a second.
Triton reads TRITON_INTERPRET when it is first imported in a process (its own
library functions are decorated then) and the kernels read it when they are
decorated, so tests/conftest.py sets it before anything imports triton.
"""
from __future__ import annotations

import os

import pytest
import torch

from freescale.runtime.errors import InputError
from freescale.training.model.attention_kernel import resolve_attention_kernel
from freescale.training.config import HSTUConfig
from freescale.training.model.hstu import GroupedAttentionPlan, HSTUEncoder, RelativeAttentionBias, bias_spec
from freescale.training.ops.jagged import offsets_from_lengths
from freescale.training.ops.attention import hstu_attention
from freescale.training.ops.relative_buckets import bucket_by_thresholds, log_bucket

if torch.cuda.is_available():
    # One process holds one copy of the kernel module: interpreted here, it would shadow the
    # compiled one that tests/training/test_hstu_kernel_cuda.py checks on the same machine.
    pytest.skip("a CUDA GPU is present: tests/training/test_hstu_kernel_cuda.py checks the compiled kernel",
                allow_module_level=True)

if os.environ.get("TRITON_INTERPRET") != "1":  # an error, not a skip: CI must not lose these tests quietly
    raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is first imported "
                       "(tests/conftest.py sets it; torchrec imports triton)")
from freescale.training.ops import hstu_attention as ops  # noqa: E402  (the kernel's internals: tuner, work list, buckets)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


TOLERANCE = 1e-4
"""Largest difference allowed, relative to the largest entry of the reference tensor."""

WIDTH = 32  # the encoder's width, the model's embedding_dim
CONFIG = HSTUConfig(num_layers=2, num_heads=2, attention_dim=16, linear_dim=16, dropout=0.0,
                    max_seq_len=40, num_position_buckets=16, num_time_buckets=16, max_time_gap_seconds=10**7)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-12))


def jagged_inputs(lengths: list[int], config: HSTUConfig, seed: int = 0, shuffle_times: bool = False,
                  wide_times: bool = False):
    generator = torch.Generator().manual_seed(seed)
    offsets = offsets_from_lengths(torch.tensor(lengths))
    total = int(offsets[-1])
    heads = config.num_heads
    # One projection's column views, as the layer passes them (row stride > width).
    projected = torch.randn(total, heads * (2 * config.attention_dim + config.linear_dim), generator=generator)
    q, k, v = projected.split([heads * config.attention_dim] * 2 + [heads * config.linear_dim], dim=1)
    # Gaps from 0 s (ties) to ~10^6 s: the time buckets span most of the table.
    timestamps = torch.cumsum(torch.randint(0, 10**6, (total,), generator=generator), 0)
    if shuffle_times:
        timestamps = timestamps[torch.randperm(total, generator=generator)]
    if wide_times:  # gaps past 2^31 s within a sample: the kernel's 64-bit path
        timestamps = timestamps + (torch.rand(total, generator=generator) < 0.3) * 2**33
    return q, k, v, offsets, timestamps


def run_both(lengths: list[int], config: HSTUConfig, block: int | None = 16, shuffle_times: bool = False,
             wide_times: bool = False, backward: str = "two_phase"):
    """Forward and the five gradients (q, k, v, position table, time table) of both kernels; ``block``
    is the kernel's tile and the reference's row block."""
    torch.manual_seed(0)
    bias = RelativeAttentionBias(config)
    with torch.no_grad():  # large biases: a wrong bucket shows
        bias.position_bias.weight.normal_(std=1.0)
        bias.time_bias.weight.normal_(std=1.0)
    q, k, v, offsets, timestamps = jagged_inputs(lengths, config, shuffle_times=shuffle_times, wide_times=wide_times)
    grad = torch.randn(q.shape[0], config.num_heads * config.linear_dim)
    results = []
    for kernel in ("triton", "reference"):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        bias.zero_grad(set_to_none=True)
        variant = {"backward": backward} if kernel == "triton" else {}
        out = hstu_attention(*inputs, offsets, timestamps, bias.position_bias.weight, bias.time_bias.weight,
                             bias_spec(config), kernel=kernel, block=block, **variant)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in inputs),
                        bias.position_bias.weight.grad.clone(), bias.time_bias.weight.grad.clone()])
    return results


NAMES = ("output", "grad q", "grad k", "grad v", "grad position table", "grad time table")


@pytest.mark.parametrize("lengths", [
    pytest.param([1], id="length-1"),
    pytest.param([23], id="one-sample-across-two-tiles"),
    pytest.param([1, 17, 33, 5, 16, 15], id="lengths-crossing-the-tile"),
    pytest.param([40, 3], id="longest-allowed"),
    pytest.param([7] * 6, id="many-of-one-length"),
])
def test_kernel_equals_grouped_forward_and_every_gradient(lengths: list[int]) -> None:
    triton_out, grouped_out = run_both(lengths, CONFIG)
    for name, actual, expected in zip(NAMES, triton_out, grouped_out):
        assert actual.shape == expected.shape, name
        assert relative_error(actual, expected) <= TOLERANCE, f"{name}: {relative_error(actual, expected):.2e}"


@pytest.mark.parametrize("lengths", [
    pytest.param([23], id="one-sample-across-two-tiles"),
    pytest.param([1, 17, 33, 5, 16, 15], id="lengths-crossing-the-tile"),
    pytest.param([40, 3], id="longest-allowed"),
])
def test_atomic_dq_backward_equals_grouped_in_every_gradient(lengths: list[int]) -> None:
    """The one-pass variant (dQ and the bias tables by atomics from phase 1's score tiles)."""
    triton_out, grouped_out = run_both(lengths, CONFIG, backward="atomic_dq")
    for name, actual, expected in zip(NAMES, triton_out, grouped_out):
        assert relative_error(actual, expected) <= TOLERANCE, f"{name}: {relative_error(actual, expected):.2e}"
    odd = HSTUConfig(**{**CONFIG.__dict__, "attention_normalization": "max_seq_len", "attention_dim": 12,
                        "linear_dim": 20})
    for name, actual, expected in zip(NAMES, *run_both(lengths, odd, backward="atomic_dq")):
        assert relative_error(actual, expected) <= TOLERANCE, f"odd widths, {name}"


def test_backward_variant_is_checked() -> None:
    q, k, v, offsets, timestamps = jagged_inputs([5], CONFIG)
    tables = RelativeAttentionBias(CONFIG)
    args = (q, k, v, offsets, timestamps, tables.position_bias.weight, tables.time_bias.weight, bias_spec(CONFIG))
    with pytest.raises(ValueError, match="backward must be one of"):
        hstu_attention(*args, kernel="triton", backward="fused")
    with pytest.raises(ValueError, match="the reference has one backward"):
        hstu_attention(*args, kernel="reference", backward="atomic_dq")


def test_kernel_equals_grouped_with_constant_normaliser_and_odd_head_widths() -> None:
    config = HSTUConfig(**{**CONFIG.__dict__, "attention_normalization": "max_seq_len",
                           "attention_dim": 12, "linear_dim": 20})
    for name, actual, expected in zip(NAMES, *run_both([9, 18], config)):
        assert relative_error(actual, expected) <= TOLERANCE, f"{name}: {relative_error(actual, expected):.2e}"


def test_reference_entry_is_the_encoders_grouped_path_to_the_bit() -> None:
    """``kernel="reference"`` with the config's row block runs the very code of the model's grouped
    plan: the same output and gradients to the bit, so a kernel that matches one matches the other."""
    config = HSTUConfig(**{**CONFIG.__dict__, "attention_block_size": 8})  # samples span several row blocks
    q, k, v, offsets, timestamps = jagged_inputs([9, 18, 1, 9], config)
    bias = RelativeAttentionBias(config)
    grad = torch.randn(q.shape[0], config.num_heads * config.linear_dim)
    plan = GroupedAttentionPlan.build(offsets, timestamps, config)
    results = []
    for attend in (lambda q, k, v: hstu_attention(q, k, v, offsets, timestamps, bias.position_bias.weight,
                                                  bias.time_bias.weight, bias_spec(config), kernel="reference",
                                                  block=config.attention_block_size),
                   lambda q, k, v: plan.leave(plan.attend(plan.enter(q), plan.enter(k), plan.enter(v), bias))):
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        bias.zero_grad(set_to_none=True)
        out = attend(*inputs)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in inputs), bias.position_bias.weight.grad.clone(),
                        bias.time_bias.weight.grad.clone()])
    for name, entry, grouped in zip(NAMES, *results):
        assert torch.equal(entry, grouped), name


def test_the_entry_refuses_what_it_cannot_keep() -> None:
    q, k, v, offsets, timestamps = jagged_inputs([5], CONFIG)
    bias = RelativeAttentionBias(CONFIG)
    tables = (bias.position_bias.weight, bias.time_bias.weight, bias_spec(CONFIG))
    with pytest.raises(ValueError, match=r"kernel must be one of \('triton', 'reference'\), not 'grouped'"):
        hstu_attention(q, k, v, offsets, timestamps, *tables, kernel="grouped")
    with pytest.raises(ValueError, match="precise=True is the triton kernel's"):
        hstu_attention(q, k, v, offsets, timestamps, *tables, kernel="reference", precise=True)
    softmax = bias_spec(HSTUConfig(**{**CONFIG.__dict__, "attention_activation": "softmax"}))
    with pytest.raises(ValueError, match="the triton kernel computes SiLU weights only, not 'softmax'"):
        hstu_attention(q, k, v, offsets, timestamps, *tables[:2], softmax, kernel="triton")


def test_autotuned_launch_gives_the_same_numbers_and_trials_leave_no_sum(monkeypatch) -> None:
    """The compiled path autotunes the tile; its trials run the backward several times into the
    bias-table gradients, which must be zeroed between them. Driven here with a stand-in timer."""
    monkeypatch.setattr(ops, "INTERPRETED_BLOCK", None)
    for tuned in (ops._forward_tuned, ops._backward_tuned):
        monkeypatch.setattr(tuned, "_do_bench", lambda call, quantiles=None: (call(), [1.0, 1.0, 1.0])[1])
        monkeypatch.setattr(tuned, "cache", {})
    triton_out, grouped_out = run_both([3, 17], CONFIG, block=None)
    for name, actual, expected in zip(NAMES, triton_out, grouped_out):
        assert relative_error(actual, expected) <= TOLERANCE, f"{name}: {relative_error(actual, expected):.2e}"
    assert len(ops._backward_tuned.configs) > 1 and ops._backward_tuned.cache  # the tuner did run


@pytest.mark.parametrize("block", [16, 64])
def test_work_list_visits_every_tile_of_every_sample_once(block: int) -> None:
    """The flat grid: every (sample, tile) once, spare slots marked, empty samples included."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 3 * block, (37,), generator=generator)
    lengths[[0, 5, 6, 36]] = torch.tensor([0, 0, block, 1])
    items = ops.work_items(offsets_from_lengths(lengths), block)
    assert items.shape[0] == int(lengths.sum()) // block + lengths.numel()
    visited = sorted((int(s), int(m)) for s, m in items.tolist() if m >= 0)
    expected = sorted((s, m) for s, n in enumerate(lengths.tolist()) for m in range(0, n, block))
    assert visited == expected
    assert [int(s) for s in items[:, 0]] == sorted(int(s) for s in items[:, 0])  # slots run in sample order


@pytest.mark.parametrize("wide_times", [False, True], ids=["gaps-below-2^31", "gaps-past-2^31"])
def test_bias_gradients_with_unsorted_timestamps(wide_times: bool) -> None:
    """Out-of-order timestamps: the time buckets along a row go up and down, so a row has many
    runs of one bucket; the run sums must still give the grouped path's table gradients. Gaps
    past 2^31 s take the kernel's 64-bit path (tiles of real histories take the 32-bit one)."""
    triton_out, grouped_out = run_both([29, 6], CONFIG, shuffle_times=True, wide_times=wide_times)
    for name, actual, expected in zip(NAMES, triton_out, grouped_out):
        assert relative_error(actual, expected) <= TOLERANCE, f"{name}: {relative_error(actual, expected):.2e}"


def test_thresholds_reproduce_the_cpu_formula_exactly() -> None:
    """log_bucket on CPU is the formula the thresholds come from; counting thresholds (GPUs, the
    kernel) must give the same bucket for every distance, including past max_distance."""
    generator = torch.Generator().manual_seed(1)
    for num_buckets, max_distance in ((64, 1024), (64, 4 * 365 * 86400.0), (16, 40), (8, 5), (3, 1)):
        distances = torch.cat([torch.arange(0, 70_000),
                               torch.randint(0, int(3 * max_distance) + 2, (70_000,), generator=generator)])
        assert torch.equal(bucket_by_thresholds(distances, num_buckets, max_distance),
                           log_bucket(distances, num_buckets, max_distance))


@pytest.mark.parametrize("position", [True, False], ids=["position-table", "time-guess"])
def test_kernel_buckets_equal_log_bucket_exactly(position: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = ((64, 1024), (64, 2048), (16, 40), (8, 5)) if position else ((64, 4 * 365 * 86400.0), (16, 40), (8, 5))
    for num_buckets, max_distance in shapes:
        distances = torch.cat([torch.arange(0, 4096),
                               torch.randint(0, int(3 * max_distance) + 2, (4096,), generator=generator)])
        expected = log_bucket(distances, num_buckets, max_distance)
        assert torch.equal(ops.kernel_buckets(distances, num_buckets, max_distance, position), expected)
    if not position:  # blocks spanning more than 2^31 s take the 64-bit path
        distances = torch.cat([distances, torch.randint(2**31, 2**40, (4096,), generator=generator)])
        distances = distances[torch.randperm(distances.numel(), generator=generator)]
        assert torch.equal(ops.kernel_buckets(distances, num_buckets, max_distance, position),
                           log_bucket(distances, num_buckets, max_distance))


def test_encoder_with_triton_kernel_equals_grouped_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole encoder (every parameter's gradient) through the selection key."""
    lengths = [5, 18, 1]
    offsets = offsets_from_lengths(torch.tensor(lengths))
    values = torch.randn(int(offsets[-1]), WIDTH)
    timestamps = torch.cumsum(torch.randint(0, 10**5, (int(offsets[-1]),)), 0)
    encoders = {}
    for kernel in ("triton", "grouped"):
        torch.manual_seed(0)
        encoders[kernel] = HSTUEncoder(HSTUConfig(**{**CONFIG.__dict__, "attention_kernel": kernel}), WIDTH)
        assert encoders[kernel].kernel("cpu") == kernel
        out = encoders[kernel](values, offsets, timestamps)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    torch.testing.assert_close(encoders["triton"](values, offsets, timestamps),
                               encoders["grouped"](values, offsets, timestamps), rtol=TOLERANCE, atol=TOLERANCE)
    grouped = dict(encoders["grouped"].named_parameters())
    for name, parameter in encoders["triton"].named_parameters():
        assert relative_error(parameter.grad, grouped[name].grad) <= TOLERANCE, name


def test_mixed_input_dtypes_meet_in_one_and_each_gradient_keeps_its_own() -> None:
    """Without autocast the kernel computes in q, k, v's common dtype (fp32 here, with k given in
    bf16): the same numbers as all-fp32 inputs holding k's values, and k's gradient comes back bf16."""
    q, k, v, offsets, timestamps = jagged_inputs([9, 18], CONFIG)
    bias = RelativeAttentionBias(CONFIG)
    results = []
    for k_dtype in (torch.bfloat16, torch.float32):
        inputs = [t.detach().to(dtype).requires_grad_() for t, dtype in
                  ((q, torch.float32), (k.to(torch.bfloat16), k_dtype), (v, torch.float32))]
        out = hstu_attention(*inputs, offsets, timestamps, bias.position_bias.weight, bias.time_bias.weight,
                             bias_spec(CONFIG), kernel="triton", block=16)
        out.square().sum().backward()
        assert out.dtype == torch.float32 and inputs[1].grad.dtype == k_dtype
        results.append([out.detach(), *(t.grad.float() for t in inputs)])
    for name, mixed, fp32 in zip(NAMES, *results):
        # k's gradient was rounded to bf16 on its way back: within bf16's 2^-8.
        assert relative_error(mixed, fp32) <= (2**-8 if name == "grad k" else 0.0), name


def test_bf16_under_the_interpreter_is_refused_not_computed_wrong() -> None:
    """The interpreter's tl.dot returns garbage for bf16 operands (1e10 off), so the kernel refuses
    bf16 there in one line, whether the inputs are bf16 or autocast asks for it; other dtypes, anywhere."""
    q, k, v, offsets, timestamps = jagged_inputs([9], CONFIG)
    bias = RelativeAttentionBias(CONFIG)

    def attend(*tensors: torch.Tensor) -> torch.Tensor:
        return hstu_attention(*tensors, offsets, timestamps, bias.position_bias.weight, bias.time_bias.weight,
                              bias_spec(CONFIG), kernel="triton", block=16)

    with pytest.raises(ValueError, match="^the Triton interpreter .* cannot run .* in torch.bfloat16: [^\n]*$"):
        attend(q.bfloat16(), k.bfloat16(), v.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="Triton interpreter"):
        attend(q, k, v)
    with pytest.raises(ValueError, match="takes q, k, v in torch.float32 or torch.bfloat16, not torch.float64"):
        attend(q.double(), k, v)


@pytest.mark.skip(reason="the Triton interpreter's tl.dot has no bf16 (garbage, 1e10 off): the kernel in bf16, "
                         "alone and in the encoder under bf16 autocast, is tests/training/test_hstu_kernel_cuda.py's, on a GPU")
def test_kernel_in_bf16() -> None:
    """A placeholder, so that a CPU run lists the bf16 kernel check it cannot do, and where it is."""


def test_auto_picks_triton_on_cuda_and_grouped_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_attention_kernel("auto", "cpu") == "grouped"
    assert resolve_attention_kernel("grouped", "cuda") == "grouped"
    assert resolve_attention_kernel("auto", "cuda") == "triton"  # needs no GPU to decide


def test_triton_where_it_cannot_run_is_one_line_never_a_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InputError) as error:
        resolve_attention_kernel("triton", "cpu")
    message = str(error.value)
    assert "\n" not in message and "attention_kernel" in message and "cpu" in message


def test_calibrate_refuses_triton_on_cpu_before_writing(tmp_path, monkeypatch, capsys) -> None:
    from freescale.jobs import calibrate

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    output = tmp_path / "cost_model.json"
    status = calibrate.main(["--output", str(output), "--device", "cpu", "--tracking-uri", "none",
                             "--model.hstu.attention_kernel", "triton"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and not output.exists()
    assert len(err) == 1 and "attention_kernel = 'triton' cannot run" in err[0]
