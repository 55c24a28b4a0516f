"""One rank's loader in history tokens per second: the shard reader, collation into jagged batches, prefetch.

    python -m benchmarks.loader_bench [--samples 8192] [--mean-length 500] [--max-length 4096]
        [--local-batch-size 32] [--repeats 9] [--prefetch 2] [--output FILE.md] [--smoke]
    python -m benchmarks.loader_bench --shards out/demo/shards-kk [--rank 0]   # a balance job's shards

From the repository root. Every training step, each rank's loader (freescale/training/data/shard_reader.py's
``build_loader``, as the trainer builds it) reads its next step's rows from its Parquet shard,
checks them, and collates them into a jagged ``SequenceBatch``; a GPU step that takes less time
than that waits for its data. This measures the loader alone, on CPU, in history tokens delivered
per second (tokens = the items of the histories, ``sum(lengths)``), over one rank's shard of long
histories that it writes itself: log-normal lengths of mean about ``--mean-length`` (sigma 1, as
the GPU virtual-ranks bench draws them) capped at ``--max-length``, in the shard format
(freescale/shards/schema.py) with a sealed manifest, one file in row groups of about 4 MiB as the balance
job writes them (freescale/shards/spark_balance.py's ROW_GROUP_BYTES), snappy, with page checksums. No Spark.
``--shards`` measures a shard set `freescale balance` wrote instead (``--rank``'s shard).

Variants, timed over the whole shard each, ``--repeats`` times, interleaved (a busy machine slows
them alike):

* ``read``: the ShardReader alone (Parquet decode and the per-row-group checks);
* ``read + collate``: ``build_loader(prefetch=0)``, the baseline the ratios are against;
* ``read + collate, prefetch N``: ``build_loader(prefetch=N)``, a background thread N steps ahead
  (the trainer's default, data.prefetch = 2). With nothing else to do in the consuming thread it
  shows what the thread costs or saves; in training it overlaps the loader with the step.

Medians over the repeats, with [min, max]. ``--smoke`` runs toy sizes (the test's).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import Markdown, commit

SIGMA = 1.0
ROW_GROUP_BYTES = 4 << 20
"""The balance job's row-group size (freescale/shards/spark_balance.py; not imported: it loads Spark's helpers)."""
TOKEN_BYTES = 16
"""Per history item in memory: an int32 item, an int64 timestamp, a float32 rating."""
GPU_TOKENS_PER_S = 8e6
"""What one rank's GPU step consumes, by the issue's estimate: the loader should deliver as much."""
NUM_ITEMS = 100_000


@dataclass(frozen=True)
class Sizes:
    samples: int
    mean_length: float
    max_length: int
    local_batch_size: int
    repeats: int


FULL = Sizes(samples=8192, mean_length=500.0, max_length=4096, local_batch_size=32, repeats=9)
SMOKE = Sizes(samples=96, mean_length=20.0, max_length=64, local_batch_size=8, repeats=2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, help=f"histories in the shard (default {FULL.samples})")
    p.add_argument("--mean-length", type=float, help=f"mean history length before the cap (default {FULL.mean_length:g})")
    p.add_argument("--max-length", type=int, help=f"history length cap (default {FULL.max_length})")
    p.add_argument("--local-batch-size", type=int, help=f"samples per step (default {FULL.local_batch_size})")
    p.add_argument("--repeats", type=int, help=f"timed passes per variant (default {FULL.repeats})")
    p.add_argument("--prefetch", type=int, default=2, help="the prefetched variant's depth (default 2, the trainer's)")
    p.add_argument("--shards", help="measure this shard set's --rank (freescale balance's output) instead")
    p.add_argument("--rank", type=int, default=0, help="with --shards: whose shard (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="also write the report to this markdown file")
    p.add_argument("--smoke", action="store_true", help=f"toy sizes ({SMOKE.samples} histories): checks the script")
    args = p.parse_args(argv)
    base = SMOKE if args.smoke else FULL
    for name in ("samples", "mean_length", "max_length", "local_batch_size", "repeats"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(base, name))
    if min(args.samples, args.max_length, args.local_batch_size, args.repeats, args.prefetch) < 1:
        p.error("--samples, --max-length, --local-batch-size, --repeats and --prefetch must be >= 1")
    if not 1 <= args.mean_length <= args.max_length:
        p.error(f"--mean-length must be in 1..--max-length, got {args.mean_length:g}")
    if args.shards and not (Path(args.shards) / "manifest.json").is_file():
        p.error(f"--shards {args.shards}: no manifest.json (not a freescale balance output)")
    return args


# ---------------------------------------------------------------- the shard


def history_lengths(args: argparse.Namespace, rng) -> "object":
    """Log-normal lengths of mean ``--mean-length`` before the cap: exp(mu + sigma^2 / 2) = mean."""
    import numpy as np

    mu = math.log(args.mean_length) - SIGMA * SIGMA / 2
    return np.clip(np.round(rng.lognormal(mu, SIGMA, args.samples)), 1, args.max_length).astype(np.int64)


def shard_table(lengths, local_batch_size: int, rng):
    """The rows of one rank's shard in (step, slot) order, every column of the shard format."""
    import numpy as np
    import pyarrow as pa

    from freescale.costs.cost_model import default_cost_model
    from freescale.shards.schema import arrow_schema

    n, total = len(lengths), int(lengths.sum())
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    row = np.arange(n)
    step = row // local_batch_size
    timestamps = 1_600_000_000 + np.arange(total, dtype=np.int64)  # increasing within every history
    ends = timestamps[np.cumsum(lengths) - 1]
    targets = np.bincount(step, weights=np.maximum(lengths - 1, 0)).astype(np.int64)  # one rank: all of the step
    columns = {
        "step": step, "slot": (row % local_batch_size).astype(np.int32),
        "user_id": pa.array([f"u{i}" for i in row]),
        "items": pa.ListArray.from_arrays(offsets, rng.integers(1, NUM_ITEMS + 1, total, dtype=np.int32)),
        "timestamps": pa.ListArray.from_arrays(offsets, timestamps),
        "ratings": pa.ListArray.from_arrays(offsets, rng.integers(1, 6, total).astype(np.float32)),
        "length": lengths.astype(np.int32), "cost": default_cost_model().predict(lengths),
        "valid_item": rng.integers(1, NUM_ITEMS + 1, n, dtype=np.int32), "valid_timestamp": ends + 1,
        "valid_rating": rng.integers(1, 6, n).astype(np.float32),
        "test_item": rng.integers(1, NUM_ITEMS + 1, n, dtype=np.int32), "test_timestamp": ends + 2,
        "origin_step": step, "step_targets": targets[step],
    }
    schema = arrow_schema()
    return pa.Table.from_arrays([pa.array(columns[f.name], type=f.type) for f in schema], schema=schema)


def write_shard(root: Path, args: argparse.Namespace) -> dict:
    """One rank's shard set in ``root`` (the file and a sealed manifest); what it holds."""
    import numpy as np
    import pyarrow.parquet as pq

    from freescale.costs.cost_model import default_cost_model
    from freescale.shards.file_stats import describe_file
    from freescale.shards.manifest import build_rank_shards, new_manifest
    from freescale.shards.schema import MANIFEST_NAME, rank_dir

    rng = np.random.default_rng(args.seed)
    lengths = history_lengths(args, rng)
    table = shard_table(lengths, args.local_batch_size, rng)
    relative = f"{rank_dir(0)}/part-00000-c000.snappy.parquet"
    (root / rank_dir(0)).mkdir(parents=True)
    rows_per_group = max(1, ROW_GROUP_BYTES // int(TOKEN_BYTES * lengths.mean()))
    pq.write_table(table, root / relative, row_group_size=rows_per_group, compression="snappy",
                   write_page_checksum=True)
    described = describe_file(str(root / relative))
    files = [{"path": relative, "rows": described["rows"], "bytes": described["bytes"],
              "sha256": described["sha256"]}]
    totals = {0: {"tokens": int(lengths.sum()), "cost": float(table["cost"].to_numpy().sum())}}
    b, n = args.local_batch_size, len(lengths)
    manifest = new_manifest(world_size=1, local_batch_size=b, global_batch_size=b, num_steps=-(-n // b),
                            strategy="contiguous", seed=args.seed, cost_model=default_cost_model().to_json(),
                            num_items=NUM_ITEMS, num_samples=n, num_rows=n, columns=table.column_names,
                            ranks=build_rank_shards(files, totals, 1))
    (root / MANIFEST_NAME).write_text(manifest.dumps())
    return {"samples": n, "tokens": int(lengths.sum()), "steps": manifest.num_steps, "files": 1,
            "row_groups": pq.ParquetFile(root / relative).num_row_groups, "bytes": described["bytes"],
            "mean_length": float(lengths.mean()), "max_length": int(lengths.max()), "batch": b}


def describe_shard(root: Path, rank: int) -> dict:
    """What ``rank``'s shard of a balance job's set holds, as write_shard says of its own."""
    import pyarrow.parquet as pq

    from freescale.shards.manifest import load_manifest

    manifest = load_manifest(root, None, rank)
    paths = manifest.rank_paths(rank)
    lengths = [pq.read_table(path, columns=["length"])["length"].to_numpy() for path in paths]
    tokens = sum(int(x.sum()) for x in lengths)
    return {"samples": manifest.ranks[rank].rows, "tokens": tokens, "steps": manifest.num_steps,
            "files": len(paths), "row_groups": sum(pq.ParquetFile(path).num_row_groups for path in paths),
            "bytes": sum(path.stat().st_size for path in paths), "mean_length": tokens / manifest.ranks[rank].rows,
            "max_length": max(int(x.max()) for x in lengths if x.size), "batch": manifest.local_batch_size}


# ---------------------------------------------------------------- timing


def variants(rank: int, prefetch: int) -> dict[str, object]:
    """Variant name -> a function of the manifest giving a fresh iterable over the rank's steps."""
    from freescale.training.data.shard_reader import ShardReader, build_loader

    def read(manifest):
        reader = ShardReader(manifest, rank)
        reader.reset()
        return reader

    return {"read": read,
            "read + collate": lambda manifest: build_loader(manifest, rank, prefetch=0),
            f"read + collate, prefetch {prefetch}": lambda manifest: build_loader(manifest, rank, prefetch=prefetch)}


def one_pass(source) -> tuple[float, int, int]:
    """Seconds to drain ``source``, the tokens delivered and the items (steps) it gave."""
    import pyarrow.compute as pc

    tokens = items = 0
    start = time.perf_counter()
    for item in source:
        # A reader's item is a step's Arrow rows, a loader's a collated batch: count tokens either way.
        tokens += item.num_tokens if hasattr(item, "num_tokens") else (pc.sum(item.rows["length"]).as_py() or 0)
        items += 1
    return time.perf_counter() - start, tokens, items


def measure(root: Path, rank: int, args: argparse.Namespace) -> list[dict]:
    """Every variant ``--repeats`` times, interleaved; one row per variant."""
    from freescale.shards.manifest import load_manifest

    manifest = load_manifest(root, None, rank)
    ways = variants(rank, args.prefetch)
    runs: dict[str, list[tuple[float, int, int]]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, make in ways.items():
            runs[name].append(one_pass(make(manifest)))
    rows = []
    for name, passes in runs.items():
        rates = [tokens / seconds for seconds, tokens, _ in passes]
        rows.append({"variant": name, "median": statistics.median(rates), "min": min(rates), "max": max(rates),
                     "batches": passes[0][2], "tokens": passes[0][1]})
    baseline = next(r["median"] for r in rows if r["variant"] == "read + collate")
    for row in rows:
        row["ratio"] = row["median"] / baseline
    return rows


# ---------------------------------------------------------------- report


def report(out: Markdown, args: argparse.Namespace, shard: dict, rows: list[dict], seconds: float) -> None:
    import pyarrow as pa
    import torch

    out.emit("# One rank's loader: history tokens per second on CPU")
    out.emit()
    if args.smoke:
        out.emit("**SMOKE RUN: toy sizes, nothing here is a measurement.**")
        out.emit()
    out.emit(f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}")
    out.emit(f"- commit: {commit()}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    out.emit(f"- machine: {platform.node()}, {os.cpu_count()} CPUs (load average {load}), Python "
             f"{platform.python_version()}, pyarrow {pa.__version__} ({pa.cpu_count()} threads), torch {torch.__version__}")
    out.emit(f"- command: python -m benchmarks.loader_bench {' '.join(sys.argv[1:])}".rstrip())
    made = (f"rank {args.rank} of {args.shards}" if args.shards else
            f"written here: log-normal lengths, sigma {SIGMA:g}, capped at {args.max_length}")
    out.emit(f"- shard: {made}; {shard['samples']} histories, {shard['tokens']:,} tokens (mean length "
             f"{shard['mean_length']:.0f}, longest {shard['max_length']}), {shard['steps']} steps of "
             f"{shard['batch']} per rank, {shard['files']} file(s) of {shard['bytes'] / 2**20:.1f} MiB in "
             f"{shard['row_groups']} row groups")
    out.emit(f"- {args.repeats} passes per variant, interleaved; medians [min, max]; {seconds:.0f} s in all")
    out.emit()
    out.table(["variant", "median tokens/s", "[min, max]", "batches", "vs read + collate"],
              [[r["variant"], f"{r['median'] / 1e6:.2f}M", f"[{r['min'] / 1e6:.2f}M, {r['max'] / 1e6:.2f}M]",
                str(r["batches"]), f"{r['ratio']:.2f}x"] for r in rows])
    best = max(rows[1:], key=lambda r: r["median"])
    out.emit(f"A GPU step needs about {GPU_TOKENS_PER_S / 1e6:.0f}M tokens/s per rank; the fastest loader here "
             f"({best['variant']}) delivers {best['median'] / 1e6:.2f}M, {best['median'] / GPU_TOKENS_PER_S:.0%} of it.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text("")
    started = time.perf_counter()
    if args.shards:
        shard = describe_shard(Path(args.shards), args.rank)
        rows = measure(Path(args.shards), args.rank, args)
    else:
        with tempfile.TemporaryDirectory(prefix="loader_bench-") as tmp:
            shard = write_shard(Path(tmp) / "shards", args)
            rows = measure(Path(tmp) / "shards", 0, args)
    report(Markdown(args.output), args, shard, rows, time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
