"""Process-group set-up for the trainer: gloo on CPU, nccl on CUDA, with a collective timeout.

A process group sends a tensor through the backend it pairs with the tensor's device type;
one without a backend for that type refuses it ("No backend type associated with device
type cpu": a bare "nccl" group serves only CUDA tensors). The trainer sends host tensors
(agreements, timings, metric sums, checkpoint coordination) and device tensors (the model's
exchanges, dense gradients), so ``DistEnv`` names a group for each and every collective
passes the one that serves its tensors.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from freescale.training.config import ParallelBackendName, ParallelConfig


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    host_group: dist.ProcessGroup | None = None
    """Serves CPU tensors and Python objects (None: the default group)."""
    device_group: dist.ProcessGroup | None = None
    """Serves tensors on ``device``: TorchRec's sharding env, the dense all-reduce (None: the default group)."""


def choose_backend(requested: ParallelBackendName) -> str:
    """The process-group backend to start: ``auto`` resolves by device (the config has checked the name)."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


def default_group_backend(backend: str) -> str:
    """The default group's backend string: on CUDA torch's pairing, so host tensors go through
    gloo and device tensors through NCCL (a bare "nccl" maps only cuda)."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def serves(group: dist.ProcessGroup, device_type: str) -> bool:
    """Whether ``group`` has a backend for tensors on ``device_type`` (its "device:backend" pairs)."""
    return any(pair.split(":")[0] == device_type for pair in dist.get_backend_config(group).split(","))


def tensor_groups(device: torch.device, backend: str,
                  timeout: timedelta) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(host_group, device_group)``: the default group where it serves the tensors, else a
    group made here that does (gloo for CPU, ``backend`` for the device). Collective: every rank
    makes the same groups in the same order."""
    world = dist.GroupMember.WORLD
    assert world is not None
    device_group = world if serves(world, device.type) else dist.new_group(backend=backend, timeout=timeout)
    if serves(world, "cpu"):
        host_group = world
    elif device.type == "cpu":
        host_group = device_group
    else:
        host_group = dist.new_group(backend="gloo", timeout=timeout)
    return host_group, device_group


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """The store this attempt's ranks meet in, or None for torch's env:// one (a store the ranks'
    rank 0 serves at MASTER_PORT).

    Where the elastic agent shares its own store (TORCHELASTIC_USE_AGENT_STORE: one node,
    launch/launcher.py), the keys go under this attempt's number: the store outlives a restart,
    and a restarted rank must not read the last attempt's keys (a dead peer's address)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agents = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"freescale/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agents)


def init_distributed(config: ParallelConfig, threads: int = 0) -> DistEnv:
    """Join the job's process group (torchrun's env:// variables), or make a group of one.

    `init_timeout_s` bounds every collective until ``bound_collectives`` sets
    `collective_timeout_s` after the first step: when a rank dies, the others fail with a
    timeout error instead of waiting forever (gloo enforces it on each transfer; nccl through
    its watchdog). A default group already started (by whoever runs the trainer) is kept;
    groups serving what it does not are made beside it.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = choose_backend(config.backend)
    if backend == "nccl" and not torch.cuda.is_available():
        from freescale.comm.errors import BackendUnavailable

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
    timeout = timedelta(seconds=config.init_timeout_s)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(default_group_backend(backend), store=attempt_store(timeout), rank=rank,
                                    world_size=world_size, timeout=timeout)
        else:
            # One process: an in-memory store, nothing left on disk (a FileStore's file outlived
            # every run that ends without finalization).
            dist.init_process_group(default_group_backend(backend), store=dist.HashStore(), rank=0,
                                    world_size=1, timeout=timeout)
    return DistEnv(rank, world_size, local_rank, local_world_size, device, backend,
                   *tensor_groups(device, backend, timeout))


def bound_collectives(timeout: timedelta, host_group: dist.ProcessGroup | None) -> None:
    """Every process group's collectives from here on are bounded by ``timeout`` (the groups were
    made under ``init_timeout_s``; work already issued keeps its bound). Collective: a barrier
    first, so that no rank waits under the new bound for a peer still in work the old one covered
    (torchtitan moves from its init to its train timeout the same way)."""
    if not dist.is_initialized():
        return
    dist.barrier(group=host_group)
    for group in list(dist.distributed_c10d._pg_map):
        dist.distributed_c10d._set_pg_timeout(timeout, group)


_stopping_together = False
_agreeing_group: dist.ProcessGroup | None = None


def all_ranks_ok(ok: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Agree before the first collective that could hang: False on every rank if any rank failed.
    ``group`` must serve CPU tensors (``DistEnv.host_group``)."""
    global _stopping_together, _agreeing_group
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(flag, group=group)
    agreed_ok = int(flag.item()) == 0
    _stopping_together, _agreeing_group = not agreed_ok, group
    return agreed_ok


def wait_for_peers_to_report() -> None:
    """After a failure every rank agreed on (``all_ranks_ok`` was False), wait until all
    ranks have printed their error. The elastic launcher stops the remaining ranks as
    soon as one exits, which would otherwise cut a peer off before its line is out."""
    if _stopping_together and dist.is_initialized():
        dist.barrier(group=_agreeing_group)


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
