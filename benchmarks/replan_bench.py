"""How long a resume on another world size takes to re-plan the rest of an epoch (freescale/shards/replan.py).

    python -m benchmarks.replan_bench [--samples 1000000] [--ranks 1024] [--to-ranks 1016,512]
        [--local-batch-size 16] [--trained 0.5] [--repeats 3] [--output FILE.md] [--smoke]

From the repository root. `freescale train --nproc-per-node K'` on the checkpoint of a K-rank run
re-plans, in the launcher before any rank starts, every sample the checkpoint's epoch has not trained
(``freescale.shards.replan.replan``): it reads the ``step``, ``cost`` and ``length`` columns of every rank's
files, plans the rest for K' ranks with the manifest's strategy, and writes the re-plan. This times
those three parts on a synthetic shard set of ``--samples`` samples over ``--ranks`` ranks (one file
per rank, in the shard format's column types, holding only the three columns the re-plan reads:
Parquet reads only those column chunks of a real file too), log-normal lengths (sigma 1, mean about
200, capped at 4096) costed by a quadratic model, checkpointed ``--trained`` of the way through
epoch 0. Medians of ``--repeats`` with [min, max]. ``--smoke`` runs toy sizes (the test's).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Markdown, spread


def write_plan_columns(root: Path, samples: int, ranks: int, local_batch: int, seed: int = 0) -> Path:
    """A sealed shard set of ``samples`` over ``ranks`` ranks holding the re-plan's columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from freescale.shards.manifest import seal
    from freescale.shards.schema import MANIFEST_FORMAT

    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.ceil(rng.lognormal(np.log(120), 1.0, samples)), 4096).astype(np.int32)
    costs = 1e-6 * lengths.astype(np.float64) ** 2 + 1e-4 * lengths + 1e-3
    global_batch = ranks * local_batch
    num_steps = -(-samples // global_batch)
    steps = np.arange(samples) // global_batch
    rank_of = rng.permutation(samples) % ranks
    entries = []
    for rank in range(ranks):
        mine = np.flatnonzero(rank_of == rank)
        rel = f"rank={rank}/part-00000.parquet"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        table = pa.table({"step": pa.array(steps[mine], pa.int32()), "cost": pa.array(costs[mine], pa.float64()),
                          "length": pa.array(lengths[mine], pa.int32())})
        pq.write_table(table, root / rel)
        data = (root / rel).read_bytes()
        entries.append({"rank": rank, "rows": int(mine.size), "tokens": int(lengths[mine].sum()),
                        "cost": float(costs[mine].sum()),
                        "files": [{"path": rel, "rows": int(mine.size), "bytes": len(data),
                                   "sha256": hashlib.sha256(data).hexdigest()}]})
    manifest = {"format": MANIFEST_FORMAT, "world_size": ranks, "local_batch_size": local_batch,
                "global_batch_size": global_batch, "num_steps": num_steps, "window_steps": 1, "strategy": "kk",
                "control": None, "seed": seed, "num_items": 1000, "num_samples": samples,
                "leftover": {"policy": "keep", "samples": 0}, "cost_model": {"kind": "quadratic"}, "stats": {},
                "ranks": entries}
    (root / "manifest.json").write_text(json.dumps(seal(manifest)))
    return root


def time_replan(shards: Path, to_ranks: int, trained: float, out: Path) -> dict[str, float]:
    """One re-plan of the rest of epoch 0 for ``to_ranks``: seconds to read, plan and write, and its shape."""
    from freescale.shards.manifest import load_manifest
    from freescale.shards.replan import ReplanFiles, replan

    manifest = load_manifest(shards)
    from_step = int(manifest.num_steps * trained)
    meta, rows = replan(manifest, from_step, to_ranks, 0)
    started = time.perf_counter()
    ReplanFiles(out / ReplanFiles.name(from_step, to_ranks)).write(meta, rows)
    write_s = time.perf_counter() - started
    return {"read_s": meta.read_seconds, "plan_s": meta.plan_seconds, "write_s": write_s,
            "total_s": meta.read_seconds + meta.plan_seconds + write_s,
            "samples": meta.num_samples, "steps": meta.num_steps, "bubble": meta.bubble}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--to-ranks", default="1016,512", help="comma-separated K' (1016: a node of 8 lost)")
    parser.add_argument("--local-batch-size", type=int, default=16)
    parser.add_argument("--trained", type=float, default=0.5, help="fraction of the epoch the checkpoint trained")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", help="also append the markdown here")
    parser.add_argument("--smoke", action="store_true", help="toy sizes: 4,000 samples over 16 ranks")
    args = parser.parse_args(argv)
    if args.smoke:
        args.samples, args.ranks, args.to_ranks, args.repeats = 4000, 16, "12,20", 1
    md = Markdown(args.output)
    with tempfile.TemporaryDirectory(prefix="replan-bench-") as tmp:
        started = time.perf_counter()
        shards = write_plan_columns(Path(tmp) / "shards", args.samples, args.ranks, args.local_batch_size)
        md.emit(f"{args.samples:,} samples over {args.ranks} ranks, B = {args.local_batch_size}, written in "
                f"{time.perf_counter() - started:.1f} s (not timed below); checkpoint {args.trained:.0%} through "
                f"epoch 0; {platform.node()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
        md.emit()
        rows = []
        for to_ranks in (int(k) for k in args.to_ranks.split(",")):
            runs = [time_replan(shards, to_ranks, args.trained, Path(tmp) / f"out-{to_ranks}-{i}")
                    for i in range(args.repeats)]
            rows.append([f"{args.ranks} -> {to_ranks}", f"{runs[0]['samples']:,}", str(runs[0]["steps"]),
                         *(spread([r[key] for r in runs], ".2f") for key in ("read_s", "plan_s", "write_s", "total_s")),
                         f"{runs[0]['bubble']:.2%}"])
        md.table(["ranks", "samples re-planned", "steps", "read s", "plan s", "write s", "total s",
                  "predicted bubble"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
