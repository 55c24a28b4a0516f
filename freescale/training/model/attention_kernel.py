"""Which HSTU attention kernel a run gets, and whether it can take the config: decided without torch or triton.

``model.hstu.attention_kernel`` is ``triton``, ``grouped`` or ``auto`` (triton on CUDA, grouped on
CPU). Asking for triton where it cannot run stops the job, never falls back; so does a config
the kernel cannot take (``freescale.training.ops.kernel_limits``), while the grouped path takes any value.
The ranks decide this when they build the model (``HSTUEncoder.kernel``), and the launcher
(``freescale train``, ``freescale compare``) decides it before torchrun starts, through
``freescale.training.parallel.rank_checks``: importing torch costs 1.5 s, and starting the ranks about 10 s.
"""
from __future__ import annotations

import os
import sys
import typing

from freescale.runtime.errors import InputError
from freescale.training.config import (AttentionKernel, AttentionKernelName, ConfigError, HSTUConfig, ParallelBackendName,
                             TrainConfig)
from freescale.training.ops.kernel_limits import POSITION_TABLE_LIMIT, position_table_too_long, time_gaps_too_wide

# Device nodes of a GPU driver torch could use (NVIDIA, ROCm, WSL's): on Linux without any,
# torch.cuda.is_available() is False however torch was built.
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def triton_unavailable(device_type: str) -> str | None:
    """Why the Triton kernel cannot run on a device of this type (``cpu``, ``cuda``); None when it can."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device_type != "cuda" and not interpreted:
        return f"it needs a CUDA device and this job runs on {device_type}"
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"triton cannot be imported ({err})"
    return None


def resolve_attention_kernel(choice: AttentionKernel, device_type: str) -> AttentionKernelName:
    """The kernel ``choice`` means on a device of this type (``cpu``, ``cuda``, ``cuda:1``); ``InputError``
    (one line) if triton is asked for and cannot run there -- never a quiet fall back to the slower kernel."""
    device_type = device_type.split(":")[0]
    if choice == "auto":
        choice = "triton" if device_type == "cuda" else "grouped"
    if choice == "triton":
        reason = triton_unavailable(device_type)
        if reason is not None:
            allowed = "', '".join(typing.get_args(AttentionKernel))
            raise InputError(f"model.hstu.attention_kernel = 'triton' cannot run: {reason} "
                             f"(choose one of '{allowed}'; 'auto' picks triton on CUDA, grouped on CPU)")
    return choice


def triton_limits_problem(hstu: HSTUConfig) -> str | None:
    """Why the Triton kernel cannot take this config (its bucket tables, its weights); None when it can."""
    if hstu.attention_activation != "silu":
        return (f"model.hstu.attention_activation '{hstu.attention_activation}' is not the triton attention "
                "kernel's: it computes SiLU weights only")
    if position_table_too_long(hstu.num_position_buckets, hstu.max_seq_len):
        return (f"model.hstu.max_seq_len {hstu.max_seq_len} needs a position table of more than "
                f"{POSITION_TABLE_LIMIT + 1} entries, the triton attention kernel's limit")
    if time_gaps_too_wide(hstu.num_time_buckets, hstu.max_time_gap_seconds):
        return (f"model.hstu.max_time_gap_seconds {hstu.max_time_gap_seconds:g} puts a time bucket past 2^31 s "
                "(about 68 years), beyond the triton attention kernel's 32-bit gaps")
    return None


def attention_kernel_for(hstu: HSTUConfig, device_type: str) -> AttentionKernelName:
    """The kernel this config runs on a device of this type; one line (``InputError``, ``ConfigError``)
    when it would be triton and triton cannot run there or cannot take the config."""
    kernel = resolve_attention_kernel(hstu.attention_kernel, device_type)
    problem = triton_limits_problem(hstu) if kernel == "triton" else None
    if problem is not None:
        raise ConfigError(f"{problem} (model.hstu.attention_kernel = '{hstu.attention_kernel}' runs triton "
                          f"on {device_type.split(':')[0]}; 'grouped' takes any value)")
    return kernel


def rank_device_type(backend: ParallelBackendName) -> str:
    """The device type the ranks will train on, as ``freescale.training.parallel.distributed`` decides it: gloo trains on
    the CPU, nccl on CUDA, auto on CUDA when torch sees a GPU. torch is asked only where a GPU driver
    is present."""
    if backend != "auto":
        return "cpu" if backend == "gloo" else "cuda"
    if sys.platform.startswith("linux") and not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_attention_kernel(config: TrainConfig) -> None:
    """Refuse before any rank starts what the ranks would refuse when they build the model: triton
    where it cannot run, or with a config it cannot take. Imports torch only where the answer
    depends on whether it sees a GPU."""
    hstu = config.model.hstu
    if config.model.encoder != "hstu" or hstu.attention_kernel == "grouped":
        return
    if hstu.attention_kernel == "auto" and triton_limits_problem(hstu) is None:
        return  # either kernel auto picks takes this config
    attention_kernel_for(hstu, rank_device_type(config.parallel.backend))
