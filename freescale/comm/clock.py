"""When a rank's collectives are in flight, and when its compute thread waits on them.

Every asynchronous collective is registered with the rank's :class:`CommClock` when
it is issued; the backend's completion callback stamps when it finished (from the
transport's own thread), and every ``wait`` made by the compute thread is timed.
Per step the clock reports

* ``comm_s``: the time at least one collective was in flight (the union of
  ``[issued, finished]`` intervals, clipped to the step);
* ``exposed_comm_s``: the time the compute thread spent blocked in ``wait``;
* ``waits``: those blocked intervals, so the step timer (freescale/training/timing/step_timer.py) can take
  the ones that fall inside the dense span out of its dense compute time.

An interval ends at the later of the completion stamp and the end of any wait on
it, so a wait always lies inside its collective's interval and
``exposed_comm_s <= comm_s`` holds by measurement, not by clamping.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from freescale.comm.base import Work


@dataclass
class _InFlight:
    name: str
    issued: float
    finished: float | None = None


@dataclass
class StepComm:
    """What the clock saw in one step (seconds)."""

    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    waits: list[tuple[float, float]] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)


class Tracked:
    """A collective's :class:`Work` whose ``wait`` is timed on the compute thread."""

    def __init__(self, clock: "CommClock", work: Work, entry: _InFlight):
        self._clock, self._work, self._entry = clock, work, entry
        self._waited = False

    def wait(self) -> None:
        if self._waited:
            return
        start = time.perf_counter()
        self._work.wait()
        end = time.perf_counter()
        self._waited = True
        self._clock._waited(self._entry, start, end)

    def is_completed(self) -> bool:
        return self._work.is_completed()


class CommClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[_InFlight] = []
        self._waits: list[tuple[float, float]] = []
        self.issue_log: list[str] = []
        """Names of the collectives issued since the last ``close_step``, in issue order."""
        self.step_issue_log: list[str] = []
        """``issue_log`` of the step ``close_step`` last closed."""

    def track(self, name: str, work: Work) -> Tracked:
        entry = _InFlight(name, time.perf_counter())
        with self._lock:
            self._entries.append(entry)
        self.issue_log.append(name)
        work.on_complete(lambda: self._finished(entry, time.perf_counter()))
        return Tracked(self, work, entry)

    def _finished(self, entry: _InFlight, at: float) -> None:
        with self._lock:
            entry.finished = at if entry.finished is None else max(entry.finished, at)

    def _waited(self, entry: _InFlight, start: float, end: float) -> None:
        with self._lock:
            entry.finished = end if entry.finished is None else max(entry.finished, end)
            if not any(e is entry for e in self._entries):  # finished in an earlier step, waited now
                entry.issued = start
                self._entries.append(entry)
            self._waits.append((start, end))

    def close_step(self, start: float, end: float) -> StepComm:
        """The step ``[start, end]``: in-flight union and waits; finished intervals are
        forgotten, ones still in flight carry into the next step."""
        with self._lock:
            intervals = [(max(e.issued, start), min(e.finished if e.finished is not None else end, end))
                         for e in self._entries]
            self._entries = [e for e in self._entries if e.finished is None or e.finished > end]
            waits = [(max(a, start), min(b, end)) for a, b in self._waits]
            self._waits = []
        self.step_issue_log, self.issue_log = self.issue_log, []
        intervals = [(a, b) for a, b in intervals if b > a]
        waits = [(a, b) for a, b in waits if b > a]
        return StepComm(comm_s=union_length(intervals), exposed_comm_s=sum(b - a for a, b in waits),
                        waits=waits, intervals=intervals)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by at least one interval."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


def overlap_length(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of ``[start, end]`` covered by at least one interval."""
    return union_length([(max(a, start), min(b, end)) for a, b in intervals if min(b, end) > max(a, start)])
