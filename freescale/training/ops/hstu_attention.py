"""Jagged HSTU attention in Triton: one launch per layer and direction, whatever the batch's lengths.

For every sample ``s`` (rows ``offsets[s]:offsets[s+1]``), head ``h`` and query
position ``i`` of it::

    out[i] = sum_{j <= i} SiLU(q_i . k_j + pos_w[pb(i - j), h] + time_w[tb(|t_i - t_j|), h]) / n * v_j

with ``pb``/``tb`` the log buckets of ``freescale.training.ops.relative_buckets`` and ``n``
the sample's length (or ``max_seq_len``). ``freescale.training.ops.hstu_attention_reference`` computes the
same numbers in PyTorch and is this kernel's reference; ``freescale.training.ops.attention.hstu_attention`` runs
either (``tests/training/test_hstu_kernel.py`` runs both under ``TRITON_INTERPRET=1``).

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
stored); only the diagonal tile is masked. Backward, one launch, two phases per
program (as FlashAttention-2's Triton backward): phase 1 owns key tile ``m`` and
accumulates ``dK`` and ``dV`` over the query tiles at and below the diagonal; phase 2
owns query tile ``m`` and accumulates ``dQ`` and the bias-table gradients (phase 1
already holds four tiles in registers). With ``w = SiLU(s) / n``::

    dV_j += w_ij dO_i        dW_ij = dO_i . v_j
    dS_ij = dW_ij * SiLU'(s_ij) / n          SiLU'(s) = sig(s) (1 + s (1 - sig(s)))
    dK_j += dS_ij q_i        dQ_i += dS_ij k_j
    d pos_w[pb(i-j), h] += dS_ij             d time_w[tb(.), h] += dS_ij

``q``, ``k`` and ``v`` come in fp32 or bf16 (``training.precision``; ``kernel_dtype``): the dots take
them as they are and accumulate in fp32; scores, biases, SiLU and every accumulator are fp32, and
``W`` and ``dS`` are rounded to the operands' dtype only to enter a dot.

Per tile entry the bias is most of the work (the dots run on tensor cores), so it is
kept cheap: the position bucket is read from a per-distance table, the time bucket
is a float guess and one threshold load, gaps are 32-bit when a tile's timestamps
span less than 2^31 s, and ``log2`` and the sigmoid use the SFU's one-instruction
approximations (errors ~1e-7, below TF32's). ``benchmarks/kernel_static.py`` counts
what each costs in the compiled sm_90 code.

The bias gradients are a scatter into tiny tables (``_add_runs``). Along a row of a
tile the bucket changes only where the distance or gap crosses a threshold, so the
row's ``dS`` falls into a few runs of one bucket each; a prefix sum along the row
gives every run's total as the difference of the prefix at its two ends, and only
those ends are added to the table (relaxed fp32 atomics, a few per row, spread over
``BIAS_STRIPES`` copies that the wrapper sums). The atomics' order makes these two
gradients non-deterministic in the last bits on a GPU, which the other five are not.

Import cost: triton is imported when this module is; the entry (``freescale.training.ops.attention``)
imports it only when the Triton kernel is asked for. ``TRITON_INTERPRET=1`` must be set before
the import to run the kernels on CPU tensors (tests).
"""
from __future__ import annotations

import functools
import math
import os
import typing
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from freescale.training.ops.hstu_attention_reference import BiasSpec
from freescale.training.ops.kernel_limits import INT32_MAX, Backward, POSITION_TABLE_LIMIT, position_table_too_long, time_gaps_too_wide
from freescale.training.ops.relative_buckets import bucket_by_thresholds, bucket_scale, bucket_thresholds, last_finite_threshold


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


INTERPRETED_BLOCK: int | None = 16
"""Tile rows under the interpreter, which runs every program in Python: tl.dot's minimum keeps the CPU
tests quick. Compiled kernels pick their tile by autotuning (``_tuned``)."""


COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
"""False under the interpreter, which cannot run the inline PTX of ``_log2`` and ``_sigmoid``."""


@triton.jit
def _log2(x):
    """``log2`` by the SFU's approximation (one instruction, ~2^-22 relative error): ``tl.log2``
    compiles to a ~20-instruction accurate routine, per tile entry. The interpreter has no PTX."""
    if COMPILED:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _sigmoid(x):
    """``1 / (1 + 2^(-x log2 e))`` by the SFU's approximate ``ex2`` and ``rcp`` (4 instructions; ``tl.sigmoid``
    compiles to ~11 with denormal and overflow handling that SiLU attention does not need)."""
    if COMPILED:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t; mul.ftz.f32 t, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 t, t; "
            "add.ftz.f32 t, t, 0f3F800000; rcp.approx.ftz.f32 $0, t; }",
            "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.sigmoid(x)


@triton.jit
def _time_bucket(gap, thresholds, scale, NUM_BUCKETS: tl.constexpr):
    """Bucket of int32 ``gap >= 0`` (clamped by ``_clamped_gap``): a float guess lowered by 0.01 of a
    bucket, so it is the true bucket or the one below (float32 ``log`` differs from the CPU formula
    the thresholds come from by ~1e-5 of a bucket), then one load of the next integer threshold decides."""
    guess = (_log2(gap.to(tl.float32) + 1.0) * scale - 0.01).to(tl.int32)
    guess = tl.maximum(tl.minimum(guess, NUM_BUCKETS - 2), 0)
    return guess + (gap >= tl.load(thresholds + guess + 1)).to(tl.int32)


@triton.jit
def _clamped_gap(t_m, t_n, gap_limit):
    """``min(|t_m - t_n|, gap_limit)`` as int32 ``[rows, cols]`` from int64 timestamp vectors; past
    ``gap_limit`` (the last finite threshold) every gap is in one bucket, so the clamp changes none.

    When the tile's timestamps span less than 2^31 s (always, for real histories), the gaps are
    taken in 32-bit arithmetic from the tile's earliest time (int64 compares and selects cost
    several instructions each); the 64-bit path keeps any other input exact."""
    lo = tl.minimum(tl.min(t_m, axis=0), tl.min(t_n, axis=0))
    span = tl.maximum(tl.max(t_m, axis=0), tl.max(t_n, axis=0)) - lo
    if (span >= 0) & (span <= 2147483647):  # negative: the span overflowed int64
        gap = (t_m - lo).to(tl.int32)[:, None] - (t_n - lo).to(tl.int32)[None, :]
        gap = tl.minimum(tl.where(gap < 0, -gap, gap), gap_limit)
    else:
        wide = t_m[:, None] - t_n[None, :]
        gap = tl.minimum(tl.maximum(wide, -gap_limit), gap_limit).to(tl.int32)
        gap = tl.where(gap < 0, -gap, gap)
    return gap


@triton.jit
def _position_bucket(distance, lut, pos_limit):
    """Bucket of ``i - j`` read from the per-distance table (``kernel_tables``); distances past
    ``pos_limit`` share its bucket, negative ones (masked by the caller) read entry 0."""
    return tl.load(lut + tl.minimum(tl.maximum(distance, 0), pos_limit))


@triton.jit
def _tile(q, k, rows, cols, t_m, t_n, h, H, pos_w, time_w, pos_lut, time_thr, time_scale, pos_limit, gap_limit,
          NUM_TIME: tl.constexpr, PRECISION: tl.constexpr):
    """One tile's scores ``q k^T`` plus both biases (fp32 ``[BLOCK, BLOCK]``) and its two bucket tiles."""
    pos_b = _position_bucket(rows[:, None] - cols[None, :], pos_lut, pos_limit)
    time_b = _time_bucket(_clamped_gap(t_m, t_n, gap_limit), time_thr, time_scale, NUM_TIME)
    s = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision=PRECISION)
    s += tl.load(pos_w + pos_b * H + h).to(tl.float32)
    s += tl.load(time_w + time_b * H + h).to(tl.float32)
    return s, pos_b, time_b


@triton.jit
def _score_grad(dw, s, sig, inv_n):
    """``dS`` from ``dW`` through ``W = SiLU(S) / n``: SiLU'(s) = sig(s) (1 + s (1 - sig(s)))."""
    return dw * sig * (1.0 + s * (1.0 - sig)) * inv_n


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
    # Relaxed: nothing in this launch reads the sums, so the default acq_rel's fence per add
    # (a GPU-wide MEMBAR for each of a thread's dozens of adds per tile) buys nothing.
    tl.atomic_add(table + buckets * H + h, prefix, mask=ends & (buckets >= 0), sem="relaxed")
    tl.atomic_add(table + next_buckets * H + h, -prefix, mask=ends & (next_buckets >= 0), sem="relaxed")


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
def _key_rows(k_base, v_base, t_base, cols, n, stride_kt, stride_vt, DQ: tl.constexpr, DV: tl.constexpr,
              BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr, DIAGONAL: tl.constexpr):
    """K, V and timestamps of key rows ``cols``. Off the diagonal every key is in the sample, so
    nothing is masked; on it, keys past the sample read 0 (and their sample's last timestamp)."""
    dq_range, dv_range = tl.arange(0, BLOCK_DQ), tl.arange(0, BLOCK_DV)
    if DIAGONAL:
        in_sample = cols < n
        k = tl.load(k_base + cols[:, None] * stride_kt + dq_range[None, :],
                    mask=in_sample[:, None] & (dq_range < DQ)[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + dv_range[None, :],
                    mask=in_sample[:, None] & (dv_range < DV)[None, :], other=0.0)
        t_n = tl.load(t_base + tl.minimum(cols, n - 1))
    else:
        k = tl.load(k_base + cols[:, None] * stride_kt + dq_range[None, :], mask=(dq_range < DQ)[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + dv_range[None, :], mask=(dv_range < DV)[None, :], other=0.0)
        t_n = tl.load(t_base + cols)
    return k, v, t_n


@triton.jit
def _forward_tile(acc, q, k_base, v_base, rows, n0, t_m, t_base, h, H, n, inv_n, stride_kt, stride_vt,
                  pos_w, time_w, pos_lut, time_thr, time_scale, pos_limit, gap_limit,
                  DQ: tl.constexpr, DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK: tl.constexpr, NUM_TIME: tl.constexpr, PRECISION: tl.constexpr, DIAGONAL: tl.constexpr):
    """``acc += W V`` over key tile ``n0`` (masked on the diagonal only); query rows past the
    sample are garbage nobody stores."""
    cols = n0 + tl.arange(0, BLOCK)
    k, v, t_n = _key_rows(k_base, v_base, t_base, cols, n, stride_kt, stride_vt, DQ, DV, BLOCK_DQ, BLOCK_DV, DIAGONAL)
    s, _, _ = _tile(q, k, rows, cols, t_m, t_n, h, H, pos_w, time_w, pos_lut, time_thr, time_scale,
                    pos_limit, gap_limit, NUM_TIME, PRECISION)
    w = s * _sigmoid(s) * inv_n
    if DIAGONAL:
        w = tl.where(rows[:, None] >= cols[None, :], w, 0.0)
    return acc + tl.dot(w.to(v.dtype), v, out_dtype=tl.float32, input_precision=PRECISION)


@triton.jit
def _forward_kernel(
    Q, K, V, OUT, offsets, times, pos_w, time_w, pos_lut, time_thr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    H, normalizer, time_scale, pos_limit, gap_limit, num_samples, search_steps,
    DQ: tl.constexpr, DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, NUM_TIME: tl.constexpr, PRECISION: tl.constexpr,
):
    h = tl.program_id(1)
    _, start, n, m0 = _work_item(offsets, num_samples, search_steps, BLOCK)
    if m0 >= n:
        return
    inv_n = 1.0 / tl.where(normalizer > 0, normalizer, n).to(tl.float32)
    # 64-bit row offsets once per program; within a sample, 32-bit arithmetic.
    q_base = Q + start * stride_qt + h * stride_qh
    k_base = K + start * stride_kt + h * stride_kh
    v_base = V + start * stride_vt + h * stride_vh
    t_base = times + start
    rows = m0 + tl.arange(0, BLOCK)
    in_sample = rows < n
    dq_range, dv_range = tl.arange(0, BLOCK_DQ), tl.arange(0, BLOCK_DV)
    q = tl.load(q_base + rows[:, None] * stride_qt + dq_range[None, :],
                mask=in_sample[:, None] & (dq_range < DQ)[None, :], other=0.0)
    # Rows past the sample read its last timestamp (not 0), which keeps each tile's time span
    # that of the sample, so _clamped_gap's 32-bit path holds there too.
    t_m = tl.load(t_base + tl.minimum(rows, n - 1))
    acc = tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32)
    for n0 in range(0, m0, BLOCK):
        acc = _forward_tile(acc, q, k_base, v_base, rows, n0, t_m, t_base, h, H, n, inv_n, stride_kt, stride_vt,
                            pos_w, time_w, pos_lut, time_thr, time_scale, pos_limit, gap_limit,
                            DQ, DV, BLOCK_DQ, BLOCK_DV, BLOCK, NUM_TIME, PRECISION, False)
    acc = _forward_tile(acc, q, k_base, v_base, rows, m0, t_m, t_base, h, H, n, inv_n, stride_kt, stride_vt,
                        pos_w, time_w, pos_lut, time_thr, time_scale, pos_limit, gap_limit,
                        DQ, DV, BLOCK_DQ, BLOCK_DV, BLOCK, NUM_TIME, PRECISION, True)
    tl.store(OUT + (start + rows)[:, None] * stride_ot + h * stride_oh + dv_range[None, :],
             acc.to(OUT.dtype.element_ty), mask=in_sample[:, None] & (dv_range < DV)[None, :])


@triton.jit
def _query_rows(q_base, g_base, t_base, rows, n, stride_qt, stride_gt, DQ: tl.constexpr, DV: tl.constexpr,
                BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Q, dO and timestamps of query rows ``rows``; rows past the sample read 0 (their sample's last
    timestamp), so their ``dS`` is exactly 0 without a mask."""
    in_sample = rows < n
    dq_range, dv_range = tl.arange(0, BLOCK_DQ), tl.arange(0, BLOCK_DV)
    q = tl.load(q_base + rows[:, None] * stride_qt + dq_range[None, :],
                mask=in_sample[:, None] & (dq_range < DQ)[None, :], other=0.0)
    g = tl.load(g_base + rows[:, None] * stride_gt + dv_range[None, :],
                mask=in_sample[:, None] & (dv_range < DV)[None, :], other=0.0)
    t_m = tl.load(t_base + tl.minimum(rows, n - 1))
    return q, g, t_m


@triton.jit
def _bias_runs(grad_pos, grad_time, ds, rows, cols, t_m, pos_b, time_b, t_base, h, H, n, pos_lut, time_thr,
               time_scale, pos_limit, gap_limit, BLOCK: tl.constexpr, NUM_TIME: tl.constexpr,
               DIAGONAL: tl.constexpr):
    """Both bias tables' gradients from one tile's ``dS`` (masked on the diagonal by the caller), by
    runs (``_add_runs``): each entry against its right neighbour (-1: none). Query rows past the
    sample have ``dS = 0`` and are left out of the runs."""
    after = cols + 1
    pos_next = _position_bucket(rows[:, None] - after[None, :], pos_lut, pos_limit)
    time_next = _time_bucket(_clamped_gap(t_m, tl.load(t_base + tl.minimum(after, n - 1)), gap_limit),
                             time_thr, time_scale, NUM_TIME)
    rows_in = rows < n
    has_next = (tl.arange(0, BLOCK) < BLOCK - 1)[None, :] & rows_in[:, None]
    if DIAGONAL:
        counted = (rows[:, None] >= cols[None, :]) & rows_in[:, None]
        has_next = has_next & (rows[:, None] >= after[None, :])
    else:
        counted = rows_in[:, None] & (cols >= 0)[None, :]
    _add_runs(grad_pos, ds, tl.where(counted, pos_b, -1), tl.where(has_next, pos_next, -1), h, H)
    _add_runs(grad_time, ds, tl.where(counted, time_b, -1), tl.where(has_next, time_next, -1), h, H)


@triton.jit
def _key_tile_grads(dk, dv, k, v, own, i0, q_base, g_base, t_base, t_own, h, H, n, inv_n, stride_qt, stride_gt,
                    pos_w, time_w, pos_lut, time_thr, time_scale, pos_limit, gap_limit, grad_pos, grad_time, DQ_ACC,
                    start, DQ: tl.constexpr, DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK: tl.constexpr, NUM_TIME: tl.constexpr, PRECISION: tl.constexpr, DIAGONAL: tl.constexpr,
                    ATOMIC_DQ: tl.constexpr):
    """Query tile ``i0`` against this program's key tile: ``dK`` and ``dV``; with ``ATOMIC_DQ`` (the
    one-pass backward) also ``dQ``, by relaxed fp32 atomic adds into ``DQ_ACC``, and both bias
    tables, from the same score tile. The key tile is the sample's last, partial one only on the
    diagonal, where the causal mask covers the keys past the sample."""
    rows = i0 + tl.arange(0, BLOCK)
    q, g, t_m = _query_rows(q_base, g_base, t_base, rows, n, stride_qt, stride_gt, DQ, DV, BLOCK_DQ, BLOCK_DV)
    s, pos_b, time_b = _tile(q, k, rows, own, t_m, t_own, h, H, pos_w, time_w, pos_lut, time_thr, time_scale,
                             pos_limit, gap_limit, NUM_TIME, PRECISION)
    sig = _sigmoid(s)
    w = s * sig * inv_n
    ds = _score_grad(tl.dot(g, tl.trans(v), out_dtype=tl.float32, input_precision=PRECISION), s, sig, inv_n)
    if DIAGONAL:
        causal = rows[:, None] >= own[None, :]
        w = tl.where(causal, w, 0.0)
        ds = tl.where(causal, ds, 0.0)
    if ATOMIC_DQ:
        _bias_runs(grad_pos, grad_time, ds, rows, own, t_m, pos_b, time_b, t_base, h, H, n, pos_lut, time_thr,
                   time_scale, pos_limit, gap_limit, BLOCK, NUM_TIME, DIAGONAL)
        dq_range = tl.arange(0, BLOCK_DQ)
        tl.atomic_add(DQ_ACC + ((start + rows) * H + h)[:, None] * DQ + dq_range[None, :],
                      tl.dot(ds.to(k.dtype), k, out_dtype=tl.float32, input_precision=PRECISION),
                      mask=(rows < n)[:, None] & (dq_range < DQ)[None, :], sem="relaxed")
    dv += tl.dot(tl.trans(w.to(g.dtype)), g, out_dtype=tl.float32, input_precision=PRECISION)
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, out_dtype=tl.float32, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _query_tile_grads(dq, q, g, own, t_own, j0, k_base, v_base, t_base, h, H, n, inv_n, stride_kt, stride_vt,
                      pos_w, time_w, pos_lut, time_thr, time_scale, pos_limit, gap_limit, grad_pos, grad_time,
                      DQ: tl.constexpr, DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
                      BLOCK: tl.constexpr, NUM_TIME: tl.constexpr, PRECISION: tl.constexpr,
                      DIAGONAL: tl.constexpr):
    """Key tile ``j0`` against this program's query tile: ``dQ`` and both bias tables (here, not
    with ``dK``/``dV``, where four accumulated tiles already hold most registers)."""
    cols = j0 + tl.arange(0, BLOCK)
    k, v, t_n = _key_rows(k_base, v_base, t_base, cols, n, stride_kt, stride_vt, DQ, DV, BLOCK_DQ, BLOCK_DV, DIAGONAL)
    s, pos_b, time_b = _tile(q, k, own, cols, t_own, t_n, h, H, pos_w, time_w, pos_lut, time_thr, time_scale,
                             pos_limit, gap_limit, NUM_TIME, PRECISION)
    ds = _score_grad(tl.dot(g, tl.trans(v), out_dtype=tl.float32, input_precision=PRECISION), s, _sigmoid(s),
                     inv_n)
    if DIAGONAL:
        ds = tl.where(own[:, None] >= cols[None, :], ds, 0.0)
    _bias_runs(grad_pos, grad_time, ds, own, cols, t_own, pos_b, time_b, t_base, h, H, n, pos_lut, time_thr,
               time_scale, pos_limit, gap_limit, BLOCK, NUM_TIME, DIAGONAL)
    return dq + tl.dot(ds.to(k.dtype), k, out_dtype=tl.float32, input_precision=PRECISION)


@triton.jit
def _backward_kernel(
    Q, K, V, DOUT, DQ_OUT, DK_OUT, DV_OUT, DBIAS,
    offsets, times, pos_w, time_w, pos_lut, time_thr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
    H, normalizer, time_scale, pos_limit, gap_limit, num_samples, search_steps,
    DQ: tl.constexpr, DV: tl.constexpr, BLOCK_DQ: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, NUM_POS: tl.constexpr, NUM_TIME: tl.constexpr, PRECISION: tl.constexpr,
    STRIPES: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    h = tl.program_id(1)
    _, start, n, m0 = _work_item(offsets, num_samples, search_steps, BLOCK)
    if m0 >= n:
        return
    inv_n = 1.0 / tl.where(normalizer > 0, normalizer, n).to(tl.float32)
    q_base = Q + start * stride_qt + h * stride_qh
    k_base = K + start * stride_kt + h * stride_kh
    v_base = V + start * stride_vt + h * stride_vh
    g_base = DOUT + start * stride_gt + h * stride_gh
    t_base = times + start
    # Both bias tables' gradients, in one of STRIPES copies: programs spread their atomics over
    # the copies instead of all meeting on the few entries far distances and gaps fall in.
    grad_pos = DBIAS + (tl.program_id(0) % STRIPES) * (NUM_POS + NUM_TIME) * H
    grad_time = grad_pos + NUM_POS * H
    dq_range, dv_range = tl.arange(0, BLOCK_DQ), tl.arange(0, BLOCK_DV)
    q_cols, v_cols = (dq_range < DQ)[None, :], (dv_range < DV)[None, :]
    own = m0 + tl.arange(0, BLOCK)
    in_sample = own < n
    t_own = tl.load(t_base + tl.minimum(own, n - 1))

    # Phase 1: this program's tile as keys -> dK, dV (ATOMIC_DQ: and, by atomics from the same score
    # tiles, dQ and the bias tables; no phase 2).
    k = tl.load(k_base + own[:, None] * stride_kt + dq_range[None, :], mask=in_sample[:, None] & q_cols, other=0.0)
    v = tl.load(v_base + own[:, None] * stride_vt + dv_range[None, :], mask=in_sample[:, None] & v_cols, other=0.0)
    dk = tl.zeros([BLOCK, BLOCK_DQ], dtype=tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32)
    dk, dv = _key_tile_grads(dk, dv, k, v, own, m0, q_base, g_base, t_base, t_own, h, H, n, inv_n, stride_qt,
                             stride_gt, pos_w, time_w, pos_lut, time_thr, time_scale, pos_limit, gap_limit,
                             grad_pos, grad_time, DQ_OUT, start, DQ, DV, BLOCK_DQ, BLOCK_DV, BLOCK, NUM_TIME,
                             PRECISION, True, ATOMIC_DQ)
    for i0 in range(m0 + BLOCK, n, BLOCK):
        dk, dv = _key_tile_grads(dk, dv, k, v, own, i0, q_base, g_base, t_base, t_own, h, H, n, inv_n, stride_qt,
                                 stride_gt, pos_w, time_w, pos_lut, time_thr, time_scale, pos_limit, gap_limit,
                                 grad_pos, grad_time, DQ_OUT, start, DQ, DV, BLOCK_DQ, BLOCK_DV, BLOCK, NUM_TIME,
                                 PRECISION, False, ATOMIC_DQ)
    # The gradient outputs are contiguous [T, H, D] buffers allocated by the wrapper.
    tl.store(DK_OUT + ((start + own) * H + h)[:, None] * DQ + dq_range[None, :],
             dk.to(DK_OUT.dtype.element_ty), mask=in_sample[:, None] & q_cols)
    tl.store(DV_OUT + ((start + own) * H + h)[:, None] * DV + dv_range[None, :],
             dv.to(DV_OUT.dtype.element_ty), mask=in_sample[:, None] & v_cols)

    if ATOMIC_DQ:
        return
    # Phase 2: this program's tile as queries -> dQ, bias-table gradients.
    q, g, _ = _query_rows(q_base, g_base, t_base, own, n, stride_qt, stride_gt, DQ, DV, BLOCK_DQ, BLOCK_DV)
    dq = tl.zeros([BLOCK, BLOCK_DQ], dtype=tl.float32)
    for j0 in range(0, m0, BLOCK):
        dq = _query_tile_grads(dq, q, g, own, t_own, j0, k_base, v_base, t_base, h, H, n, inv_n, stride_kt,
                               stride_vt, pos_w, time_w, pos_lut, time_thr, time_scale, pos_limit, gap_limit,
                               grad_pos, grad_time, DQ, DV, BLOCK_DQ, BLOCK_DV, BLOCK, NUM_TIME, PRECISION, False)
    dq = _query_tile_grads(dq, q, g, own, t_own, m0, k_base, v_base, t_base, h, H, n, inv_n, stride_kt,
                           stride_vt, pos_w, time_w, pos_lut, time_thr, time_scale, pos_limit, gap_limit,
                           grad_pos, grad_time, DQ, DV, BLOCK_DQ, BLOCK_DV, BLOCK, NUM_TIME, PRECISION, True)
    tl.store(DQ_OUT + ((start + own) * H + h)[:, None] * DQ + dq_range[None, :],
             dq.to(DQ_OUT.dtype.element_ty), mask=in_sample[:, None] & q_cols)


@triton.jit
def _bucket_kernel(DIST, OUT, table, scale, limit, count, POSITION: tl.constexpr, NUM_BUCKETS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """The kernels' bucketing alone (``POSITION``: the per-distance table; else the time guess
    against thresholds), for testing it against ``log_bucket``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    distance = tl.load(DIST + offs, mask=mask, other=0)
    if POSITION:
        bucket = _position_bucket(distance.to(tl.int32), table, limit)
    else:
        bucket = _time_bucket(tl.reshape(_clamped_gap(distance, tl.zeros([1], tl.int64), limit), [BLOCK]), table, scale,
                              NUM_BUCKETS)
    tl.store(OUT + offs, bucket.to(tl.int64), mask=mask)


@triton.jit
def _work_item_kernel(offsets, OUT, num_samples, search_steps, BLOCK: tl.constexpr):
    """The kernels' work list alone: each slot's ``(sample, m0)``, ``m0 = -1`` for a spare slot."""
    sample, _, n, m0 = _work_item(offsets, num_samples, search_steps, BLOCK)
    p = tl.program_id(0)
    tl.store(OUT + 2 * p, sample.to(tl.int64))
    tl.store(OUT + 2 * p + 1, tl.where(m0 < n, m0, -1).to(tl.int64))


def _tuned(kernel, configs: list[tuple[int, int, int]], reset: list[str], key: tuple[str, ...] = ()):
    """``kernel`` autotuned over ``(BLOCK, num_warps, num_stages)`` once per head widths (and ``key``'s
    other arguments); ``reset`` names the buffers it accumulates into, zeroed before each trial so the
    trials leave no sum behind."""
    return triton.autotune(
        configs=[triton.Config({"BLOCK": block}, num_warps=warps, num_stages=stages)
                 for block, warps, stages in configs],
        key=["DQ", "DV", *key], reset_to_zero=reset or None,
    )(kernel)


# Chosen by what sm_90 compiles them to, not by timing (no GPU to tune on; benchmarks/kernel_static.py,
# docs/results/kernel_static.md): 128-row tiles need more shared memory than an SM has, and the
# backward's 64-row tiles on 4 warps spill hundreds of registers per tile, so neither is offered.
_forward_tuned = _tuned(_forward_kernel, [(64, 4, 2), (64, 8, 2), (32, 4, 2), (64, 4, 1)], [])
_backward_tuned = _tuned(_backward_kernel, [(32, 4, 2), (64, 8, 2), (64, 8, 1), (32, 2, 2)], ["DBIAS", "DQ_OUT"],
                         key=("ATOMIC_DQ",))

BIAS_STRIPES = 16
"""Copies of the bias-table gradients the backward's programs spread their atomics over."""


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


@dataclass(frozen=True)
class KernelTables:
    """The bucket definitions (``freescale.training.ops.relative_buckets``) in the form the kernels read them."""

    position: torch.Tensor
    """``[pos_limit + 1]`` int32: the bucket of each distance ``i - j``."""
    pos_limit: int
    """The last position threshold: every longer distance is in its bucket."""
    time_thresholds: torch.Tensor
    """``[num_time_buckets + 1]`` int32 thresholds; ``INT32_MAX`` for a bucket no gap reaches."""
    gap_limit: int
    """The last finite time threshold: the kernels clamp gaps to it, which changes no bucket."""
    time_scale: float


@functools.lru_cache(maxsize=32)
def kernel_tables(spec: BiasSpec, device: torch.device) -> KernelTables:
    """Built once per spec and device and never written to (a copy per layer would be a host-to-device
    copy per layer, which waits for the GPU). The trainer's config check refuses the same limits
    before any rank starts (``freescale.training.model.attention_kernel``); this refusal is for direct callers."""
    if position_table_too_long(spec.num_position_buckets, spec.max_position):
        raise ValueError(f"max_position {spec.max_position} needs a position table of more than "
                         f"{POSITION_TABLE_LIMIT + 1} entries, the kernel's limit")
    if time_gaps_too_wide(spec.num_time_buckets, spec.max_time_gap):
        raise ValueError(f"max_time_gap {spec.max_time_gap} s puts a time bucket past 2^31 s, "
                         "beyond the kernel's 32-bit gaps")
    pos_limit = last_finite_threshold(spec.num_position_buckets, spec.max_position)
    gap_limit = last_finite_threshold(spec.num_time_buckets, spec.max_time_gap)
    time = bucket_thresholds(spec.num_time_buckets, spec.max_time_gap)
    return KernelTables(
        position=bucket_by_thresholds(torch.arange(pos_limit + 1), spec.num_position_buckets, spec.max_position)
        .to(torch.int32).to(device),
        pos_limit=pos_limit,
        time_thresholds=time.clamp(max=INT32_MAX).to(torch.int32).to(device),
        gap_limit=gap_limit,
        time_scale=bucket_scale(spec.num_time_buckets, spec.max_time_gap) * math.log(2.0),  # per log2 unit
    )


def kernel_buckets(distance: torch.Tensor, num_buckets: int, max_distance: float, position: bool) -> torch.Tensor:
    """Buckets of int64 ``distance >= 0`` as the attention kernels compute them: a position
    (``i - j``, from the per-distance table) or a time gap (a guess, then the thresholds)."""
    distance = distance.to(torch.int64).contiguous()
    out = torch.empty_like(distance)
    # The other table of the pair is a one-bucket stand-in.
    spec = (BiasSpec(num_buckets, max_distance, 1, 1, normalizer=0) if position
            else BiasSpec(1, 1, num_buckets, max_distance, normalizer=0))
    tables = kernel_tables(spec, distance.device)
    table, limit = ((tables.position, tables.pos_limit) if position
                    else (tables.time_thresholds, tables.gap_limit))
    block = 1024
    _bucket_kernel[(triton.cdiv(distance.numel(), block),)](
        distance, out, table, tables.time_scale, limit, distance.numel(),
        POSITION=position, NUM_BUCKETS=num_buckets, BLOCK=block)
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
                spec: BiasSpec, block: int | None, precision: str, backward: Backward):
        total, heads, dq = q.shape
        dv = v.shape[2]
        out = torch.empty(total, heads, dv, dtype=v.dtype, device=v.device)
        tables = kernel_tables(spec, q.device)
        if total and offsets.numel() > 1:
            _launch(
                _forward_kernel, _forward_tuned, block, total, offsets.numel() - 1, heads,
                q, k, v, out, offsets, timestamps, position_weight, time_weight, tables.position,
                tables.time_thresholds,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                out.stride(0), out.stride(1),
                heads, spec.normalizer, tables.time_scale, tables.pos_limit, tables.gap_limit,
                DQ=dq, DV=dv, BLOCK_DQ=max(16, triton.next_power_of_2(dq)),
                BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                NUM_TIME=spec.num_time_buckets, PRECISION=precision,
            )
        ctx.save_for_backward(q, k, v, position_weight, time_weight, offsets, timestamps)
        ctx.spec, ctx.block, ctx.precision, ctx.atomic_dq = spec, block, precision, backward == "atomic_dq"
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, position_weight, time_weight, offsets, timestamps = ctx.saved_tensors
        spec, block = ctx.spec, ctx.block
        total, heads, dq = q.shape
        dv = v.shape[2]
        tables = kernel_tables(spec, q.device)
        # tl.dot takes two operands of one dtype: dO meets V in dO V^T.
        grad_out = grad_out.to(v.dtype)
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        # atomic_dq adds into fp32 zeros (cast below); two_phase stores each row once, in q's dtype
        grad_q = (torch.zeros(total, heads, dq, dtype=torch.float32, device=q.device) if ctx.atomic_dq
                  else torch.empty(total, heads, dq, dtype=q.dtype, device=q.device))
        grad_k = torch.empty(total, heads, dq, dtype=k.dtype, device=k.device)
        grad_v = torch.empty(total, heads, dv, dtype=v.dtype, device=v.device)
        num_pos = spec.num_position_buckets
        grad_bias = torch.zeros(BIAS_STRIPES, num_pos + spec.num_time_buckets, heads, dtype=torch.float32,
                                device=q.device)
        if total and offsets.numel() > 1:
            _launch(
                _backward_kernel, _backward_tuned, block, total, offsets.numel() - 1, heads,
                q, k, v, grad_out, grad_q, grad_k, grad_v, grad_bias,
                offsets, timestamps, position_weight, time_weight, tables.position, tables.time_thresholds,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                grad_out.stride(0), grad_out.stride(1),
                heads, spec.normalizer, tables.time_scale, tables.pos_limit, tables.gap_limit,
                DQ=dq, DV=dv, BLOCK_DQ=max(16, triton.next_power_of_2(dq)),
                BLOCK_DV=max(16, triton.next_power_of_2(dv)),
                NUM_POS=num_pos, NUM_TIME=spec.num_time_buckets, PRECISION=ctx.precision, STRIPES=BIAS_STRIPES,
                ATOMIC_DQ=ctx.atomic_dq,
            )
        grad_bias = grad_bias.sum(0)
        return (grad_q.to(q.dtype), grad_k, grad_v, grad_bias[:num_pos].to(position_weight.dtype),
                grad_bias[num_pos:].to(time_weight.dtype), None, None, None, None, None, None)


KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""What ``q``, ``k`` and ``v`` may be computed in: the dots' operands (and ``A V``, ``dQ``, ``dK``,
``dV``) in that dtype, every score, bias, weight and accumulator in fp32."""


def kernel_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
    """The dtype ``jagged_hstu_attention`` computes ``q``, ``k``, ``v`` in: under autocast on their
    device, autocast's (as a matmul there would); else the three's common dtype. ``ValueError``
    for a dtype the kernels do not take, and for bf16 under the Triton interpreter, whose ``tl.dot``
    returns garbage for bf16 operands rather than failing (triton 3.6: a 16 x 16 product off by 1e10;
    its loads, stores and casts of bf16 are right)."""
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"the HSTU attention kernel takes q, k, v in {' or '.join(map(str, KERNEL_DTYPES))}, "
                         f"not {dtype}")
    if dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1":
        raise ValueError(f"the Triton interpreter (TRITON_INTERPRET=1) cannot run the HSTU attention kernel in "
                         f"{dtype}: its tl.dot gives wrong numbers for bf16 operands; use fp32 there, or a CUDA GPU")
    return dtype


def jagged_hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
    position_weight: torch.Tensor, time_weight: torch.Tensor, spec: BiasSpec,
    block: int | None = None, precise: bool = False, backward: Backward = "two_phase",
) -> torch.Tensor:
    """``A V`` of every sample over its own positions, ``[T, H * dv]`` in jagged order.

    ``q``, ``k`` ``[T, H * dq]`` and ``v`` ``[T, H * dv]`` (column views of one projection are
    fine: only the last dimension must be unit-stride); ``offsets`` ``[B+1]`` int64;
    ``timestamps`` ``[T]`` seconds; the bias tables ``[buckets, H]``; ``block``
    fixes the tile rows (tests) instead of autotuning them. fp32 dots run in TF32, as the
    trainer's matmuls do on GPUs; ``precise`` makes them full fp32 (slower; for checking).
    ``backward``: the backward kernel's variant (``Backward``).

    Precision (``training.precision``): ``q``, ``k``, ``v`` are cast to ``kernel_dtype``'s dtype
    here, outside the autograd function, so under bf16 autocast the kernels see bf16 operands
    whatever dtypes the caller's tensors have (a cast's backward returns each gradient in its
    tensor's dtype). The output is in that dtype, as autocast's matmuls are; the bias tables stay
    as they are (fp32 parameters) and get fp32 gradients.
    """
    if spec.activation != "silu":
        raise ValueError(f"the triton kernel computes SiLU weights only, not {spec.activation!r} "
                         "(model.hstu.attention_activation; the grouped kernel takes it)")
    if backward not in typing.get_args(Backward):
        raise ValueError(f"backward must be one of {typing.get_args(Backward)}, not {backward!r}")
    heads = position_weight.shape[1]
    dtype = kernel_dtype(q, k, v)
    out = _JaggedHSTUAttention.apply(
        *(_heads(t.to(dtype), heads) for t in (q, k, v)),
        position_weight.contiguous(), time_weight.contiguous(),
        offsets.to(torch.int64).contiguous(), timestamps.to(torch.int64).contiguous(),
        spec, block, "ieee" if precise and dtype == torch.float32 else "tf32", backward,
    )
    return out.view(out.shape[0], -1)
