"""Collective backends behind one small interface: who moves the bytes of the exchange.

    backend = build_backend("gloo", timeout)
    group = backend.new_group("embedding", high_priority=True)
    work = backend.all_to_all(output, input, output_splits, input_splits, group)
    ...                               # compute while the bytes move
    work.wait()

Every call is asynchronous and returns a :class:`Work` (``wait()``,
``is_completed()``, ``on_complete(fn)``); the exchange and the dense gradient sync
only ever talk to this interface, so a new transport is one new class, its name
in :data:`freescale.comm.names.BackendName` and its branch in :func:`build_backend`. ``path`` says which transport actually ran (the trainer logs
it). A backend that cannot run on this machine raises :class:`BackendUnavailable`
with one line naming what is missing; nothing falls back silently.

* ``gloo``: CPU tensors, gloo's asynchronous collectives (their own threads).
* ``nccl`` and ``copy_engine``: CUDA (``freescale/comm/cuda.py``); ``copy_engine`` moves the
  bytes with the GPU's copy engines instead of SM kernels.
"""
from __future__ import annotations

from datetime import timedelta
from typing import get_args

import torch
import torch.distributed as dist

from freescale.comm.base import CollectiveBackend, TorchWork, Work
from freescale.comm.errors import BackendUnavailable
from freescale.comm.names import BackendName

BACKEND_NAMES: tuple[str, ...] = get_args(BackendName)


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
    from freescale.comm import cuda  # CUDA-only code stays out of CPU runs

    return cuda.build_cuda_backend(name, timeout)
