"""Process-group set-up for the trainer: gloo on CPU, nccl on CUDA, with a collective timeout."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from training.config import ParallelBackendName, ParallelConfig


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str


def choose_backend(requested: ParallelBackendName) -> str:
    """The process-group backend to start: ``auto`` resolves by device (the config has checked the name)."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


def init_distributed(config: ParallelConfig, threads: int = 0) -> DistEnv:
    """Join the job's process group (torchrun's env:// variables), or make a group of one.

    `collective_timeout_s` bounds every collective: when a rank dies, the others
    fail with a timeout error instead of waiting forever (gloo enforces it on each
    transfer; nccl through its watchdog).
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = choose_backend(config.backend)
    if backend == "nccl" and not torch.cuda.is_available():
        from comm.errors import BackendUnavailable

        raise BackendUnavailable("parallel.backend nccl needs CUDA: torch.cuda.is_available() is False "
                                 "on this machine (gloo runs on CPU)")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # Ranks sharing a host share its cores: oversubscribed intra-op threads would
    # make compute times (and so the measured bubbles) depend on scheduling noise.
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world_size))
    timeout = timedelta(seconds=config.collective_timeout_s)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            store = tempfile.NamedTemporaryFile(prefix="freescale-pg-", delete=False).name
            # The store itself, not a file:// URL: torch would urlparse the temporary path.
            dist.init_process_group(backend, store=dist.FileStore(store, 1), rank=0, world_size=1,
                                    timeout=timeout)
    return DistEnv(rank, world_size, local_rank, local_world_size, device, backend)


_stopping_together = False


def all_ranks_ok(ok: bool) -> bool:
    """Agree before the first collective that could hang: False on every rank if any rank failed."""
    global _stopping_together
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag)
    agreed_ok = int(flag.item()) == 0
    _stopping_together = not agreed_ok
    return agreed_ok


def wait_for_peers_to_report() -> None:
    """After a failure every rank agreed on (``all_ranks_ok`` was False), wait until all
    ranks have printed their error. The elastic launcher stops the remaining ranks as
    soon as one exits, which would otherwise cut a peer off before its line is out."""
    if _stopping_together and dist.is_initialized():
        dist.barrier()


def exit_without_finalization(status: int) -> None:
    """End a rank's process with `status`, skipping the interpreter's finalization.

    A gloo worker thread frees each finished collective after the caller has
    already seen it complete; the freed work can hold the last reference to a
    tensor owned by a Python object, whose release needs the GIL. If the main
    thread is finalizing the interpreter by then, the worker thread is forced to
    exit while inside a noexcept destructor and the process aborts with
    "terminate called without an active exception" (SIGABRT) after a finished,
    fully recorded run (core backtrace: ~AsyncBarrierWork -> decref_pyobject ->
    take_gil -> pthread_exit). destroy_process_group does not join those threads
    while other objects (DMP, the sharded modules) still hold the group.
    Everything buffered is flushed first.
    """
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
