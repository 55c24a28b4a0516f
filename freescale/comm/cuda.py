"""CUDA collective backends: ``nccl`` (NCCL's SM kernels) and ``copy_engine`` (the GPU's copy engines).

What has run (one H200, docs/results/sm_free_bench.md): both backends build and exchange on
a single GPU (``tests/comm/test_comm_cuda.py``), and a copy-engine copy leaves a concurrent GEMM's
throughput alone where an SM copy costs it 14.5%. Unmeasured: the exchange between two or
more GPUs (``torchrun --nproc-per-node N -m benchmarks.sm_free_bench --multi``).

Why ``copy_engine``: NCCL moves bytes with kernels that occupy SMs, so an exchange overlapped
with the dense compute slows that compute down. A GPU also has copy (DMA) engines that move
bytes without SMs. ``copy_engine`` uses them, in this order of preference:

1. NCCL >= 2.28 copy-engine collectives: a NCCL group whose config has
   ``cta_policy = NCCL_CTA_POLICY_ZERO`` and buffers registered as symmetric windows
   (``torch.distributed._symmetric_memory`` with its ``NCCL`` backend). Copy engines only
   serve equal-split ``ncclAlltoAll``, so each peer's rows go into a fixed-size slot (padded)
   and come out of the slots with ``cudaMemcpyAsync`` copies on a side stream. NCCL decides
   per call whether the copy engines are eligible; ``NCCL_DEBUG=INFO`` logs ``[Copy Engine]``
   when they are.
2. Otherwise peer copies: every rank pushes its rows into the peers' symmetric buffers
   (``torch.distributed._symmetric_memory``, ``CUDA`` backend) with ``copy_`` on a dedicated
   stream (``cudaMemcpyAsync`` to a peer address: copy engines over NVLink/PCIe, the pattern
   of PyTorch's own ``_low_contention_all_gather``), between two 1-block barrier kernels.

Both paths agree on the slot size with a tiny gloo all-reduce on the host each call (the
splits of other ranks are not known locally); the host waits for its peers there.
``all_reduce`` stays on NCCL kernels in both: a reduction needs arithmetic, i.e. SMs.
Copy engines reach only GPUs of one node, so ``copy_engine`` requires all ranks on one
node with peer access between their GPUs; anything missing raises
:class:`~freescale.comm.backend.BackendUnavailable` (one line), never a quiet fall back to ``nccl``.

Importing this module makes no CUDA call; every check happens in :func:`build_cuda_backend`.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from freescale.comm.base import CollectiveBackend, TorchWork, Work
from freescale.comm.errors import BackendUnavailable
from freescale.runtime.errors import one_line

ZERO_CTA_MIN_NCCL = (2, 28)  # NCCL_CTA_POLICY_ZERO and copy-engine collectives arrived in NCCL 2.28
MIN_SLOT_BYTES = 1 << 20


def _version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


class _Poller:
    """One daemon thread that runs ``on_complete`` callbacks once their GPU work has finished.

    CUDA gives Python no host callback that does not stall a stream, so a thread polls
    ``done()`` (an event query) every ``interval_s`` while anything is pending and sleeps on
    a condition otherwise.
    """

    def __init__(self, interval_s: float = 100e-6):
        self._interval_s = interval_s
        self._pending: dict[int, tuple[Callable[[], bool], Callable[[], None]]] = {}
        self._next = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, done: Callable[[], bool], fn: Callable[[], None]) -> None:
        with self._cond:
            self._pending[self._next] = (done, fn)
            self._next += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="comm-cuda-poller", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                pending = list(self._pending.items())
            fired = []
            for key, (done, fn) in pending:
                try:
                    finished = done()
                except Exception:  # the error surfaces in wait(); a waiter must not hang on it
                    finished = True
                if finished:
                    fired.append(key)
                    try:
                        fn()
                    except Exception:
                        traceback.print_exc(file=sys.stderr)
            with self._cond:
                for key in fired:
                    del self._pending[key]
            if len(fired) < len(pending):
                time.sleep(self._interval_s)


_POLLER = _Poller()


class NcclWork(TorchWork):
    """A NCCL work whose ``on_complete`` waits for the GPU.

    A NCCL work's future is done as soon as the collective is enqueued (``Work.get_future``
    docs: "For GPU work, fut.done() returns true only whether the operation has been
    enqueued"), so :class:`TorchWork`'s ``on_complete`` would fire before the bytes moved;
    ``is_completed()`` queries the work's end event on the GPU.
    """

    def on_complete(self, fn: Callable[[], None]) -> None:
        _POLLER.add(self._work.is_completed, fn)


class EventWork:
    """Work that ends at a CUDA event recorded on the backend's copy stream.

    ``wait()`` makes the caller's current stream wait for the event (the host does not block),
    like a NCCL work's ``wait()``.
    """

    def __init__(self, event: torch.cuda.Event):
        self._event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event.query()

    def on_complete(self, fn: Callable[[], None]) -> None:
        _POLLER.add(self._event.query, fn)


class NcclBackend(CollectiveBackend):
    """``dist.all_to_all_single`` / ``dist.all_reduce`` on NCCL groups (SM kernels)."""

    name = "nccl"

    def __init__(self, timeout: timedelta, nccl_version: tuple[int, ...]):
        super().__init__(timeout)
        self.nccl_version = nccl_version
        self._high_priority: list[str] = []

    @property
    def path(self) -> str:
        text = f"nccl SM kernels (NCCL {_version_text(self.nccl_version)})"
        if self._high_priority:
            text += f", high-priority stream for the {', '.join(self._high_priority)} group"
        return text

    def new_group(self, purpose: str, high_priority: bool = False) -> dist.ProcessGroup:
        # A high-priority NCCL stream lets the exchange's kernels be scheduled ahead of
        # compute kernels already queued, so the exchange is not stuck behind them.
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
        group = dist.new_group(backend="nccl", pg_options=options, timeout=self.timeout)
        if high_priority:
            self._high_priority.append(purpose)
        return group

    def all_to_all(self, output, input, output_splits, input_splits, group) -> Work:
        return NcclWork(dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
                                               async_op=True))

    def all_reduce(self, tensor, group) -> Work:
        return NcclWork(dist.all_reduce(tensor, group=group, async_op=True))


@dataclass
class _Slots:
    """One group's symmetric buffers: ``world`` slots of ``slot_bytes`` (send side: NCCL path only)."""

    stream: torch.cuda.Stream
    host_group: dist.ProcessGroup
    slot_bytes: int = 0
    recv: torch.Tensor | None = None
    recv_handle: Any = None
    send: torch.Tensor | None = None


def _offsets(splits: list[int]) -> list[int]:
    out, total = [], 0
    for n in splits:
        out.append(total)
        total += n
    return out


def slot_bytes_for(need_bytes: int) -> int:
    """Slot size for ``need_bytes``: a power of two (so regrowth is rare and equal on all ranks)."""
    return max(MIN_SLOT_BYTES, 1 << max(0, need_bytes - 1).bit_length())


class CopyEngineBackend(CollectiveBackend):
    """All-to-all on the GPU's copy engines (module docstring: the two paths and their costs)."""

    name = "copy_engine"

    def __init__(self, timeout: timedelta, nccl_version: tuple[int, ...], symm_mem: Any, zero_cta: bool,
                 not_zero_cta_because: str = ""):
        super().__init__(timeout)
        self.nccl_version = nccl_version
        self.zero_cta = zero_cta
        self._symm_mem = symm_mem
        self._why = not_zero_cta_because
        self._groups: dict[str, _Slots] = {}

    @property
    def path(self) -> str:
        nccl = f"NCCL {_version_text(self.nccl_version)}"
        reduce = f"all_reduce: {nccl} kernels (a reduction needs SMs)"
        if self.zero_cta:
            return (f"copy_engine: {nccl} zero-CTA copy-engine all-to-all (ncclAlltoAll on symmetric-window "
                    f"buffers, rows padded to equal slots, slots packed/unpacked by cudaMemcpyAsync on a side "
                    f"stream; NCCL uses copy engines where it finds them eligible, NCCL_DEBUG=INFO logs "
                    f"[Copy Engine]); {reduce}")
        return (f"copy_engine: peer copies into symmetric-memory buffers (cudaMemcpyAsync on a dedicated "
                f"stream, two 1-block barrier kernels per all-to-all; NCCL zero-CTA path not used: needs "
                f"{self._why}); {reduce}")

    def new_group(self, purpose: str, high_priority: bool = False) -> dist.ProcessGroup:
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
        if self.zero_cta:
            options.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
        group = dist.new_group(backend="nccl", pg_options=options, timeout=self.timeout)
        # NCCL creates a group's communicator at its first collective, and window
        # registration (rendezvous) needs that communicator (PyTorch's test_ce_colls does this too).
        dist.all_reduce(torch.ones(1, device=_device()), group=group)
        host_group = dist.new_group(backend="gloo", timeout=self.timeout)
        # Lower number = higher priority; it orders the barrier kernels and the copies' launch.
        stream = torch.cuda.Stream(priority=-1 if high_priority else 0)
        state = _Slots(stream=stream, host_group=host_group)
        try:  # allocate now so a symmetric-memory failure shows at set-up, not mid-training
            self._grow(state, group, MIN_SLOT_BYTES)
        except RuntimeError as error:
            raise BackendUnavailable(f"comm.backend copy_engine: symmetric-memory buffers for the {purpose} "
                                     f"group failed: {one_line(error)}") from error
        self._groups[group.group_name] = state
        return group

    def _grow(self, state: _Slots, group: dist.ProcessGroup, need_bytes: int) -> None:
        if need_bytes <= state.slot_bytes:
            return
        # Peers' copies into the old buffers finished before our last barrier/unpack on this
        # stream; wait for it before freeing them (rare: slots grow by powers of two).
        state.stream.synchronize()
        slot = slot_bytes_for(need_bytes)
        total = group.size() * slot
        symm = self._symm_mem
        state.recv = state.recv_handle = state.send = None
        with torch.cuda.stream(state.stream):  # the blocks belong to the stream that uses them
            state.recv = symm.empty(total, dtype=torch.uint8, device=_device())
            state.recv_handle = symm.rendezvous(state.recv, group)
            if self.zero_cta:
                state.send = symm.empty(total, dtype=torch.uint8, device=_device())
                symm.rendezvous(state.send, group)
        state.slot_bytes = slot

    def _agree_slot_bytes(self, state: _Slots, need_bytes: int) -> int:
        # Rank r knows only its own row (input_splits) and column (output_splits) of the
        # split matrix; every rank must use the same slot size, hence one host all-reduce.
        need = torch.tensor([need_bytes], dtype=torch.int64)
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=state.host_group)
        return int(need.item())

    def all_to_all(self, output, input, output_splits, input_splits, group) -> Work:
        state = self._groups.get(group.group_name)
        if state is None:
            raise ValueError("comm.backend copy_engine: all_to_all on a group not made by this backend's new_group")
        if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
            raise ValueError(f"comm.backend copy_engine: output {output.dtype} {tuple(output.shape)} does not "
                             f"match input {input.dtype} {tuple(input.shape)} row for row")
        world, me = group.size(), group.rank()
        if output_splits[me] != input_splits[me]:
            raise ValueError(f"comm.backend copy_engine: rank {me} keeps {input_splits[me]} of its rows but "
                             f"expects {output_splits[me]}")
        row_shape = tuple(input.shape[1:])
        row_bytes = math.prod(row_shape) * input.element_size()
        need = max(max(input_splits, default=0), max(output_splits, default=0)) * row_bytes
        self._grow(state, group, self._agree_slot_bytes(state, need))
        cap = state.slot_bytes // max(row_bytes, 1)
        caller = torch.cuda.current_stream()
        state.stream.wait_stream(caller)  # the input was produced on the caller's stream
        with torch.cuda.stream(state.stream):
            exchange = self._nccl_exchange if self.zero_cta else self._peer_exchange
            exchange(state, group, output, input, output_splits, input_splits, world, me, cap, row_shape)
            event = torch.cuda.Event()
            event.record(state.stream)
        # Both tensors are used on our stream: keep the caching allocator from reusing them early.
        input.record_stream(state.stream)
        output.record_stream(state.stream)
        return EventWork(event)

    @staticmethod
    def _typed(buffer: torch.Tensor, world: int, cap: int, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        rows = world * cap
        nbytes = rows * math.prod(row_shape) * dtype.itemsize
        return buffer[:nbytes].view(dtype).view(rows, *row_shape)

    def _nccl_exchange(self, state, group, output, input, output_splits, input_splits, world, me, cap,
                       row_shape) -> None:
        send = self._typed(state.send, world, cap, row_shape, input.dtype)
        recv = self._typed(state.recv, world, cap, row_shape, input.dtype)
        for q, (off, n) in enumerate(zip(_offsets(input_splits), input_splits)):
            if n:
                send[q * cap:q * cap + n].copy_(input[off:off + n])
        # Equal splits on window-registered buffers: the only all-to-all NCCL runs on copy
        # engines (uneven splits become send/recv kernels). async_op: CE collectives cannot
        # run on the default stream (PyTorch symmetric-memory docs, NCCL 2.28).
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        work.wait()  # our stream waits for NCCL's; the host does not block
        for p, (off, m) in enumerate(zip(_offsets(output_splits), output_splits)):
            if m:
                output[off:off + m].copy_(recv[p * cap:p * cap + m])

    def _peer_exchange(self, state, group, output, input, output_splits, input_splits, world, me, cap,
                       row_shape) -> None:
        handle = state.recv_handle
        timeout_ms = int(self.timeout.total_seconds() * 1000)
        in_off, out_off = _offsets(input_splits), _offsets(output_splits)
        # Every peer has unpacked the previous exchange out of its slots before we overwrite them.
        handle.barrier(channel=0, timeout_ms=timeout_ms)
        for step in range(world):
            q = (me + step) % world  # staggered so the peers' links are not all hit by one sender
            n = input_splits[q]
            if not n:
                continue
            rows = input[in_off[q]:in_off[q] + n]
            if q == me:
                output[out_off[me]:out_off[me] + n].copy_(rows)
            else:
                peer = handle.get_buffer(q, (world * cap, *row_shape), input.dtype)
                peer[me * cap:me * cap + n].copy_(rows)
        handle.barrier(channel=0, timeout_ms=timeout_ms)  # every peer's rows have landed in our slots
        mine = handle.get_buffer(me, (world * cap, *row_shape), input.dtype)
        for p in range(world):
            m = output_splits[p]
            if m and p != me:
                output[out_off[p]:out_off[p] + m].copy_(mine[p * cap:p * cap + m])

    def all_reduce(self, tensor, group) -> Work:
        return NcclWork(dist.all_reduce(tensor, group=group, async_op=True))


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _require_one_node() -> None:
    """Copy engines reach only GPUs of this node, and only with peer access between them."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world > local:
        raise BackendUnavailable(f"comm.backend copy_engine needs all ranks on one node (copy engines reach other "
                                 f"GPUs only by peer access): world size {world}, {local} ranks on this node")
    gpus = min(local, torch.cuda.device_count())
    for a in range(gpus):
        for b in range(gpus):
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                raise BackendUnavailable(f"comm.backend copy_engine needs peer-to-peer access between this node's "
                                         f"GPUs: cuda:{a} cannot access cuda:{b}")


def _use_symm_backend(symm_mem: Any, name: str) -> str:
    """Select the symmetric-memory allocator ``name``; what failed, or "" on success."""
    try:
        if symm_mem.get_backend(_device()) != name:
            symm_mem.set_backend(name)
    except Exception as error:  # the binding raises RuntimeError/ValueError depending on the build
        return f"set_backend({name!r}) failed: {one_line(error)}"
    return ""


def _zero_cta_missing(nccl_version: tuple[int, ...], symm_mem: Any) -> str:
    """What the NCCL zero-CTA copy-engine path lacks here, or "" if nothing."""
    if nccl_version < ZERO_CTA_MIN_NCCL:
        return (f"NCCL >= {_version_text(ZERO_CTA_MIN_NCCL)} (this torch has NCCL "
                f"{_version_text(nccl_version)})")
    nccl_pg = dist.ProcessGroupNCCL
    if not hasattr(nccl_pg, "NCCL_CTA_POLICY_ZERO") or not hasattr(nccl_pg.Options().config, "cta_policy"):
        return f"ProcessGroupNCCL.Options().config.cta_policy with NCCL_CTA_POLICY_ZERO (torch {torch.__version__})"
    missing = _use_symm_backend(symm_mem, "NCCL")  # last: it selects the allocator for the process
    return f"torch.distributed._symmetric_memory's NCCL backend ({missing})" if missing else ""


def _build_copy_engine(timeout: timedelta, nccl_version: tuple[int, ...]) -> CopyEngineBackend:
    _require_one_node()
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as error:
        raise BackendUnavailable(f"comm.backend copy_engine needs torch.distributed._symmetric_memory "
                                 f"(torch {torch.__version__}: {one_line(error)})") from error
    zero_cta_missing = _zero_cta_missing(nccl_version, symm_mem)
    if not zero_cta_missing:
        return CopyEngineBackend(timeout, nccl_version, symm_mem, zero_cta=True)
    peer_missing = _use_symm_backend(symm_mem, "CUDA")
    if peer_missing:
        raise BackendUnavailable(f"comm.backend copy_engine needs {zero_cta_missing}, or symmetric-memory peer "
                                 f"copies (torch.distributed._symmetric_memory {peer_missing})")
    return CopyEngineBackend(timeout, nccl_version, symm_mem, zero_cta=False, not_zero_cta_because=zero_cta_missing)


def build_cuda_backend(name: str, timeout: timedelta) -> CollectiveBackend:
    """The CUDA backend ``name`` (``nccl`` or ``copy_engine``), or one line naming what is missing."""
    if name not in ("nccl", "copy_engine"):
        raise BackendUnavailable(f"comm.backend {name!r}: freescale.comm.cuda builds only nccl and copy_engine")
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"comm.backend {name} needs CUDA: torch.cuda.is_available() is False on this machine")
    if not dist.is_available() or not dist.is_nccl_available():
        raise BackendUnavailable(f"comm.backend {name} needs NCCL: torch.distributed.is_nccl_available() is False "
                                 f"(torch {torch.__version__} was built without it)")
    nccl_version = tuple(torch.cuda.nccl.version()[:3])
    if name == "nccl":
        return NcclBackend(timeout, nccl_version)
    return _build_copy_engine(timeout, nccl_version)
