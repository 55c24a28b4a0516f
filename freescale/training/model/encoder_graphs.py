"""CUDA graphs of the encoder's forward and backward over padded shape buckets (``training.cuda_graphs``).

Why (docs/results/hstu_gpu.md, 2026-12-06, H100): eager, one forward+backward of the 4-layer HSTU
encoder issues 177 kernel launches. The host took 10.5 ms to issue them against 8.2 ms of GPU work, and
calibrate found a 9.2 ms per-step constant, so a sample's own cost hid under the floor and balancing
had nothing to balance. A CUDA graph replays a whole forward (or backward) as one launch.

A graph has fixed shapes and a jagged batch has not, so ``GraphedEncoder`` pads each batch to a bucket
(``ShapeBuckets``) and captures one forward and one backward graph per bucket, on first sight:

* rows: ``T`` up to the next rung of a geometric ladder (``growth`` apart, whole tiles), so padding adds
  less than ``growth - 1`` of the rows to the per-row work (projections, norms);
* samples: ``B`` up to the next power of two with empty samples (which launch no tiles), then the
  padding rows as their own short samples (at most ``pad_sample_rows`` each: one diagonal attention
  tile), as many as the rung's gap can need, empty past the padding. Attention never crosses samples
  and every other op is per row, so a real row's output and gradients are the unpadded batch's
  (``tests/training/test_encoder_graphs.py`` checks them against the eager encoder).

The graphs read and write fixed tensors. Per step the host issues copies of the real rows, timestamps
and offsets into the bucket's inputs, the padding's offsets (two small ops) and one replay; in the
backward, the output gradient's copy (its padding zeroed) and one replay. The parameters' gradients
then accumulate as autograd accumulates them, so post-accumulate hooks (the dense all-reduce's,
``freescale.comm.dense_sync``) fire as in eager.

All buckets share one memory pool: a bucket's backward runs right after its forward with no other
replay between, so a replay only overwrites what a finished step left. The output and the input
gradient are views of graph memory, valid until the next graphed step; a caller that keeps them
longer clones them. Parameters must stay where they were at capture (optimizers and
``load_state_dict`` write in place); if one moved, every graph is dropped and captured again.

Run eagerly instead, and counted by reason (``GraphStats.eager``): forwards without grad or in eval
mode, empty batches, and batches that would need a bucket past ``max_graphs``.

Only torch: the GPU machine runs this without torchrec.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch import nn

from freescale.training.ops.jagged import check_jagged

Replay = Literal["cuda_graph", "rerun"]
"""``cuda_graph``: capture and replay CUDA graphs. ``rerun``: run the captured function again on the
same fixed tensors at every replay, which keeps everything but the capture (padding, fixed inputs,
gradients) testable on a CPU."""

WARMUP_PASSES = 2
"""Passes on a side stream before a capture: the Triton autotuner, cuBLAS's workspaces and the
allocator do their one-time work there, never inside a graph."""


def warm_up(run: Callable[[], object], passes: int = WARMUP_PASSES) -> None:
    """``run`` ``passes`` times on a side stream, then wait for it: what a capture needs done first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(passes):
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(run: Callable[[], object], pool=None) -> torch.cuda.CUDAGraph:
    """``run`` captured as a CUDA graph (into ``pool`` if given), after ``warm_up``."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: a trainer's other threads (NCCL's watchdog, the comm layer's collectives) may
    # query events while this thread captures; "global" would fail the capture for them.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        run()
    return graph


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ShapeBuckets:
    """The padded shapes a graphed encoder captures: a ladder of row counts, padding in short samples."""

    min_rows: int = 512
    """The first rung's rows: every batch of fewer rows is padded to it."""
    growth: float = 1.125
    """Each rung's rows over the previous rung's (then rounded up to whole ``row_multiple``): padding
    adds under 12.5% of a batch's rows at the default."""
    row_multiple: int = 64
    """Rungs are whole multiples of this (the attention kernel's largest tile)."""
    pad_sample_rows: int = 64
    """The longest padding sample: padding costs the attention at most one diagonal tile per sample."""
    max_graphs: int = 64
    """Buckets captured at most; a batch that would need another runs eagerly (counted)."""

    def __post_init__(self) -> None:
        if self.min_rows < 1 or self.row_multiple < 1 or self.pad_sample_rows < 1 or self.max_graphs < 0:
            raise ValueError(f"ShapeBuckets needs min_rows, row_multiple, pad_sample_rows >= 1 and "
                             f"max_graphs >= 0, got {self}")
        if not self.growth > 1.0:
            raise ValueError(f"ShapeBuckets.growth must be above 1, got {self.growth}")

    def _rungs(self, total: int) -> tuple[int, int]:
        """``(previous rung, rung)``: the smallest rung holding ``total`` rows and the one below it (0)."""
        previous, rung = 0, _round_up(self.min_rows, self.row_multiple)
        while rung < total:
            previous, rung = rung, _round_up(max(math.ceil(rung * self.growth), rung + 1), self.row_multiple)
        return previous, rung

    def rows(self, total: int) -> int:
        """The bucket's rows for a batch of ``total`` rows."""
        return self._rungs(total)[1]

    @staticmethod
    def samples(batch: int) -> int:
        """The bucket's sample slots for a batch of ``batch`` samples: the next power of two."""
        return 1 << max(batch - 1, 0).bit_length()

    def pad_samples(self, total: int) -> int:
        """Padding samples of the bucket ``total`` falls in: enough for the most padding any batch
        of that bucket needs (``rung - previous - 1`` rows, at least one real row)."""
        previous, rung = self._rungs(total)
        return -(-(rung - previous - 1) // self.pad_sample_rows)


@dataclass
class GraphStats:
    """What a ``GraphedEncoder`` did: graphed calls, eager calls by reason, buckets and padding."""

    graphed: int = 0
    eager: Counter = field(default_factory=Counter)
    captures: int = 0
    dropped: int = 0
    """Graphs dropped because a parameter moved (each captured again when its bucket comes back)."""
    real_rows: int = 0
    padded_rows: int = 0
    """Rows the graphed calls ran, padding included (``padded_rows / real_rows - 1``: the padding's share)."""

    def summary(self) -> str:
        eager = ", ".join(f"{reason} {count}" for reason, count in sorted(self.eager.items())) or "none"
        padding = self.padded_rows / self.real_rows - 1.0 if self.real_rows else 0.0
        return (f"{self.graphed} graphed calls over {self.captures} captures ({self.dropped} dropped), padding "
                f"{padding:.1%} of the rows; eager calls: {eager}")


class _Bucket:
    """One padded shape's fixed tensors and its two graphs (or, ``rerun``, its two functions)."""

    def __init__(self, encoder: nn.Module, params: tuple[nn.Parameter, ...], rows: int, batch: int,
                 pad_samples: int, pad_sample_rows: int, values: torch.Tensor, timestamps: torch.Tensor,
                 autocast: torch.dtype | None) -> None:
        device = values.device
        # batch: sample slots before the padding samples (real samples, then empty ones)
        self.encoder, self.params, self.rows, self.batch, self.autocast = encoder, params, rows, batch, autocast
        self.values = torch.zeros(rows, values.shape[1], dtype=values.dtype, device=device, requires_grad=True)
        self.timestamps = torch.zeros(rows, dtype=timestamps.dtype, device=device)
        self.offsets = torch.zeros(batch + pad_samples + 1, dtype=torch.int64, device=device)
        self.pad_steps = torch.arange(1, pad_samples + 1, dtype=torch.int64, device=device) * pad_sample_rows
        self.out: torch.Tensor | None = None
        self.grad_out: torch.Tensor | None = None
        self.grad_values: torch.Tensor | None = None
        self.grad_params: tuple[torch.Tensor | None, ...] = ()
        self.replay_forward: Callable[[], None] = self.run_forward
        self.replay_backward: Callable[[], None] = self.run_backward

    def load(self, values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor) -> None:
        """The real batch into the fixed inputs; the rows past it become padding samples. Rows left
        from an earlier, longer batch stay: they are finite, and only padding samples read them."""
        total, real, batch = values.shape[0], offsets.numel() - 1, self.batch
        with torch.no_grad():
            self.values[:total].copy_(values)
            self.timestamps[:total].copy_(timestamps)
            self.offsets[:real + 1].copy_(offsets)
            if real < batch:
                self.offsets[real + 1:batch + 1].fill_(total)
            pads = self.offsets[batch + 1:]
            torch.add(self.pad_steps, total, out=pads)
            pads.clamp_(max=self.rows)

    def load_grad(self, grad: torch.Tensor, total: int) -> None:
        with torch.no_grad():
            self.grad_out[:total].copy_(grad)
            self.grad_out[total:].zero_()

    def run_forward(self) -> None:
        autocast = (torch.autocast(self.values.device.type, dtype=self.autocast, cache_enabled=False)
                    if self.autocast is not None else torch.autocast(self.values.device.type, enabled=False))
        with torch.enable_grad(), autocast:
            self.out = self.encoder(self.values, self.offsets, self.timestamps)

    def run_backward(self) -> None:
        grads = torch.autograd.grad(self.out, (self.values, *self.params), self.grad_out, allow_unused=True)
        self.grad_values, self.grad_params = grads[0], tuple(grads[1:])

    def step(self) -> None:
        """One forward and backward, the output gradient allocated (zeros) on the first."""
        self.run_forward()
        if self.grad_out is None:
            self.grad_out = torch.zeros_like(self.out)
        self.run_backward()

    def capture(self, pool) -> None:
        """Warm up, then capture the forward and the backward into ``pool``."""
        warm_up(self.step)
        forward, backward = capture(self.run_forward, pool), capture(self.run_backward, pool)
        self.replay_forward, self.replay_backward = forward.replay, backward.replay


class _Replayed(torch.autograd.Function):
    """The encoder as one replay each way; the parameters are inputs so their gradients accumulate
    through autograd (hooks included)."""

    @staticmethod
    def forward(ctx, bucket: _Bucket, values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        total = values.shape[0]
        bucket.load(values, offsets, timestamps)
        bucket.replay_forward()
        ctx.bucket, ctx.total = bucket, total
        return bucket.out.detach()[:total]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        bucket = ctx.bucket
        bucket.load_grad(grad, ctx.total)
        bucket.replay_backward()
        # The bucket keeps its gradient tensors, so autograd copies (never steals) them into .grad.
        return (None, bucket.grad_values.detach()[:ctx.total], None, None, *bucket.grad_params)


class GraphedEncoder:
    """``encoder(values, offsets, timestamps)`` through CUDA graphs per padded bucket; see the module."""

    def __init__(self, encoder: nn.Module, buckets: ShapeBuckets | None = None, replay: Replay = "cuda_graph") -> None:
        self.encoder = encoder
        self.buckets = buckets or ShapeBuckets()
        self.replay = replay
        self.stats = GraphStats()
        self._graphs: dict[tuple, _Bucket] = {}
        self._pool = None
        self._params: tuple[nn.Parameter, ...] = ()
        self._addresses: tuple[int, ...] = ()

    def __call__(self, values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        check_jagged(values, offsets, timestamps)
        bucket, reason = self._bucket(values, offsets, timestamps)
        if bucket is None:
            self.stats.eager[reason] += 1
            return self.encoder(values, offsets, timestamps)
        self.stats.graphed += 1
        self.stats.real_rows += values.shape[0]
        self.stats.padded_rows += bucket.rows
        return _Replayed.apply(bucket, values, offsets, timestamps, *bucket.params)

    def _bucket(self, values: torch.Tensor, offsets: torch.Tensor,
                timestamps: torch.Tensor) -> tuple[_Bucket | None, str]:
        """The bucket this call replays (captured now if new), or None and why it runs eagerly."""
        if not torch.is_grad_enabled():
            return None, "no grad"
        if not self.encoder.training:
            return None, "eval mode"
        total, batch = values.shape[0], offsets.numel() - 1
        if total == 0 or batch < 1:
            return None, "empty batch"
        self._check_parameters()
        device_type = values.device.type
        autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        rows, batch = self.buckets.rows(total), self.buckets.samples(batch)
        key = (rows, batch, values.dtype, timestamps.dtype, autocast)
        bucket = self._graphs.get(key)
        if bucket is not None:
            return bucket, ""
        if len(self._graphs) >= self.buckets.max_graphs:
            return None, "past max_graphs"
        bucket = _Bucket(self.encoder, self._params, rows, batch, self.buckets.pad_samples(total),
                         self.buckets.pad_sample_rows, values, timestamps, autocast)
        bucket.load(values, offsets, timestamps)  # the warm-up runs on a real batch's shape of work
        if self.replay == "cuda_graph":
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            bucket.capture(self._pool)
        else:
            bucket.step()
        self._graphs[key] = bucket
        self.stats.captures += 1
        return bucket, ""

    def _check_parameters(self) -> None:
        """Graphs read parameters and buffers where they were at capture, and give gradients to the
        parameters that trained then: if any moved or changed whether it trains, drop every graph
        (captured again on demand)."""
        tensors = (*self.encoder.parameters(), *self.encoder.buffers())
        addresses = tuple((t.data_ptr(), t.requires_grad) for t in tensors)
        if addresses != self._addresses:
            params = tuple(p for p in self.encoder.parameters() if p.requires_grad)
            self.stats.dropped += len(self._graphs)
            self._graphs.clear()
            self._params, self._addresses = params, addresses
