"""What a person sees during a long Spark stage: one line with the stage and the fraction done.

    with spark_progress("prepare"):
        ...   # any Spark work, in this process (the prepare and balance jobs' main)

A daemon thread polls the active SparkContext's status tracker (Spark's own console bar is
off: ``spark.ui.showConsoleProgress=false`` in ``freescale.runtime.session``) and writes

    freescale prepare: stage 12 (parquet at prepare.py:142) 45% (9/20 tasks)

On a terminal the line is rewritten in place (``\\r``) and wiped before anything else is
printed to stdout or stderr, so a job's own lines never land in the middle of it. Elsewhere (a
log, CI) it is a whole line at most every ``every_s`` seconds, the first after ``every_s``
seconds, so a short job prints none. The thread looks for the SparkContext itself: the block
may start Spark or not.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from typing import Iterator, TextIO

PROGRESS_ENV = "FREESCALE_PROGRESS"  # "0": no progress lines (the test suite, which counts a job's lines)
POLL_S = 0.5  # how often the tracker is asked (a few py4j calls)
EVERY_S = 10.0  # at most one line this often when the stream is not a terminal

# PySpark's call sites name the JVM bridge or a full path: "parquet at NativeMethodAccessorImpl.java:0",
# "collect at /work/main/pipeline/ingest.py:300". Keep the action and the file's own name.
# A stage Spark starts from its own threads (a broadcast, adaptive execution) is named after JVM
# internals, "$anonfun$withThreadLocalCaptured$1 at CompletableFuture.java:1768": no name shown.
_JVM_CALLSITE = re.compile(r" at NativeMethodAccessorImpl\.java:\d+$")
_PATH = re.compile(r" at (?:\S*/)?([^/\s]+:\d+)$")
_JVM_INTERNAL = re.compile(r"\$|\.(java|scala):\d+$")


def describe(stages: list[tuple[int, str, int, int]]) -> str | None:
    """``(stage id, name, completed tasks, tasks)`` of the active stages -> the progress text, None
    when nothing runs. Several stages share one line: their tasks add up."""
    stages = sorted(s for s in stages if s[3] > 0)
    if not stages:
        return None
    done, total = sum(s[2] for s in stages), sum(s[3] for s in stages)
    ids = ", ".join(str(s[0]) for s in stages)
    name = _PATH.sub(r" at \1", _JVM_CALLSITE.sub("", stages[0][1]))
    named = f" ({name})" if name and not _JVM_INTERNAL.search(name) else ""
    return f"stage{'s' if len(stages) > 1 else ''} {ids}{named} {100 * done // total}% ({done}/{total} tasks)"


def active_stages() -> list[tuple[int, str, int, int]]:
    """The running stages of this process's SparkContext (none when there is no context)."""
    pyspark = sys.modules.get("pyspark")
    if pyspark is None:  # no Spark in this process (yet): never import it just to ask
        return []
    sc = pyspark.SparkContext._active_spark_context
    if sc is None:
        return []
    tracker = sc.statusTracker()
    found = []
    for stage_id in tracker.getActiveStageIds():
        info = tracker.getStageInfo(stage_id)
        if info is not None:
            found.append((info.stageId, info.name, info.numCompletedTasks, info.numTasks))
    return found


class _WipeFirst:
    """A stream that wipes the progress line before passing writes on (terminal mode only);
    everything else (isatty, fileno, encoding, ...) is the wrapped stream's."""

    def __init__(self, inner: TextIO, reporter: "SparkProgress"):
        self.inner, self.reporter = inner, reporter

    def write(self, text: str) -> int:
        with self.reporter.lock:
            self.reporter.wipe()
            return self.inner.write(text)

    def flush(self) -> None:
        self.inner.flush()

    def __getattr__(self, name):
        return getattr(self.inner, name)


class SparkProgress:
    """The polling thread and what it last wrote. Use :func:`spark_progress`."""

    def __init__(self, job: str, stream: TextIO, tty: bool, poll_s: float, every_s: float):
        self.job, self.stream, self.tty = job, stream, tty
        self.poll_s, self.every_s = poll_s, every_s
        self.lock = threading.RLock()
        self.shown = 0  # characters of the line now on the terminal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"freescale-{job}-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.poll_s + 1)
        with self.lock:
            self.wipe()

    def wipe(self) -> None:
        """Clear the in-place line (caller holds the lock)."""
        if self.shown:
            self.stream.write("\r" + " " * self.shown + "\r")
            self.stream.flush()
            self.shown = 0

    def _run(self) -> None:
        last_line = time.monotonic()
        written = None  # the text last written
        while not self._stop.wait(self.poll_s):
            try:
                text = describe(active_stages())
            except Exception:  # noqa: BLE001 - the context stopping under us; progress is best effort
                text = None
            if text is None or text == written:
                if text is None and self.tty:
                    with self.lock:
                        self.wipe()
                    written = None
                continue
            line = f"freescale {self.job}: {text}"
            with self.lock:
                if self.tty:
                    # Shown before anything else prints? The wrapped streams wipe it first.
                    self.stream.write("\r" + line + " " * max(0, self.shown - len(line)))
                    self.shown = len(line)
                elif time.monotonic() - last_line >= self.every_s:
                    self.stream.write(line + "\n")
                    last_line = time.monotonic()
                else:
                    continue
                self.stream.flush()
                written = text


@contextlib.contextmanager
def spark_progress(job: str, stream: TextIO | None = None, *, tty: bool | None = None,
                   poll_s: float = POLL_S, every_s: float = EVERY_S,
                   enabled: bool | None = None) -> Iterator[SparkProgress | None]:
    """Report the Spark stages that run while the block runs, on ``stream`` (default stderr).

    ``tty`` (default: whether the stream is a terminal) picks the in-place line; on a terminal
    stdout and stderr are wrapped for the block so that whatever prints wipes the line first.
    ``enabled`` defaults to ``$FREESCALE_PROGRESS`` not being ``0``.
    """
    if not (enabled if enabled is not None else os.environ.get(PROGRESS_ENV, "1") != "0"):
        yield None
        return
    stream = stream if stream is not None else sys.stderr
    if tty is None:
        tty = bool(getattr(stream, "isatty", lambda: False)())
    reporter = SparkProgress(job, stream, tty, poll_s, every_s)
    saved = sys.stdout, sys.stderr
    if tty:
        sys.stdout, sys.stderr = _WipeFirst(sys.stdout, reporter), _WipeFirst(sys.stderr, reporter)
        reporter.stream = saved[1] if stream is saved[1] else stream
    reporter.start()
    try:
        yield reporter
    finally:
        reporter.stop()
        if tty:
            sys.stdout, sys.stderr = saved
