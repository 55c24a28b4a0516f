"""Memory that grows with steps or with the catalog: c32ca2f's timing log and evaluation against today's.

Two pieces, each variant in its own process (a process's peak resident memory only grows), measured
in the same run:

* timing log: the step recorder fed ``--steps`` steps of synthetic timings, then what rank 0 did at
  the end. Old (c32ca2f, reproduced below: ``OldStepTimeLog``): every gathered window kept, the
  ``[steps, ranks, fields]`` table concatenated, the summary computed from it and written, table
  included, into the summary JSON. New: ``StepTimeLog`` windows appended to the timing file
  (``freescale.costs.run_timings``), the summary read back column by column, the JSON without the table.
  The summaries of both are checked equal.
* evaluation: ``--ranks`` gloo ranks, a ``--items``-item catalog at ``--dim``, each rank scoring
  ``--users`` users (synthetic histories). Old (c32ca2f, reproduced: ``old_evaluate``): every rank
  gathers the whole table (raw and normalised) and scores its users against it. New:
  ``freescale.training.eval.evaluator.evaluate`` (1/K slice per rank). The metrics of both are
  checked equal. Every rank's model is a local one holding the whole table (as the gathered copy
  would be, under DMP each rank holds its 1/K shard instead): its memory is in the "before" column.

Peak RSS is ``ru_maxrss``; "eval/log peak" is the highest RSS sampled (every 2 ms) while the piece
ran, less the RSS when it started.

Usage (from the repository root): python -m benchmarks.memory_bench [--steps 1000000] [--items 1000000]
    [--dim 32] [--users 512] [--ranks 2] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakSampler:
    """The highest RSS seen while inside, sampled every 2 ms, less the RSS on entry."""

    def __enter__(self):
        self.start = self.peak = rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb())

    def row(self) -> dict:
        return {"before_mb": round(self.start, 1), "piece_peak_mb": round(self.peak - self.start, 1),
                "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


# ------------------------------------------------------------------------------- timing log


class OldStepTimeLog:
    """c32ca2f's ``StepTimeLog`` (freescale/training/timing/bubbles.py), one rank: every gathered
    window kept in ``_gathered``, every step in ``steps``, the table concatenated at the end."""

    def __init__(self, world_size: int, sync_every: int = 1):
        self.world_size, self.sync_every = world_size, max(1, sync_every)
        self.steps, self._pending, self._pending_steps, self._gathered = [], [], [], []

    def record(self, step, timing):
        from freescale.training.timing.bubbles import TIMING_FIELDS

        self._pending.append([getattr(timing, name) for name in TIMING_FIELDS])
        self._pending_steps.append(step)
        if len(self._pending) >= self.sync_every:
            return self.flush()
        return None

    def flush(self):
        import torch

        if not self._pending:
            return None
        table = torch.tensor(self._pending, dtype=torch.float64).unsqueeze(1).numpy()
        self._gathered.append(table)
        self.steps.extend(self._pending_steps)
        self._pending, self._pending_steps = [], []
        return table

    def table(self):
        import numpy as np

        return np.concatenate(self._gathered, axis=0)


def synthetic_timings(steps: int):
    import numpy as np

    from freescale.training.timing.bubbles import StepTiming

    rng = np.random.default_rng(0)
    values = rng.gamma(2.0, 0.01, (4096, 4))
    for step in range(steps):
        a, b, c, d = values[step % 4096]
        yield step, StepTiming(data_wait_s=a, dense_compute_s=b, dense_compute_cpu_s=b * 0.9, sparse_backward_s=c,
                               step_s=a + b + c + d, comm_s=c, exposed_comm_s=c, cost=b * 1e3, samples=16.0,
                               loss_sum=d * 100, targets=160.0)


def timing_piece(variant: str, steps: int, folder: Path) -> dict:
    from freescale.costs.run_summary import timings_beside, write_run_summary
    from freescale.costs.run_timings import TimingColumns, TimingFile
    from freescale.training.timing.bubbles import TIMING_FIELDS, StepTimeLog
    from freescale.training.timing.step_report import run_summary, step_losses

    out = folder / f"{variant}.json"
    with PeakSampler() as sampler:
        if variant == "old":
            log = OldStepTimeLog(1)
            for step, timing in synthetic_timings(steps):
                log.record(step, timing)
            log.flush()
            table = log.table()
            summary = run_summary(table)
            out.write_text(json.dumps({"summary": summary, "losses": list(step_losses(table)), "steps": log.steps,
                                       "timings": {"fields": list(TIMING_FIELDS),
                                                   "steps_ranks_fields": table.tolist()}}, indent=1))
        else:
            log, file = StepTimeLog(1), TimingFile(timings_beside(out), TIMING_FIELDS, 1)
            kept_steps, losses = [], []
            for step, timing in synthetic_timings(steps):
                window = log.record(step, timing)
                if window is not None:
                    kept_steps.extend(window[0])
                    losses.extend(float(x) for x in step_losses(window[1]))
                    file.append(*window)
            summary = run_summary(TimingColumns(file.close()))
            write_run_summary(out, summary=summary, run_id=None, losses=losses, steps=kept_steps, comm=None,
                              comm_issue_order=[], cost_model=None, fields=TIMING_FIELDS, timings_file=file.path)
    files = sum(p.stat().st_size for p in folder.glob(f"{variant}.*")) / 2**20
    return {**sampler.row(), "files_mb": round(files, 1), "summary": summary}


# ------------------------------------------------------------------------------- evaluation


def synthetic_batches(num_items: int, users: int, rank: int, length: int = 20, batch: int = 64):
    import torch

    from freescale.training.data.batch import SequenceBatch

    generator = torch.Generator().manual_seed(1000 + rank)
    for first in range(0, users, batch):
        b = min(batch, users - first)
        total = b * length
        yield SequenceBatch(
            lengths=torch.full((b,), length), item_ids=torch.randint(1, num_items + 1, (total,), generator=generator),
            timestamps=torch.arange(total), ratings=torch.zeros(total, dtype=torch.int64),
            valid_item=torch.randint(1, num_items + 1, (b,), generator=generator),
            test_item=torch.randint(1, num_items + 1, (b,), generator=generator),
            valid_timestamp=torch.full((b,), total), test_timestamp=torch.full((b,), total + 1),
            user_ids=[f"u{rank}-{first + i}" for i in range(b)])


def old_evaluate(model, manifest, rank, world_size, batches, group) -> dict:
    """c32ca2f's ``evaluate`` (full catalog, no sampled or unseen protocol): the whole table looked up
    (``all_item_embeddings``), kept raw and normalised, every batch scored against it."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from freescale.training.eval import evaluator
    from freescale.training.eval.ranking_metrics import ProtocolMetrics, RetrievalMetrics, most_popular_baseline

    model.eval()
    with torch.no_grad():
        raw = model.all_item_embeddings(normalize=False)
        user_tables = model.all_user_feature_tables()
        table = F.normalize(raw, dim=-1)
        sums = {use: ProtocolMetrics(RetrievalMetrics()) for use in ("test", "valid")}
        counts, targets = torch.zeros(manifest.num_items + 1, dtype=torch.float64), []
        for batch in evaluator.joined(batches, evaluator.EVAL_BATCH_SAMPLES):
            counts.add_(torch.bincount(batch.item_ids, minlength=counts.numel()).to(torch.float64))
            for use in sums:
                sums[use] = sums[use] + evaluator.evaluate_batch(model, batch, table, use=use, item_table=raw,
                                                                 user_tables=user_tables)
            targets.append(batch.test_item)
    result = evaluator._model_summary(sums, ("test", "valid"), world_size, group)
    dist.all_reduce(counts, group=group)
    popular_ids = torch.repeat_interleave(torch.arange(counts.numel()), counts.to(torch.int64))
    result.update(evaluator._named(most_popular_baseline(popular_ids, manifest.num_items, torch.cat(targets)),
                                   world_size, "popular_", group))
    result["eval_samples"] = result.pop("count")
    return result


def eval_rank(rank: int, variant: str, args: SimpleNamespace, folder: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from freescale.training.config import HSTUConfig, ModelConfig
    from freescale.training.eval import evaluator
    from freescale.training.model.recommender import build_local_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store-{variant}", args.ranks), rank=rank,
                            world_size=args.ranks, timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    model = build_local_model(args.items, ModelConfig(embedding_dim=args.dim, hstu=HSTUConfig(num_layers=1)))
    manifest = SimpleNamespace(num_items=args.items, control="kk", world_size=args.ranks)

    def scored(manifest_, rank_, world_size_, max_samples_, counts):  # the synthetic users, counted
        for batch in synthetic_batches(args.items, args.users, rank):
            counts.add_(torch.bincount(batch.item_ids, minlength=counts.numel()).to(torch.float64))
            yield batch

    with PeakSampler() as sampler:
        if variant == "old":
            result = old_evaluate(model, manifest, rank, args.ranks, synthetic_batches(args.items, args.users, rank),
                                  dist.group.WORLD)
        else:
            evaluator._scored_batches = scored
            result = evaluator.evaluate(model, manifest, rank, args.ranks, torch.device("cpu"),
                                        group=dist.group.WORLD)
    Path(folder, f"eval-{variant}-{rank}.json").write_text(json.dumps({**sampler.row(), "metrics": result}))
    dist.destroy_process_group()


def eval_piece(variant: str, args: SimpleNamespace, folder: Path) -> list[dict]:
    import torch.multiprocessing as mp

    mp.spawn(eval_rank, args=(variant, args, str(folder)), nprocs=args.ranks, join=True)
    return [json.loads((folder / f"eval-{variant}-{rank}.json").read_text()) for rank in range(args.ranks)]


# ------------------------------------------------------------------------------- the table


def child(piece: str, variant: str, args: argparse.Namespace, folder: Path) -> object:
    """One piece's variant in a fresh process (``--child``): its rows."""
    cmd = [sys.executable, "-m", "benchmarks.memory_bench", "--child", piece, variant, str(folder),
           "--steps", str(args.steps), "--items", str(args.items), "--dim", str(args.dim),
           "--users", str(args.users), "--ranks", str(args.ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, env=env)
    rows = json.loads((folder / f"{piece}-{variant}.result.json").read_text())
    print(f"memory_bench: {piece} {variant} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return rows


def table(results: dict, args: argparse.Namespace) -> str:
    lines = ["| piece | variant | rank | RSS before (MB) | piece peak above it (MB) | peak RSS (MB) | files (MB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for variant in ("old", "new") if "timing" in results else ():
        row = results["timing"][variant]
        lines.append(f"| timing log, {args.steps:,} steps x 1 rank | {variant} | 0 | {row['before_mb']} | "
                     f"{row['piece_peak_mb']} | {row['max_rss_mb']} | {row['files_mb']} |")
    for variant in ("old", "new") if "eval" in results else ():
        for rank, row in enumerate(results["eval"][variant]):
            lines.append(f"| evaluation, {args.items:,} items x {args.dim} dims, {args.ranks} ranks x {args.users} "
                         f"users | {variant} | {rank} | {row['before_mb']} | {row['piece_peak_mb']} | "
                         f"{row['max_rss_mb']} | |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--users", type=int, default=512, help="per rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--pieces", default="timing,eval", help="which pieces to run (timing, eval)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--child", nargs=3, metavar=("PIECE", "VARIANT", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.steps, args.items, args.dim, args.users, args.ranks) < 1:
        parser.error("--steps, --items, --dim, --users and --ranks must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        import pyarrow.parquet  # noqa: F401 - loaded by both variants before measuring: a fixed cost, not the piece's
        import torch  # noqa: F401

        piece, variant, folder = args.child
        rows = (timing_piece(variant, args.steps, Path(folder)) if piece == "timing"
                else eval_piece(variant, SimpleNamespace(**vars(args)), Path(folder)))
        Path(folder, f"{piece}-{variant}.result.json").write_text(json.dumps(rows))
        return 0
    pieces = [p for p in ("timing", "eval") if p in args.pieces.split(",")]
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        results = {piece: {variant: child(piece, variant, args, Path(tmp)) for variant in ("old", "new")}
                   for piece in pieces}
    same_summary = "timing" not in results or \
        results["timing"]["old"].pop("summary") == results["timing"]["new"].pop("summary")
    metrics = {v: [row.pop("metrics") for row in results["eval"][v]] for v in ("old", "new")} if "eval" in results \
        else {"old": [], "new": [{}]}
    same_metrics = metrics["old"] == metrics["new"] or "eval" not in results
    print(table(results, args))
    print(f"\ntiming summary old == new: {same_summary}; evaluation metrics old == new (every rank): {same_metrics}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "same_summary": same_summary,
                                               "same_metrics": same_metrics, "metrics": metrics["new"][0]}, indent=1))
    return 0 if same_summary and same_metrics else 1


if __name__ == "__main__":
    sys.exit(main())
