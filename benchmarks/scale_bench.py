"""Scale benchmark of the Spark jobs (issue 18): prepare and balance on N synthetic users.

Runs, each as its own process with a fresh Spark (so every figure includes a JVM start):

1. ``freescale prepare --synthetic-users N --seed S`` (the job as users run it);
2. ``freescale balance`` of that output (``--world-size``, ``--local-batch-size``, ``--window-steps``);
3. a plain-Spark reference on the same interactions: they are first written to Parquet by the
   project's generator (setup, timed but not part of the ratio), then the reference reads them,
   groups by user, collects and sorts each history and writes Parquet: the one shuffle a
   sequence builder cannot avoid. ``prepare / reference`` is the figure to compare across runs:
   it means the same on a busy machine (both slow down together).

For each: wall time, rows/s (interactions in / second) and the driver's peak RSS, sampled every
0.2 s over the job's process tree (the Python driver and its JVM; in local mode the JVM holds the
executors, so this is the whole job's memory). Prints one markdown table.

Usage (from the repository root): python -m benchmarks.scale_bench [--users 1000000] [--items 10000] [--seed 1]
       [--world-size 1024] [--local-batch-size 16] [--window-steps 32] [--workdir DIR] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Run as a file by this interpreter, the repository on its PYTHONPATH (run() sets it).
REFERENCE = textwrap.dedent("""\
    import sys
    from pyspark.sql import functions as F
    from freescale.runtime.session import build_spark_session
    spark = build_spark_session(None, "freescale-scale-reference")
    if sys.argv[1] == "generate":
        from freescale.prepare.synthetic import synthetic_interactions
        synthetic_interactions(spark, int(sys.argv[3]), int(sys.argv[4]), seed=int(sys.argv[5])) \\
            .write.parquet(sys.argv[2])
    else:
        event = F.struct("timestamp", "item", "rating")
        (spark.read.parquet(sys.argv[2]).groupBy("user_id")
         .agg(F.sort_array(F.collect_list(event)).alias("events"))
         .write.parquet(sys.argv[3]))
    spark.stop()
""")


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def run(cmd: list[str], log: Path) -> tuple[float, int]:
    """Run `cmd`; return (wall seconds, peak RSS bytes of its process tree). Fails loudly."""
    path = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "FREESCALE_PROGRESS": "0", "PYTHONPATH": path}
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        peak = [0]

        def sample():
            while proc.poll() is None:
                peak[0] = max(peak[0], _tree_rss(proc.pid))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rc = proc.wait()
        sampler.join()
    wall = time.perf_counter() - started
    if rc != 0:
        sys.exit(f"scale_bench: {' '.join(cmd)} failed (rc {rc}); log: {log}\n{log.read_text()[-3000:]}")
    return wall, peak[0]


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "pipeline", "jobs"], cwd=REPO_ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + (" (+ uncommitted pipeline/jobs edits)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=1_000_000)
    p.add_argument("--items", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--world-size", type=int, default=1024)
    p.add_argument("--local-batch-size", type=int, default=16)
    p.add_argument("--window-steps", type=int, default=32)
    p.add_argument("--workdir", help="scratch directory (default: a new temporary one, removed unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = p.parse_args(argv)

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="scale_bench-"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    ref_script = work / "reference.py"
    ref_script.write_text(REFERENCE)
    load_before = os.getloadavg()
    rows = []
    try:
        prepared = work / "prepared"
        wall, rss = run([py, "-m", "freescale.jobs.prepare", "--output", str(prepared), "--synthetic-users", str(args.users),
                         "--synthetic-items", str(args.items), "--seed", str(args.seed), "--overwrite",
                         "--tracking-uri", "none"], work / "prepare.log")
        meta = json.loads((prepared / "prepare.json").read_text())
        n_rows = meta["input_interactions"]
        rows.append(("prepare", wall, n_rows, rss,
                     f"{meta['users']:,} sequences, {meta['num_items']:,} items, "
                     f"{meta['duplicates_dropped']} duplicates dropped"))

        shards = work / "shards"
        wall, rss = run([py, "-m", "freescale.jobs.balance", "--input", str(prepared), "--output", str(shards),
                         "--world-size", str(args.world_size), "--local-batch-size", str(args.local_batch_size),
                         "--window-steps", str(args.window_steps), "--overwrite", "--tracking-uri", "none"],
                        work / "balance.log")
        rows.append(("balance", wall, meta["users"], rss,
                     f"{args.world_size} ranks x B={args.local_batch_size}, window {args.window_steps} "
                     "(rows = sequences)"))

        raw = work / "interactions.parquet"
        wall, rss = run([py, str(ref_script), "generate", str(raw), str(args.users), str(args.items),
                         str(args.seed)], work / "generate.log")
        rows.append(("(setup) write the synthetic interactions", wall, n_rows, rss, "not in the ratio"))
        wall, rss = run([py, str(ref_script), "reference", str(raw), str(work / "reference_out")],
                        work / "reference.log")
        rows.append(("plain-Spark reference", wall, n_rows, rss,
                     "read, group by user, collect + sort each history, write Parquet"))
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()

    reference = rows[-1][1]
    print(f"scale_bench: {args.users:,} synthetic users x {args.items:,} items, seed {args.seed}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit {git_commit()}; "
          f"{platform.node()} ({os.cpu_count()} CPUs, {platform.platform()}); "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print()
    print("| job | wall s | rows | rows/s | driver peak RSS GiB | / reference | note |")
    print("|---|---|---|---|---|---|---|")
    for name, wall, n, rss, note in rows:
        ratio = f"{wall / reference:.2f}x" if name in ("prepare", "plain-Spark reference") else ""
        print(f"| {name} | {wall:.1f} | {n:,} | {n / wall:,.0f} | {rss / 2**30:.2f} | {ratio} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
