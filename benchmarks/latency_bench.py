"""Benchmark: how long the quick answers take -- the wall-clock targets the test suite used to assert.

Usage (from the repository root): python -m benchmarks.latency_bench [--repeats 3]

Each row is the best of --repeats fresh tries, against its target:
- `freescale balance --world-size 0`: an argument error before any heavy import (< 1 s);
- `freescale prepare` / `balance` on a missing input: reported before Spark starts (< 10 s);
- the MLflow reachability check of an unreachable server (< 6 s);
- kk on 64 x 64 heavy-tailed costs (solve time < 2 s).

The tests keep the structural checks (nothing heavy imported, one line, exit 2); the clock is
here, where a loaded machine makes a slow row rather than a failed suite. Prints a markdown
table; exits 1 when a row misses its target.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import FREESCALE, REPO

DEAD_URI = "http://127.0.0.1:9/"  # the discard port: nothing listens, the connection is refused


def command_seconds(argv: list[str], expect_code: int, expect_text: str) -> float:
    """Seconds a command took to give its expected answer (exit status and stderr text)."""
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    if done.returncode != expect_code or expect_text not in done.stderr:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}, expected {expect_code} and "
                           f"{expect_text!r}: {done.stderr[-500:]}")
    return seconds


def reachability_seconds() -> float:
    code = ("import time\nfrom freescale.tracking.store import reachable_tracking_uri\n"
            f"start = time.perf_counter()\nreachable_tracking_uri('balance', {DEAD_URI!r})\n"
            "print(time.perf_counter() - start)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=True)
    return float(done.stdout.strip().splitlines()[-1])


def kk_solve_seconds() -> float:
    import numpy as np

    from freescale.balancing import partition

    rng = np.random.default_rng(5)
    lengths = np.clip(np.round(rng.lognormal(4.2, 0.9, 64 * 64)), 20, 1024).astype(np.int64)
    return float(partition(lengths**2 + 160.0 * lengths + 1000.0, 64).solve_time_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        missing = str(Path(tmp) / "nowhere.parquet")
        rows = [
            ("balance argument error", 1.0, lambda: command_seconds(
                [FREESCALE, "balance", "--input", "x", "--output", "y", "--world-size", "0",
                 "--local-batch-size", "4"], 2, "--world-size must be a positive integer")),
            ("prepare, missing input", 10.0, lambda: command_seconds(
                [FREESCALE, "prepare", "--input", missing, "--output", str(Path(tmp) / "p"),
                 "--tracking-uri", "none"], 2, "does not exist")),
            ("balance, missing input", 10.0, lambda: command_seconds(
                [FREESCALE, "balance", "--input", missing, "--output", str(Path(tmp) / "b"), "--world-size", "2",
                 "--local-batch-size", "4", "--tracking-uri", "none"], 2, "does not exist")),
            ("unreachable MLflow check", 6.0, reachability_seconds),
            ("kk solve, 64 x 64 heavy-tailed", 2.0, kk_solve_seconds),
        ]
        print("| what | best of {} (s) | target (s) | met |".format(args.repeats))
        print("| --- | --- | --- | --- |")
        misses = 0
        for name, target, measure in rows:
            best = min(measure() for _ in range(args.repeats))
            misses += best >= target
            print(f"| {name} | {best:.2f} | < {target:g} | {'yes' if best < target else 'NO'} |", flush=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
