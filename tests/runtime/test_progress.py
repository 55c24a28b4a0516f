"""The Spark progress line (freescale/runtime/progress.py) on real Spark jobs, and the training ETA line."""
from __future__ import annotations

import contextlib
import re
import sys
import threading
import time

from freescale.runtime.progress import describe, spark_progress
from freescale.training.timing.step_report import format_step_line

LINE = re.compile(r"^freescale test: stage (\d+) \(count at test_progress\.py:\d+\) (\d+)% \((\d+)/8 tasks\)$")


class Recorder:
    """A stream that keeps each write with the time it came."""

    def __init__(self):
        self.writes: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.writes.append((time.monotonic(), text))
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _slow_job(spark, seconds_per_task: float = 0.4) -> int:
    # 8 tasks on local[2]: about 4 x seconds_per_task of wall time.
    return spark.sparkContext.parallelize(range(8), 8).map(lambda x: time.sleep(seconds_per_task) or x).count()


def test_describe_adds_up_active_stages_and_shortens_names():
    assert describe([]) is None
    assert describe([(3, "parquet at NativeMethodAccessorImpl.java:0", 9, 20)]) == "stage 3 (parquet) 45% (9/20 tasks)"
    assert (describe([(7, "x at y.py:2", 1, 4), (5, "collect at /work/main/pipeline/ingest.py:300", 2, 4)])
            == "stages 5, 7 (collect at ingest.py:300) 37% (3/8 tasks)")
    assert (describe([(17, "$anonfun$withThreadLocalCaptured$1 at CompletableFuture.java:1768", 0, 1)])
            == "stage 17 0% (0/1 tasks)")


def test_lines_name_the_stage_and_fraction_and_are_throttled(spark):
    out = Recorder()
    started = time.monotonic()
    with spark_progress("test", out, poll_s=0.05, every_s=0.5, enabled=True):
        assert _slow_job(spark) == 8
    lines = [(t, text) for t, text in out.writes]
    assert lines, "no progress line during a ~1.6 s stage"
    for _, text in lines:
        assert text.endswith("\n") and "\r" not in text
        match = LINE.match(text.rstrip("\n"))
        assert match, text
        done = int(match.group(3))
        assert int(match.group(2)) == 100 * done // 8
    times = [started] + [t for t, _ in lines]
    # Never more often than every_s, the first not before every_s: a short job prints nothing.
    assert min(b - a for a, b in zip(times, times[1:])) >= 0.5


def test_terminal_line_is_rewritten_in_place_and_wiped_before_other_output(spark):
    out = Recorder()
    out.isatty = lambda: True  # a terminal
    with contextlib.redirect_stdout(out), spark_progress("test", out, poll_s=0.05, enabled=True) as reporter:
        job = threading.Thread(target=_slow_job, args=(spark,))
        job.start()
        deadline = time.monotonic() + 60
        while not reporter.shown and time.monotonic() < deadline:
            time.sleep(0.02)
        print("a line of the job's own")
        assert sys.stdout.isatty() is True  # the wrapped stream answers
        job.join()
    texts = [text for _, text in out.writes]
    shown = [t for t in texts if t.startswith("\r") and t.strip()]
    assert shown and all(LINE.match(t[1:].rstrip()) for t in shown), shown
    assert not any("\n" in t for t in shown)  # in place, never a new line of its own
    own = texts.index("a line of the job's own")
    assert re.fullmatch(r"\r +\r", texts[own - 1]), texts[own - 2:own + 1]  # wiped first
    assert re.fullmatch(r"\r +\r", texts[-1]) or texts[-1] == "\n"  # nothing left on the line at the end


def test_training_step_line():
    assert (format_step_line(step=119, max_steps=400, loss=5.3149, step_s=0.142, eta_s=40.2)
            == "step 120/400  loss 5.3149  142 ms/step  ETA 40 s")
    assert format_step_line(step=0, max_steps=4000, loss=10.77, step_s=1.5, eta_s=5400) == (
        "step 1/4000  loss 10.7700  1500 ms/step  ETA 1 h 30 min")
    assert format_step_line(step=399, max_steps=400, loss=1.0, step_s=0.05, eta_s=0.0).endswith("ETA 0 s")
    assert "ETA 2 min 5 s" in format_step_line(step=9, max_steps=400, loss=1.0, step_s=0.05, eta_s=125)
    assert (format_step_line(step=9, max_steps=40, loss=6.75, step_s=0.2084, eta_s=6.3, bubble=0.149,
                             exposed_comm_s=0.0746)
            == "step 10/40  loss 6.7500  208 ms/step  bubble 14.9%  exposed comm 75 ms  ETA 6 s")


def _planner_noise(monkeypatch, verbose: bool) -> list[str]:
    """What building the sharding planner warns (logging records and Python warnings)."""
    import logging
    import types
    import warnings

    import torch

    from freescale.training.parallel import sharding
    from freescale.training.config import ParallelConfig
    from freescale.training.parallel.distributed import DistEnv

    from freescale.runtime import logs

    monkeypatch.setattr(logs, "_verbose", verbose)  # what --verbose sets
    for name in (logs.VERBOSE_ENV, logs.DEBUG_ENV):
        monkeypatch.delenv(name, raising=False)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    keep = Keep(logging.WARNING)
    logging.getLogger().addHandler(keep)
    try:
        with warnings.catch_warnings(record=True) as caught:  # the filter it adds ends with the block
            warnings.simplefilter("always")
            sharding.apply_quiet_third_party_logs()
            env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"),
                          backend="gloo")
            sharding.build_planner(ParallelConfig(), env, types.SimpleNamespace(user_feature_names=[]))
        return seen + [str(w.message) for w in caught]
    finally:
        logging.getLogger().removeHandler(keep)
        for name in sharding._NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)


def test_planner_warnings_silenced_unless_verbose(monkeypatch):
    loud = _planner_noise(monkeypatch, verbose=True)
    assert any("TopologyFactory" in m for m in loud) and any("HeuristicalStorageReservation" in m for m in loud), loud
    assert _planner_noise(monkeypatch, verbose=False) == []
