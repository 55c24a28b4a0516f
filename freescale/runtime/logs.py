"""Where a job's details go: one log file per `freescale` invocation (stdlib only).

The terminal gets a job's progress and, on failure, one line naming the problem and this
file; stack traces (Python's, the Spark JVM's, torchrun's) go to the file. The file is

    $FREESCALE_LOG_FILE                                      when set (the launcher passes it to its ranks)
    $FREESCALE_LOG_DIR/<job>-<YYYYmmdd-HHMMSS>-<pid>.log     else, FREESCALE_LOG_DIR defaulting to out/logs
                                                             under the working directory (the system temp
                                                             dir's freescale-logs/ when that is not writable)

`--verbose` on any `freescale` subcommand (or FREESCALE_VERBOSE=1, or FREESCALE_DEBUG=1)
leaves every trace on the terminal instead.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

LOG_FILE_ENV = "FREESCALE_LOG_FILE"
LOG_DIR_ENV = "FREESCALE_LOG_DIR"
VERBOSE_ENV = "FREESCALE_VERBOSE"
DEBUG_ENV = "FREESCALE_DEBUG"
DEFAULT_LOG_DIR = Path("out") / "logs"

_log_file: Path | None = None
_verbose = False


def set_verbose(on: bool = True) -> None:
    global _verbose
    _verbose = on


def verbose() -> bool:
    """Traces stay on the terminal: --verbose, FREESCALE_VERBOSE=1 or FREESCALE_DEBUG=1."""
    return _verbose or bool(os.environ.get(VERBOSE_ENV)) or bool(os.environ.get(DEBUG_ENV))


def _can_write_under(folder: Path) -> bool:
    """`folder` exists and is writable, or its nearest existing ancestor is (nothing is created here)."""
    folder = folder.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def log_file(job: str = "freescale") -> Path:
    """This process's log file; the first call names it after `job` (later calls get the same file)."""
    global _log_file
    if os.environ.get(LOG_FILE_ENV):
        return Path(os.environ[LOG_FILE_ENV])
    if _log_file is None:
        folder = Path(os.environ.get(LOG_DIR_ENV) or DEFAULT_LOG_DIR)
        if not _can_write_under(folder):
            folder = Path(tempfile.gettempdir()) / "freescale-logs"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        _log_file = folder / f"{job.replace(' ', '-')}-{stamp}-{os.getpid()}.log"
    return _log_file


def open_log(job: str = "freescale"):
    """The log file opened for appending (its folder created); the caller closes it."""
    path = log_file(job)
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a", encoding="utf-8", errors="replace")


def has_details(job: str = "freescale") -> bool:
    """Something (Spark, the ranks, a traceback) already wrote to this process's log."""
    path = log_file(job)
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def shown(path: Path) -> str:
    """`path` as the error line names it: relative to the working directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (OSError, ValueError):
        return str(path)
