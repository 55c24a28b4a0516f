"""How much memory planning K ranks takes, against what this machine has: `freescale simulate`
refuses a K up front (simulation_spec's check) rather than failing in a MemoryError after minutes
of allocating. NumPy-free; the bytes per sample are freescale/balancing/simulate.py's measurement.
"""
from __future__ import annotations

import re
from pathlib import Path

from freescale.balancing.simulate import PLAN_BYTES_PER_SAMPLE, plan_memory_bytes
from freescale.runtime.errors import InputError


def available_memory_bytes() -> int | None:
    """Memory this process may still take: the kernel's MemAvailable, capped by the cgroup's
    limit when one is set; None where neither can be read (no bound is applied)."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = int(re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.M).group(1)) * 1024
    except (OSError, AttributeError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def check_plan_memory(world_sizes: list[int], local_batch_size: int, steps: int) -> None:
    """Refuse up front a K whose plans would not fit in this machine's memory: planning starts
    by drawing K x B x steps sample lengths, and a MemoryError after minutes of allocating
    names nothing."""
    available = available_memory_bytes()
    if available is None:
        return
    k = max(world_sizes)
    needed = plan_memory_bytes(k, local_batch_size, steps)
    if needed > available:
        raise InputError(f"--world-sizes: K={k} needs about {needed / 2**30:.3g} GiB to plan ({k} ranks x "
                         f"{local_batch_size} samples x {steps} steps x {PLAN_BYTES_PER_SAMPLE} bytes), more than "
                         f"the {available / 2**30:.3g} GiB of memory available here; simulate fewer ranks, "
                         "--steps or --local-batch-size")
