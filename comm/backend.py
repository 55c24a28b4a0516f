"""Collective backends behind one small interface: who moves the bytes of the exchange.

    backend = build_backend("gloo", timeout)
    group = backend.new_group("embedding", high_priority=True)
    work = backend.all_to_all(output, input, output_splits, input_splits, group)
    ...                               # compute while the bytes move
    work.wait()

Every call is asynchronous and returns a :class:`Work` (``wait()``,
``is_completed()``, ``on_complete(fn)``); the exchange and the dense gradient sync
only ever talk to this interface, so a new transport is one new class, its name
in :data:`comm.names.BackendName` and its branch in :func:`build_backend`. ``path`` says which transport actually ran (the trainer logs
it). A backend that cannot run on this machine raises :class:`BackendUnavailable`
with one line naming what is missing; nothing falls back silently.

* ``gloo``: CPU tensors, gloo's asynchronous collectives (their own threads).
* ``nccl`` and ``copy_engine``: CUDA (``comm/cuda.py``); ``copy_engine`` moves the
  bytes with the GPU's copy engines instead of SM kernels.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Callable, ClassVar, Protocol, get_args

import torch
import torch.distributed as dist

from comm.errors import BackendUnavailable
from comm.names import BackendName

BACKEND_NAMES: tuple[str, ...] = get_args(BackendName)


class Work(Protocol):
    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...

    def on_complete(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (from any thread) once the transfer has finished."""


class TorchWork:
    """A ``torch.distributed`` work handle seen through :class:`Work`.

    ``on_complete`` rides the work's future, which gloo completes when the transfer
    has finished (from its worker thread). NCCL's future completes when the kernel is
    enqueued, so the CUDA backends use their own work type for completion times.
    """

    def __init__(self, work: dist.Work):
        self._work = work

    def wait(self) -> None:
        self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def on_complete(self, fn: Callable[[], None]) -> None:
        self._work.get_future().add_done_callback(lambda _: fn())


class CollectiveBackend(ABC):
    """One transport for the exchange's all-to-alls and the dense all-reduce."""

    name: ClassVar[str]

    def __init__(self, timeout: timedelta):
        self.timeout = timeout

    @property
    @abstractmethod
    def path(self) -> str:
        """Which transport actually runs, in words (logged once per run)."""

    @abstractmethod
    def new_group(self, purpose: str, high_priority: bool = False) -> dist.ProcessGroup:
        """A process group of all ranks for one kind of traffic (``purpose``: for the log)."""

    @abstractmethod
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], group: dist.ProcessGroup) -> Work:
        """Rows ``input[sum(input_splits[:r]):...]`` to rank r; rank r's rows into ``output``."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> Work:
        """Sum ``tensor`` over ranks, in place."""


class GlooBackend(CollectiveBackend):
    name = "gloo"

    @property
    def path(self) -> str:
        return "gloo asynchronous collectives on CPU tensors (gloo worker threads)"

    def new_group(self, purpose: str, high_priority: bool = False) -> dist.ProcessGroup:
        # Gloo has no stream priorities; a group of its own still keeps this traffic
        # out of the other groups' queues.
        return dist.new_group(backend="gloo", timeout=self.timeout)

    def all_to_all(self, output, input, output_splits, input_splits, group) -> Work:
        return TorchWork(dist.all_to_all_single(output, input, output_splits, input_splits, group=group,
                                                async_op=True))

    def all_reduce(self, tensor, group) -> Work:
        return TorchWork(dist.all_reduce(tensor, group=group, async_op=True))


def build_backend(name: str, timeout: timedelta) -> CollectiveBackend:
    """The backend called ``name`` (``auto``: nccl with CUDA, else gloo), or one line saying why not."""
    if name not in BACKEND_NAMES:
        raise BackendUnavailable(f"comm.backend {name!r}: expected one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        name = "nccl" if torch.cuda.is_available() else "gloo"
    if name == "gloo":
        return GlooBackend(timeout)
    from comm import cuda  # CUDA-only code stays out of CPU runs

    return cuda.build_cuda_backend(name, timeout)
