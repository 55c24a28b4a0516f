"""Jagged HSTU attention in Triton: one launch per layer and direction, whatever the batch's lengths.

For every sample ``s`` (rows ``offsets[s]:offsets[s+1]``), head ``h`` and query
position ``i`` of it::

    out[i] = sum_{j <= i} SiLU(q_i . k_j + pos_w[pb(i - j), h] + time_w[tb(|t_i - t_j|), h]) / n * v_j

with ``pb``/``tb`` the log buckets of ``training.ops.relative_buckets`` and ``n``
the sample's length (or ``max_seq_len``). The grouped PyTorch path in
``training.hstu`` computes the same numbers and is this kernel's reference
(``tests/test_hstu_kernel.py`` runs both under ``TRITON_INTERPRET=1``).

Why a kernel: the grouped path issues a few dozen small ops per distinct length,
so on a GPU a batch costs a fixed few milliseconds per distinct length and the
balancer's ``a L^2 + b L + c`` does not describe it. Here a program handles one
``BLOCK``-row tile of one sample and head, and the grid is a flat work list
(``_work_item``): sample ``s`` owns slots ``S(s) .. S(s+1) - 1`` with
``S(s) = offsets[s] // BLOCK + s``, at least the ``ceil(n_s / BLOCK)`` tiles it has
and at most one more, so the grid ``(T // BLOCK + B, H)`` is known on the host
without reading the lengths (no host sync), and a short sample in a batch with a
long one launches its own tiles, not as many as the longest sample has.

Forward: a program loops over its query tile's key tiles up to the diagonal,
recomputing the bias from positions and timestamps (nothing ``L x L`` is ever
stored). Backward, one launch, two phases per program (as FlashAttention-2's
Triton backward): phase 1 owns key tile ``m`` and accumulates ``dK``, ``dV`` and
the bias-table gradients over the query tiles at and below the diagonal; phase 2
owns query tile ``m`` and accumulates ``dQ``. With ``w = SiLU(s) / n``::

    dV_j += w_ij dO_i        dW_ij = dO_i . v_j
    dS_ij = dW_ij * SiLU'(s_ij) / n          SiLU'(s) = sig(s) (1 + s (1 - sig(s)))
    dK_j += dS_ij q_i        dQ_i += dS_ij k_j
    d pos_w[pb(i-j), h] += dS_ij             d time_w[tb(.), h] += dS_ij

The bias gradients are a scatter into tiny tables (``_add_runs``). Along a row of a
tile the bucket changes only where the distance or gap crosses a threshold, so the
row's ``dS`` falls into a few runs of one bucket each; a prefix sum along the row
gives every run's total as the difference of the prefix at its two ends, and only
those ends are added to the table (fp32 atomics, a few per row). Summing the tile
once per bucket instead would cost dozens of full-tile reductions near the diagonal,
where a tile spans dozens of buckets. The atomics' order makes these two gradients
non-deterministic in the last bits on a GPU, which the other five are not.

Import cost: triton is imported when this module is; ``training.hstu`` imports it
only when the Triton kernel is selected. ``TRITON_INTERPRET=1`` must be set before
the import to run the kernels on CPU tensors (tests).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from training.ops.relative_buckets import bucket_scale, bucket_thresholds


def _interpreter_scalar_index() -> None:
    """Let the interpreter use kernel scalars as loop bounds under NumPy >= 2.4.

    The interpreter holds every scalar as a one-element array and converts it with
    ``int(array)``, which NumPy 2.4 refuses for arrays of one dimension, so any
    ``range(...)`` whose bound comes from a loaded length fails. Compiled kernels
    are not affected. Wraps triton 3.6's tensor patching; other versions are left as they are.
    """
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_freescale_scalar_index", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._freescale_scalar_index = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_scalar_index()


@dataclass(frozen=True)
class BiasSpec:
    """How relative positions and time gaps map to bias-table rows (``HSTUConfig``'s buckets)."""

    num_position_buckets: int
    max_position: float
    num_time_buckets: int
    max_time_gap: float
    normalizer: int
    """Divisor of the attention weights; 0 = each sample's own length."""


INTERPRETED_BLOCK: int | None = 16
"""Tile rows under the interpreter, which runs every program in Python: tl.dot's minimum keeps the CPU
tests quick. Compiled kernels pick their tile by autotuning (``_tuned``)."""


@triton.jit
def _bucket(distance, thresholds, scale, NUM_BUCKETS: tl.constexpr):
    """Bucket of int64 ``distance >= 0``: a float guess, then exact against the integer thresholds."""
    guess = (tl.log(distance.to(tl.float32) + 1.0) * scale).to(tl.int32)
    guess = tl.minimum(tl.maximum(guess, 0), NUM_BUCKETS - 1)
    lower = tl.load(thresholds + guess)
    upper = tl.load(thresholds + guess + 1)
    return guess - (distance < lower).to(tl.int32) + (distance >= upper).to(tl.int32)


@triton.jit
def _scores(q, k, pos_b, time_b, pos_w, time_w, h, H, PRECISION: tl.constexpr):
    """``q k^T`` plus both biases, fp32 ``[BLOCK, BLOCK]``."""
    s = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision=PRECISION)
    s += tl.load(pos_w + pos_b * H + h).to(tl.float32)
    s += tl.load(time_w + time_b * H + h).to(tl.float32)
    return s


@triton.jit
def _tile_buckets(offs_m, offs_n, t_m, t_n, valid, pos_thr, time_thr, pos_scale, time_scale,
                  NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr):
    distance = tl.where(valid, offs_m[:, None] - offs_n[None, :], 0).to(tl.int64)
    gap = tl.where(valid, t_m[:, None] - t_n[None, :], 0)
    gap = tl.where(gap < 0, -gap, gap)
    return (_bucket(distance, pos_thr, pos_scale, NUM_POS),
            _bucket(gap, time_thr, time_scale, NUM_TIME))


@triton.jit
def _rows(ptr, start, offs, mask, stride_t, head_offset, cols, col_mask):
    """``[BLOCK, BLOCK_D]`` tile of one head: rows ``start + offs``, zero where masked."""
    return tl.load(ptr + (start + offs)[:, None] * stride_t + head_offset + cols[None, :],
                   mask=mask[:, None] & col_mask, other=0.0)


@triton.jit
def _score_grad(dw, s, sig, valid, inv_n):
    """``dS`` from ``dW`` through ``W = SiLU(S) / n``: SiLU'(s) = sig(s) (1 + s (1 - sig(s)))."""
    return tl.where(valid, dw * sig * (1.0 + s * (1.0 - sig)) * inv_n, 0.0)


@triton.jit
def _add_runs(table, ds, buckets, next_buckets, h, H):
    """``table[b, h] += sum of ds where buckets == b``, by runs along each row.

    ``buckets`` is -1 where ``ds`` is masked (and ``ds`` 0 there); ``next_buckets`` is each
    entry's right neighbour's bucket, -1 past the tile's last column. A run of bucket ``b``
    ending at column ``e`` and following one that ended at ``e'`` sums to ``P[e] - P[e']``,
    ``P`` the row's prefix sum: so every run end adds ``P`` to its own bucket and ``-P``
    to the next run's. Exact for any bucket pattern; bucket -1's runs are dropped.
    """
    prefix = tl.cumsum(ds, axis=1)
    ends = buckets != next_buckets
    tl.atomic_add(table + buckets * H + h, prefix, mask=ends & (buckets >= 0))
    tl.atomic_add(table + next_buckets * H + h, -prefix, mask=ends & (next_buckets >= 0))


@triton.jit
def _work_item(offsets, num_samples, search_steps, BLOCK: tl.constexpr):
    """This program's ``(sample, start, n, m0)``: rows ``start .. start + n``, tile rows from ``m0``.

    Program ``p`` belongs to the sample ``s`` with ``S(s) <= p < S(s + 1)``, ``S(s) =
    offsets[s] // BLOCK + s`` (strictly increasing, ``S(B) = T // BLOCK + B`` is the grid),
    found by ``search_steps`` halvings of ``[0, B)``; ``m0 >= n`` marks a spare slot.
    """
    p = tl.program_id(0)
    low = p * 0
    high = low + num_samples
    for _ in range(search_steps):
        middle = (low + high) // 2
        right = tl.load(offsets + middle) // BLOCK + middle <= p
        low = tl.where(right, middle, low)
        high = tl.where(right, high, middle)
    start = tl.load(offsets + low)
    n = (tl.load(offsets + low + 1) - start).to(tl.int32)
    m0 = (p - (start // BLOCK + low)).to(tl.int32) * BLOCK
    return low, start, n, m0


@triton.jit
def _forward_kernel(
    Q, K, V, OUT, offsets, times, pos_w, time_w, pos_thr, time_thr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    H, normalizer, pos_scale, time_scale, num_samples, search_steps,
    DQ: tl.constexpr, DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr, PRECISION: tl.constexpr,
):
    h = tl.program_id(1)
    _, start, n, m0 = _work_item(offsets, num_samples, search_steps, BLOCK)
    if m0 >= n:
        return
    inv_n = 1.0 / tl.where(normalizer > 0, normalizer, n).to(tl.float32)
    offs_m = m0 + tl.arange(0, BLOCK)
    mask_m = offs_m < n
    dq_range, dv_range = tl.arange(0, BLOCK_DQ), tl.arange(0, BLOCK_DV)
    q = _rows(Q, start, offs_m, mask_m, stride_qt, h * stride_qh, dq_range, (dq_range < DQ)[None, :])
    t_m = tl.load(times + start + offs_m, mask=mask_m, other=0)
    acc = tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32)
    for n0 in range(0, m0 + BLOCK, BLOCK):
        offs_n = n0 + tl.arange(0, BLOCK)
        mask_n = offs_n < n
        k = _rows(K, start, offs_n, mask_n, stride_kt, h * stride_kh, dq_range, (dq_range < DQ)[None, :])
        v = _rows(V, start, offs_n, mask_n, stride_vt, h * stride_vh, dv_range, (dv_range < DV)[None, :])
        t_n = tl.load(times + start + offs_n, mask=mask_n, other=0)
        valid = mask_m[:, None] & mask_n[None, :] & (offs_m[:, None] >= offs_n[None, :])
        pos_b, time_b = _tile_buckets(offs_m, offs_n, t_m, t_n, valid, pos_thr, time_thr,
                                      pos_scale, time_scale, NUM_POS, NUM_TIME)
        s = _scores(q, k, pos_b, time_b, pos_w, time_w, h, H, PRECISION)
        w = tl.where(valid, s * tl.sigmoid(s) * inv_n, 0.0)
        acc += tl.dot(w.to(v.dtype), v, out_dtype=tl.float32, input_precision=PRECISION)
    tl.store(OUT + (start + offs_m)[:, None] * stride_ot + h * stride_oh + dv_range[None, :],
             acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & (dv_range < DV)[None, :])


@triton.jit
def _backward_kernel(
    Q, K, V, DOUT, DQ_OUT, DK_OUT, DV_OUT, DPOS, DTIME,
    offsets, times, pos_w, time_w, pos_thr, time_thr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    H, normalizer, pos_scale, time_scale, num_samples, search_steps,
    DQ: tl.constexpr, DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr, PRECISION: tl.constexpr,
):
    h = tl.program_id(1)
    _, start, n, m0 = _work_item(offsets, num_samples, search_steps, BLOCK)
    if m0 >= n:
        return
    inv_n = 1.0 / tl.where(normalizer > 0, normalizer, n).to(tl.float32)
    dq_range, dv_range = tl.arange(0, BLOCK_DQ), tl.arange(0, BLOCK_DV)
    q_cols, v_cols = (dq_range < DQ)[None, :], (dv_range < DV)[None, :]
    # The gradient outputs are contiguous [T, H, D] buffers allocated by the wrapper.
    g_q_row, g_v_row = H * DQ, H * DV
    own = m0 + tl.arange(0, BLOCK)
    mask_own = own < n
    t_own = tl.load(times + start + own, mask=mask_own, other=0)
    # Each key column's right neighbour, for the runs of the bias gradients (_add_runs).
    after = own + 1
    mask_after = (after < n) & (tl.arange(0, BLOCK) < BLOCK - 1)
    t_after = tl.load(times + start + after, mask=mask_after, other=0)

    # Phase 1: this program's tile as keys -> dK, dV, bias-table gradients.
    k = _rows(K, start, own, mask_own, stride_kt, h * stride_kh, dq_range, q_cols)
    v = _rows(V, start, own, mask_own, stride_vt, h * stride_vh, dv_range, v_cols)
    dk = tl.zeros([BLOCK, BLOCK_DQ], dtype=tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32)
    for i0 in range(m0, n, BLOCK):
        offs_m = i0 + tl.arange(0, BLOCK)
        mask_m = offs_m < n
        q = _rows(Q, start, offs_m, mask_m, stride_qt, h * stride_qh, dq_range, q_cols)
        g = _rows(DOUT, start, offs_m, mask_m, stride_dot, h * stride_doh, dv_range, v_cols)
        t_m = tl.load(times + start + offs_m, mask=mask_m, other=0)
        valid = mask_m[:, None] & mask_own[None, :] & (offs_m[:, None] >= own[None, :])
        pos_b, time_b = _tile_buckets(offs_m, own, t_m, t_own, valid, pos_thr, time_thr,
                                      pos_scale, time_scale, NUM_POS, NUM_TIME)
        s = _scores(q, k, pos_b, time_b, pos_w, time_w, h, H, PRECISION)
        sig = tl.sigmoid(s)
        w = tl.where(valid, s * sig * inv_n, 0.0)
        dv += tl.dot(tl.trans(w.to(g.dtype)), g, out_dtype=tl.float32, input_precision=PRECISION)
        dw = tl.dot(g, tl.trans(v), out_dtype=tl.float32, input_precision=PRECISION)
        ds = _score_grad(dw, s, sig, valid, inv_n)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, out_dtype=tl.float32, input_precision=PRECISION)
        valid_after = mask_m[:, None] & mask_after[None, :] & (offs_m[:, None] >= after[None, :])
        pos_after, time_after = _tile_buckets(offs_m, after, t_m, t_after, valid_after, pos_thr, time_thr,
                                              pos_scale, time_scale, NUM_POS, NUM_TIME)
        pos_after, time_after = tl.where(valid_after, pos_after, -1), tl.where(valid_after, time_after, -1)
        _add_runs(DPOS, ds, tl.where(valid, pos_b, -1), pos_after, h, H)
        _add_runs(DTIME, ds, tl.where(valid, time_b, -1), time_after, h, H)
    tl.store(DK_OUT + (start + own)[:, None] * g_q_row + h * DQ + dq_range[None, :],
             dk.to(DK_OUT.dtype.element_ty), mask=mask_own[:, None] & q_cols)
    tl.store(DV_OUT + (start + own)[:, None] * g_v_row + h * DV + dv_range[None, :],
             dv.to(DV_OUT.dtype.element_ty), mask=mask_own[:, None] & v_cols)

    # Phase 2: this program's tile as queries -> dQ.
    q = _rows(Q, start, own, mask_own, stride_qt, h * stride_qh, dq_range, q_cols)
    g = _rows(DOUT, start, own, mask_own, stride_dot, h * stride_doh, dv_range, v_cols)
    dq = tl.zeros([BLOCK, BLOCK_DQ], dtype=tl.float32)
    for j0 in range(0, m0 + BLOCK, BLOCK):
        offs_n = j0 + tl.arange(0, BLOCK)
        mask_n = offs_n < n
        k = _rows(K, start, offs_n, mask_n, stride_kt, h * stride_kh, dq_range, q_cols)
        v = _rows(V, start, offs_n, mask_n, stride_vt, h * stride_vh, dv_range, v_cols)
        t_n = tl.load(times + start + offs_n, mask=mask_n, other=0)
        valid = mask_own[:, None] & mask_n[None, :] & (own[:, None] >= offs_n[None, :])
        pos_b, time_b = _tile_buckets(own, offs_n, t_own, t_n, valid, pos_thr, time_thr,
                                      pos_scale, time_scale, NUM_POS, NUM_TIME)
        s = _scores(q, k, pos_b, time_b, pos_w, time_w, h, H, PRECISION)
        sig = tl.sigmoid(s)
        dw = tl.dot(g, tl.trans(v), out_dtype=tl.float32, input_precision=PRECISION)
        ds = _score_grad(dw, s, sig, valid, inv_n)
        dq += tl.dot(ds.to(k.dtype), k, out_dtype=tl.float32, input_precision=PRECISION)
    tl.store(DQ_OUT + (start + own)[:, None] * g_q_row + h * DQ + dq_range[None, :],
             dq.to(DQ_OUT.dtype.element_ty), mask=mask_own[:, None] & q_cols)


@triton.jit
def _bucket_kernel(DIST, OUT, thresholds, scale, count, NUM_BUCKETS: tl.constexpr, BLOCK: tl.constexpr):
    """The kernels' bucketing alone, for testing it against ``log_bucket``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    distance = tl.load(DIST + offs, mask=mask, other=0)
    tl.store(OUT + offs, _bucket(distance, thresholds, scale, NUM_BUCKETS).to(tl.int64), mask=mask)


@triton.jit
def _work_item_kernel(offsets, OUT, num_samples, search_steps, BLOCK: tl.constexpr):
    """The kernels' work list alone: each slot's ``(sample, m0)``, ``m0 = -1`` for a spare slot."""
    sample, _, n, m0 = _work_item(offsets, num_samples, search_steps, BLOCK)
    p = tl.program_id(0)
    tl.store(OUT + 2 * p, sample.to(tl.int64))
    tl.store(OUT + 2 * p + 1, tl.where(m0 < n, m0, -1).to(tl.int64))


def _tuned(kernel, configs: list[tuple[int, int]], reset: list[str]):
    """``kernel`` autotuned over ``(BLOCK, num_warps)`` once per head widths; ``reset`` names the
    buffers it accumulates into, zeroed before each trial so the trials leave no sum behind."""
    return triton.autotune(
        configs=[triton.Config({"BLOCK": block}, num_warps=warps) for block, warps in configs],
        key=["DQ", "DV"], reset_to_zero=reset or None,
    )(kernel)


# Untimed on this project's machines (no GPU to tune on): a small grid around FlashAttention's 64x64.
_forward_tuned = _tuned(_forward_kernel, [(64, 4), (64, 8), (128, 8), (32, 4)], [])
_backward_tuned = _tuned(_backward_kernel, [(64, 4), (64, 8), (32, 4)], ["DPOS", "DTIME"])


def _search_steps(batch: int) -> int:
    """Halvings of ``[0, batch)`` that ``_work_item``'s search needs to reach one sample."""
    return max(batch - 1, 0).bit_length()


def _launch(kernel, tuned, block: int | None, total: int, batch: int, heads: int, *args, **meta) -> None:
    """One launch over ``(work slots, heads)`` (``_work_item``); ``block`` None autotunes."""
    if block is None and os.environ.get("TRITON_INTERPRET") == "1":
        block = INTERPRETED_BLOCK  # None: autotune here too (a test drives the tuner this way)
    search = (batch, _search_steps(batch))
    if block is None:
        tuned[lambda m: (total // m["BLOCK"] + batch, heads)](*args, *search, **meta)
    else:
        kernel[(total // block + batch, heads)](*args, *search, BLOCK=block, **meta)


def kernel_buckets(distance: torch.Tensor, num_buckets: int, max_distance: float) -> torch.Tensor:
    """Buckets of int64 ``distance >= 0`` as the attention kernels compute them."""
    distance = distance.to(torch.int64).contiguous()
    out = torch.empty_like(distance)
    block = 1024
    _bucket_kernel[(triton.cdiv(distance.numel(), block),)](
        distance, out, bucket_thresholds(num_buckets, max_distance, distance.device),
        bucket_scale(num_buckets, max_distance), distance.numel(), NUM_BUCKETS=num_buckets, BLOCK=block)
    return out


def work_items(offsets: torch.Tensor, block: int) -> torch.Tensor:
    """``[slots, 2]`` int64: each work slot's ``(sample, first tile row)`` as the attention kernels
    find them, first row -1 for a spare slot."""
    offsets = offsets.to(torch.int64).contiguous()
    batch = offsets.numel() - 1
    slots = int(offsets[-1]) // block + batch
    out = torch.empty(slots, 2, dtype=torch.int64, device=offsets.device)
    _work_item_kernel[(slots,)](offsets, out, batch, _search_steps(batch), BLOCK=block)
    return out


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[T, H * d]`` (any row stride, unit column stride) -> ``[T, H, d]`` view."""
    t = t.view(t.shape[0], heads, -1)
    return t if t.stride(-1) == 1 else t.contiguous()


class _JaggedHSTUAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, position_weight, time_weight, offsets, timestamps,
                spec: BiasSpec, block: int | None, precision: str):
        total, heads, dq = q.shape
        dv = v.shape[2]
        out = torch.empty(total, heads, dv, dtype=v.dtype, device=v.device)
        pos_thr = bucket_thresholds(spec.num_position_buckets, spec.max_position, q.device)
        time_thr = bucket_thresholds(spec.num_time_buckets, spec.max_time_gap, q.device)
        if total and offsets.numel() > 1:
            _launch(
                _forward_kernel, _forward_tuned, block, total, offsets.numel() - 1, heads,
                q, k, v, out, offsets, timestamps, position_weight, time_weight, pos_thr, time_thr,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                out.stride(0), out.stride(1),
                heads, spec.normalizer,
                bucket_scale(spec.num_position_buckets, spec.max_position),
                bucket_scale(spec.num_time_buckets, spec.max_time_gap),
                DQ=dq, DV=dv, BLOCK_DQ=max(16, triton.next_power_of_2(dq)),
                BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                NUM_POS=spec.num_position_buckets, NUM_TIME=spec.num_time_buckets, PRECISION=precision,
            )
        ctx.save_for_backward(q, k, v, position_weight, time_weight, offsets, timestamps, pos_thr, time_thr)
        ctx.spec, ctx.block, ctx.precision = spec, block, precision
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, position_weight, time_weight, offsets, timestamps, pos_thr, time_thr = ctx.saved_tensors
        spec, block = ctx.spec, ctx.block
        total, heads, dq = q.shape
        dv = v.shape[2]
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        grad_q = torch.empty(total, heads, dq, dtype=q.dtype, device=q.device)
        grad_k = torch.empty(total, heads, dq, dtype=k.dtype, device=k.device)
        grad_v = torch.empty(total, heads, dv, dtype=v.dtype, device=v.device)
        grad_pos = torch.zeros(position_weight.shape, dtype=torch.float32, device=q.device)
        grad_time = torch.zeros(time_weight.shape, dtype=torch.float32, device=q.device)
        if total and offsets.numel() > 1:
            _launch(
                _backward_kernel, _backward_tuned, block, total, offsets.numel() - 1, heads,
                q, k, v, grad_out, grad_q, grad_k, grad_v, grad_pos, grad_time,
                offsets, timestamps, position_weight, time_weight, pos_thr, time_thr,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                grad_out.stride(0), grad_out.stride(1),
                heads, spec.normalizer,
                bucket_scale(spec.num_position_buckets, spec.max_position),
                bucket_scale(spec.num_time_buckets, spec.max_time_gap),
                DQ=dq, DV=dv, BLOCK_DQ=max(16, triton.next_power_of_2(dq)),
                BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                NUM_POS=spec.num_position_buckets, NUM_TIME=spec.num_time_buckets, PRECISION=ctx.precision,
            )
        return (grad_q, grad_k, grad_v, grad_pos.to(position_weight.dtype), grad_time.to(time_weight.dtype),
                None, None, None, None, None)


def jagged_hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_weight: torch.Tensor, time_weight: torch.Tensor, spec: BiasSpec,
    block: int | None = None, precise: bool = False,
) -> torch.Tensor:
    """``A V`` of every sample over its own positions, ``[T, H * dv]`` in jagged order.

    ``q``, ``k`` ``[T, H * dq]`` and ``v`` ``[T, H * dv]`` (column views of one projection are
    fine: only the last dimension must be unit-stride); ``offsets`` ``[B+1]`` int64;
    ``timestamps`` ``[T]`` seconds; the bias tables ``[buckets, H]``; ``block``
    fixes the tile rows (tests) instead of autotuning them. fp32 dots run in TF32, as the
    trainer's matmuls do on GPUs; ``precise`` makes them full fp32 (slower; for checking).
    """
    heads = position_weight.shape[1]
    out = _JaggedHSTUAttention.apply(
        _heads(q, heads), _heads(k, heads), _heads(v, heads),
        position_weight.contiguous(), time_weight.contiguous(),
        offsets.to(torch.int64).contiguous(), timestamps.to(torch.int64).contiguous(),
        spec, block, "ieee" if precise and q.dtype == torch.float32 else "tf32",
    )
    return out.view(out.shape[0], -1)
