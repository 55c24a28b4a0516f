"""The interface every collective backend implements (freescale/comm/backend.py builds one): an asynchronous
:class:`Work` per call and the :class:`CollectiveBackend` methods the exchange and the dense
gradient sync use. Apart from the builders so that the CUDA backends (freescale/comm/cuda.py) and gloo's
(freescale/comm/backend.py) both stand on it without importing each other.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Callable, ClassVar, Protocol

import torch
import torch.distributed as dist


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
        """Bounds the groups it makes, and the waits it runs itself (the copy engine's barriers)."""

    def set_timeout(self, timeout: timedelta) -> None:
        """The bound on its own waits from here on (its groups' bound is set with every group's)."""
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
