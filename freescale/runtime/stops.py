"""Stop signals: a scheduler's SIGTERM, or Ctrl-C, ends a job as stopped, not failed (its MLflow
run KILLED, its staging folder removed), however the exception that carries the stop is replaced on
the way out. Used by every job's error handling (freescale/runtime/job_errors.py), atomic outputs and the pipeline.
Standard library only.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator


class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGINT), raised in the main thread so the job's MLflow run ends
    KILLED. A BaseException: no `except Exception` on the way may take it for an error."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


# The stop signal received inside `stops_on_signals`, kept apart from the exception that carries it:
# on its way out the Stopped can be replaced by another error (a cleanup's own; a py4j call failing
# because the signal took Spark's JVM down with the process group), and the job must still end as
# stopped, whichever error surfaces.
_received: list[int] = []


def stop_signal() -> int | None:
    """The stop signal this process received inside `stops_on_signals`; None when none has."""
    return _received[0] if _received else None


def stop_of(exc: BaseException) -> int | None:
    """The stop signal that `exc` carries (Stopped; KeyboardInterrupt is Ctrl-C's SIGINT) or stands in
    for (any error, once a stop was received: see stop_signal); None when the job was not stopped."""
    if isinstance(exc, Stopped):
        return exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return stop_signal() or signal.SIGINT
    return stop_signal()


@contextlib.contextmanager
def stops_on_signals() -> Iterator[None]:
    """For the block: SIGTERM (a scheduler's stop) raises Stopped in the main thread, once (a second
    signal must not cut the cleanup short), and SIGINT raises KeyboardInterrupt as Python's own handler
    does; either is remembered (stop_signal) until the block ends. Off the main thread, where no signal
    is delivered, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # SIGINT only where Python's own handler has it: a process started with SIGINT ignored keeps ignoring it.
    signals = (signal.SIGTERM,) + ((signal.SIGINT,) if signal.getsignal(signal.SIGINT) is signal.default_int_handler
                                   else ())
    previous = {signum: signal.signal(signum, _stop) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _received.clear()


def _stop(signum: int, frame: object) -> None:
    first = not _received
    if first:
        _received.append(signum)
    _drop_interrupted_jvm_call()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    if first:
        raise Stopped(signum)


def _drop_interrupted_jvm_call() -> None:
    """The signal may have landed in the middle of a JVM call (a Spark action): see
    freescale.runtime.session.drop_gateway_connection. A process that never built a Spark session has none."""
    session = sys.modules.get("freescale.runtime.session")
    if session is None:
        return
    try:
        session.drop_gateway_connection()
    except Exception:  # noqa: BLE001 - raised here, it would replace the stop itself
        pass
