"""One job per folder: a lock file naming its holder (host, PID, process start time).

Stdlib only, so both the trainer's checkpoint folder (freescale/training/checkpoint/checkpointer.py) and
`freescale pipeline`'s working directory (freescale/jobs/workflow/run.py) use it without loading torch.
The lock is created whole or not at all (a hard link of a written file), so a reader never
sees half of one. A lock whose holder is gone (a dead PID on this host, or a PID reused by
a later process: the start time differs) is stale and taken over; a lock from another host
cannot be checked from here and is never taken over.
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

Refusal = Literal["alive", "other_host", "race"]
"""Why a lock was not taken: its holder runs, it is held from another host (unknowable), or
another process took it in the same instant."""


@dataclass(frozen=True)
class Refused:
    reason: Refusal
    holder: dict[str, Any] | None
    """The lock's content: ``host``, ``pid``, ``start`` (None for ``race``)."""


def acquire(path: Path, on_stale: Callable[[str], None]) -> Refused | None:
    """Create the lock `path` for this process; None when taken. A stale lock is removed, after
    ``on_stale(description of its dead holder)``, and taken like a free one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        if _create_exclusive(path, this_process()):
            return None
        holder = read_lock(path)
        if holder is None and not path.exists():
            continue  # released between our two looks
        if holder is not None and alive(holder):
            return Refused("other_host" if holder.get("host") != socket.gethostname() else "alive", holder)
        on_stale(describe(holder))
        path.unlink(missing_ok=True)
    return Refused("race", None)


def release(path: Path) -> None:
    """Remove the lock if this process holds it (safe to call more than once)."""
    if read_lock(path) == this_process():
        path.unlink(missing_ok=True)


def this_process() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (Linux), which tells a reused PID from its first
    owner; None when unknown (no /proc) or when the process is a zombie (dead, not yet reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def alive(holder: dict[str, Any]) -> bool:
    """Whether the lock's holder still runs; a holder on another host is assumed to."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = int(holder.get("pid", -1))
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    if not Path("/proc").is_dir():
        return True
    started = _start_time(pid)
    return started is not None and holder.get("start") in (None, started)


def describe(holder: dict[str, Any] | None) -> str:
    return "an unreadable holder" if holder is None else f"PID {holder.get('pid')} on {holder.get('host')}"


def _create_exclusive(path: Path, holder: dict[str, Any]) -> bool:
    """Create `path` holding `holder`, complete or not at all (hard link of a written
    file): a reader never sees a half-written lock. False when it already exists."""
    staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    staging.write_text(json.dumps(holder) + "\n")
    try:
        os.link(staging, path)
        return True
    except FileExistsError:
        return False
    finally:
        staging.unlink(missing_ok=True)


def read_lock(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else None
    except (OSError, ValueError):
        return None
