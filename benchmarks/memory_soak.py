"""Memory soak: does a long training hold its memory flat, in every comm mode?

Trains the 2-rank run for many steps in each comm mode and samples every rank's resident
memory (VmRSS) as it goes, with the step it was at. After warm-up the growth is the slope of
a least-squares line through (step, RSS), per rank, in MB per 1,000 steps. The target is under
20 MB per 1,000 steps on every rank: a leak of a few kB a step shows, and a leak like the one
this benchmark was written for (every step's embedding exchange kept alive, ~4 MB a step)
fails within a few hundred steps.

The data is seeded synthetic with the shape of a real short-history dataset (31,000 users,
10,000 items, a heavy-tailed length distribution), prepared and balanced once in the
workdir; the model is ``configs/short_history.toml``'s. Checkpoints and MLflow are off;
early stopping is off so every run trains its steps.

Usage (from the repository root): python -m benchmarks.memory_soak [--steps 20000] [--modes plain,overlap,prioritized]
           [--workdir out/memory-soak] [--local-batch-size 16] [--warmup 2000] [--parallel]
           [--json FILE] [--section.key value ...: passed to freescale train]

Prints a markdown table; exits 1 when a rank misses the target or a run fails.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.common import FREESCALE, REPO

MODES = ("plain", "overlap", "prioritized")
TARGET_MB_PER_1000 = 20.0
STEP_LINE = re.compile(r"^step (\d+)/(\d+)")
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "FREESCALE_PROGRESS": "0"}


@dataclass
class Soak:
    """One mode's run: RSS samples per rank as (step, MB)."""

    mode: str
    samples: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    step: int = 0
    code: int | None = None
    seconds: float = 0.0
    tail: list[str] = field(default_factory=list)


def prepare_shards(work: Path, users: int, batch: int) -> Path:
    """Synthetic sequences and 2-rank kk shards, made once per workdir and shape."""
    prepared, shards = work / f"prepared-{users}", work / f"shards-{users}-b{batch}"
    if not (prepared / "prepare.json").exists():
        run([FREESCALE, "prepare", "--output", str(prepared), "--synthetic-users", str(users), "--seed", "1",
             "--tracking-uri", "none"])
    if not (shards / "manifest.json").exists():
        run([FREESCALE, "balance", "--input", str(prepared), "--output", str(shards), "--world-size", "2",
             "--local-batch-size", str(batch), "--tracking-uri", "none"])
    return shards


def run(argv: list[str]) -> None:
    done = subprocess.run(argv, env=ENV, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"memory_soak: {' '.join(argv[:2])} failed (exit {done.returncode}): "
                 f"{(done.stderr.strip().splitlines() or [''])[-1]}")


def rank_processes(root: int) -> dict[int, int]:
    """rank -> pid of the training ranks under ``root`` (torchrun's children, found by RANK)."""
    ranks = {}
    for pid in descendants(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"freescale.jobs.train" not in cmdline:
                continue
            environ = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                           if b"=" in item)
        except OSError:  # gone between listing and reading
            continue
        if b"RANK" in environ:
            ranks[int(environ[b"RANK"])] = pid
    return ranks


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def soak(result: Soak, shards: Path, config: str, steps: int, every_s: float, extra: list[str]) -> None:
    """Train ``steps`` steps in ``result.mode``; sample every rank's RSS every ``every_s`` seconds."""
    mode = result.mode
    argv = [FREESCALE, "train", "--shards", str(shards), "--config", config, "--comm-mode", mode,
            "--max-steps", str(steps), "--tracking-uri", "none", "--training.log_every", "50",
            # Early stopping off first (it needs validations), so every run trains its steps.
            "--evaluation.patience", "0", "--evaluation.every_epochs", "0",
            "--training.eval_max_samples", "64", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read() -> None:
        for line in proc.stdout:
            match = STEP_LINE.match(line)
            if match:
                result.step = int(match.group(1))
            result.tail = [*result.tail[-4:], line.rstrip()]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        for rank, pid in rank_processes(proc.pid).items():
            mb = rss_mb(pid)
            # Training steps only: the run's end (its test-item evaluation) is not a step.
            if mb is not None and 0 < result.step < steps:
                result.samples.setdefault(rank, []).append((result.step, mb))
        time.sleep(every_s)
    reader.join(timeout=10)
    result.code, result.seconds = proc.returncode, time.perf_counter() - start
    print(f"memory_soak: {mode} done in {result.seconds:.0f} s (exit {result.code})", file=sys.stderr, flush=True)


def slope_mb_per_1000(samples: list[tuple[int, float]], warmup: int) -> float:
    """Least-squares RSS growth after ``warmup`` steps, MB per 1,000 steps."""
    points = np.array([s for s in samples if s[0] >= warmup], dtype=float)
    if len(points) < 3 or np.ptp(points[:, 0]) == 0:
        return float("nan")
    return float(np.polyfit(points[:, 0], points[:, 1], 1)[0] * 1000)


def table(results: list[Soak], warmup: int) -> tuple[str, bool]:
    lines = ["| comm mode | rank | steps | RSS at warm-up (MB) | RSS at end (MB) | max RSS (MB) | "
             "growth after warm-up (MB / 1,000 steps) | target < 20 | wall |",
             "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for result in results:
        if result.code is None:
            lines.append(f"| {result.mode} | - | {result.step} | - | - | - | - | running | - |")
            ok = False
            continue
        if result.code != 0 or not result.samples:
            ok = False
            lines.append(f"| {result.mode} | - | {result.step} | - | - | - | - | run failed (exit {result.code}): "
                         f"{result.tail[-1] if result.tail else ''} | {result.seconds:.0f} s |")
            continue
        for rank in sorted(result.samples):
            samples = result.samples[rank]
            after = [mb for step, mb in samples if step >= warmup] or [float("nan")]
            slope = slope_mb_per_1000(samples, warmup)
            met = bool(slope < TARGET_MB_PER_1000)  # nan (too few samples) misses
            ok &= met
            lines.append(f"| {result.mode} | {rank} | {result.step} | {after[0]:.0f} | {samples[-1][1]:.0f} | "
                         f"{max(mb for _, mb in samples):.0f} | {slope:+.2f} | {'met' if met else 'MISSED'} | "
                         f"{result.seconds:.0f} s |")
    return "\n".join(lines), ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000,
                        help="steps before the slope is fitted (allocator and caches settle)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workdir", default="out/memory-soak")
    parser.add_argument("--users", type=int, default=31000)
    parser.add_argument("--local-batch-size", type=int, default=16)
    parser.add_argument("--shards", help="train on this shard set (2 ranks) instead of the synthetic one")
    parser.add_argument("--config", default=str(REPO / "configs" / "short_history.toml"))
    parser.add_argument("--every", type=float, default=2.0, help="seconds between RSS samples")
    parser.add_argument("--json", help="also write the samples and the table here (rewritten as the runs go)")
    parser.add_argument("--parallel", action="store_true", help="run the modes at the same time")
    args, extra = parser.parse_known_args()
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES) or args.warmup >= args.steps:
        parser.error(f"--modes: a comma list of {', '.join(MODES)}; --warmup must be below --steps")
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    shards = Path(args.shards).resolve() if args.shards else prepare_shards(work, args.users, args.local_batch_size)
    results = [Soak(mode) for mode in modes]
    runs = [threading.Thread(target=soak, args=(result, shards, args.config, args.steps, args.every, extra))
            for result in results]
    # --parallel: all modes at once (each rank's RSS is its own; only the wall time is shared).
    for run_ in runs:
        run_.start()
        while not args.parallel and run_.is_alive():
            run_.join(timeout=30)
            record(args.json, results, args.warmup, shards)
    while any(run_.is_alive() for run_ in runs):
        time.sleep(30)
        record(args.json, results, args.warmup, shards)
    text, ok = record(args.json, results, args.warmup, shards)
    print(text)
    return 0 if ok else 1


def record(path: str | None, results: list[Soak], warmup: int, shards: Path) -> tuple[str, bool]:
    """The table so far, and the samples to ``path`` (rewritten as the runs go: a long soak
    cut short still leaves what it measured)."""
    text, ok = table(results, warmup)
    if path:
        Path(path).write_text(json.dumps({"table": text, "warmup": warmup, "shards": str(shards),
                                          "runs": [{"mode": r.mode, "steps": r.step, "exit": r.code,
                                                    "seconds": r.seconds, "samples": r.samples}
                                                   for r in results]}, indent=1))
    return text, ok


if __name__ == "__main__":
    sys.exit(main())
