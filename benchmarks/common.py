"""What the benchmarks share, in one module: where the repository and MovieLens-100K are, running
`freescale` commands, the 2-rank MovieLens shards and training runs (bubble_bench, comm_bench,
quality_bench, simulate_validation), and the GPU benchmarks' markdown output, the commit a table
was measured on and the modules a bare GPU machine lacks (a benchmark that loaded one refuses to
report).

The benchmarks run as modules from the repository root (``python -m benchmarks.<name>``), which
puts the repository on the path. Standard library only at import, so it loads on the GPU machine
(torch, triton, numpy, pytest and nothing else): what needs more imports it inside the function.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOVIELENS_DIR = (REPO / ".." / "shared" / "data" / "movielens-100k").resolve()
"""MovieLens-100K beside the repository, never copied into it."""
MOVIELENS = MOVIELENS_DIR / "ratings.parquet"
MOVIELENS_USERS = MOVIELENS_DIR / "users.parquet"
FREESCALE = str(Path(sys.executable).parent / "freescale")
"""The `freescale` console script of this interpreter's environment."""
GPU_MACHINE_LACKS = ("torchrec", "fbgemm_gpu", "pyspark", "mlflow", "ortools", "pandas", "pyarrow", "torchdata")


# ---------------------------------------------------------------- freescale commands and 2-rank runs

def freescale(*args: str) -> list[str]:
    """A `freescale` command line run by this interpreter (no console script needed)."""
    return [sys.executable, "-m", "freescale.jobs.cli", *args]


def run(cmd: list[str], log: Path) -> None:
    """Run ``cmd`` in the repository, its output to ``log``; exit naming the log when it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as out:
        rc = subprocess.call(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if rc:
        raise SystemExit(f"command failed ({rc}): {' '.join(cmd)}; see {log}")


def add_run_arguments(parser: argparse.ArgumentParser, workdir: str) -> None:
    """The options every 2-rank MovieLens benchmark shares (shards, runs, reporting)."""
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="passes over the shards per run")
    parser.add_argument("--local-batch-size", type=int, default=16)
    parser.add_argument("--strategy", default="kk")
    parser.add_argument("--calibrate", action="store_true", help="cost model and rank speeds from freescale calibrate")
    parser.add_argument("--workdir", default=workdir)
    parser.add_argument("--tracking-uri", default="none", help="MLflow URI for the runs (default: none)")
    parser.add_argument("--report-only", action="store_true",
                        help="print the tables from the summaries a finished run left in --workdir")


def build_shards(work: Path, args: argparse.Namespace) -> dict[str, Path]:
    """MovieLens-100K prepared once in ``work`` and balanced four ways for 2 ranks by the real jobs:
    ``contiguous``, ``balanced`` (``args.strategy``, with the calibrated cost model and rank
    capacities when ``args.calibrate``), ``flops_kk`` and ``control`` (--control mirror). Reads
    ``args.user_features``, ``args.user_feature_cols`` and add_run_arguments' options."""
    import json

    prepared = work / "prepared"
    if not (prepared / "prepare.json").exists():
        users = ["--user-features", str(MOVIELENS_USERS), "--user-feature-cols", args.user_feature_cols] \
            if args.user_features else []
        run(freescale("prepare", "--input", str(MOVIELENS), *users, "--output", str(prepared), "--overwrite",
                      "--tracking-uri", "none"), work / "prepare.log")
    balance_extra: list[str] = []
    cost_model_args: list[str] = []
    if args.calibrate:
        cost_model, speeds = work / "cost_model.json", work / "rank_speeds.json"
        if not cost_model.exists():
            run(freescale("calibrate", "--output", str(cost_model), "--rank-speeds-output", str(speeds),
                          "--nproc-per-node", "2", "--overwrite", "--tracking-uri", "none"),
                work / "calibrate.log")
        cost_model_args = ["--cost-model", str(cost_model)]  # every variant: comparable predicted bubbles
        if speeds.exists() and json.loads(speeds.read_text()).get("significant"):
            balance_extra += ["--capacities", f"@{speeds}"]
    common = ["--input", str(prepared), "--world-size", "2", "--local-batch-size", str(args.local_batch_size),
              "--seed", "0", "--overwrite", "--tracking-uri", "none", *cost_model_args]
    shards = {
        "contiguous": (["--strategy", "contiguous"], work / "shards-contiguous"),
        "balanced": (["--strategy", args.strategy, *balance_extra], work / f"shards-{args.strategy}"),
        "flops_kk": (["--strategy", "flops_kk"], work / "shards-flops_kk"),  # the default model's width, 64
        "control": (["--strategy", "contiguous", "--control", "mirror"], work / "shards-control"),
    }
    for name, (extra, out) in shards.items():
        run(freescale("balance", *common, "--output", str(out), *extra), work / f"balance-{name}.log")
    return {name: out for name, (_, out) in shards.items()}


def train(shards: Path, steps: int, seed: int, out: Path, args: argparse.Namespace, *extra: str) -> dict:
    """One 2-rank `freescale train` of ``shards`` (``steps`` of them; 0: as the config says), its run
    summary written to ``out`` and returned."""
    from freescale.launch.comparison import train_once  # the one `freescale train` child process, as `freescale compare`

    steps_args = ["--max-steps", str(steps)] if steps else []
    return train_once(shards, out, ["--nproc-per-node", "2", *steps_args, "--tracking-uri",
                                    args.tracking_uri, "--run-name", out.stem, "--training.seed", str(seed),
                                    "--training.log_every", "1000", *extra])["summary"]


def spread(values: list[float], fmt: str = ".4f", scale: float = 1.0) -> str:
    """``median [min, max]`` of ``values * scale``, each formatted by ``fmt``."""
    return f"{statistics.median(values) * scale:{fmt}} [{min(values) * scale:{fmt}}, {max(values) * scale:{fmt}}]"


# ---------------------------------------------------------------- the GPU benchmarks' reports

def loaded_gpu_machine_lacks() -> list[str]:
    """The top-level modules of GPU_MACHINE_LACKS this process has loaded."""
    return sorted({m.split(".")[0] for m in sys.modules} & set(GPU_MACHINE_LACKS))


class Markdown:
    """Lines to the terminal and, when ``output`` is given, appended to that file as they go, so a
    run cut short still leaves its finished tables."""

    def __init__(self, output: str | None) -> None:
        self.output = output

    def emit(self, line: str = "") -> None:
        print(line, flush=True)
        if self.output:
            with open(self.output, "a") as handle:
                handle.write(line + "\n")

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.emit("| " + " | ".join(header) + " |")
        self.emit("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            self.emit("| " + " | ".join(row) + " |")
        self.emit()


def commit() -> str:
    """The short commit of the repository (``FREESCALE_COMMIT`` first: a copied working tree may
    carry stale git metadata). Read from the git directory's files, not by running git: a
    benchmark's smoke run in the fast test tier starts no process."""
    if os.environ.get("FREESCALE_COMMIT"):
        return os.environ["FREESCALE_COMMIT"]
    sha = head_commit(REPO / ".git")
    return sha[:7] if sha else "unknown (no git here; set FREESCALE_COMMIT)"


def head_commit(dot_git: Path) -> str | None:
    """The full hash HEAD names in ``dot_git`` (a directory, or a worktree's ``gitdir:`` file): a
    detached hash, or its branch's loose or packed ref; None when there is none to read."""
    try:
        if dot_git.is_file():
            dot_git = (dot_git.parent / dot_git.read_text().split("gitdir:", 1)[1].strip()).resolve()
        head = (dot_git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head or None
        ref = head[4:].strip()
        common = dot_git / "commondir"  # a worktree's branches live in the main repository's git directory
        roots = [dot_git, (dot_git / common.read_text().strip()).resolve()] if common.is_file() else [dot_git]
        for root in roots:
            if (root / ref).is_file():
                return (root / ref).read_text().strip()
        for root in roots:
            packed = root / "packed-refs"
            for line in packed.read_text().splitlines() if packed.is_file() else ():
                if line.endswith(f" {ref}"):
                    return line.split()[0]
    except (OSError, IndexError):
        return None
    return None
