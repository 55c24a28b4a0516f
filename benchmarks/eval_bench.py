"""What one rank's validation pass costs, part by part, and how it scales with users and items.

A run validates every epoch (``evaluation.every_epochs``): each rank scores the validation item
of every sample of its shard, under both protocols (``freescale.training.eval.evaluator``). This times the
parts of that pass on one rank's shard, in process, with the trainer's functions:

* ``read``: the shard's batches (``build_loader``);
* ``negatives, first``: drawing each sample's 100 sampled negatives (``NegativeDraws``), as the
  run's first validation does; ``negatives, kept``: the later validations, which reuse them;
* ``encode``: the query embeddings (``score_queries``: the encoder over each history);
* ``rank, full catalog``: ranking the target against every item (``retrieval_metrics``);
* ``rank, sampled``: against the 100 negatives (``sampled_retrieval_metrics``);
* ``evaluate(), first`` and ``evaluate(), later``: the whole pass as the trainer runs it; then the
  same, scoring the shards' batches one by one (``batch_samples=0``) instead of joined.

The parts are timed on the batches the evaluator scores: the shards' batches joined up to
``EVAL_BATCH_SAMPLES`` samples.

Then the full-catalog ranking alone at larger catalogs (random unit embeddings,
``--catalog-queries`` queries), the one part that grows with the number of items: as the
evaluator ranks (``retrieval_metrics``' default) against one score matrix per batch, alternating.

Each number is the median of ``--repeats`` passes, with [min, max]; the model is untrained
(the cost does not depend on the weights). One intra-op thread by default: a rank of a 2-rank
run on 2 cores has one.

Usage (from the repository root):
  python -m benchmarks.eval_bench --shards out/quality/beauty-shards [--config configs/short_history.toml]
         [--rank 0] [--repeats 3] [--catalogs 100000,1000000] [--catalog-queries 2048] [--output FILE.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.common import commit


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", required=True, help="a balanced shard folder (freescale balance's output)")
    parser.add_argument("--config", default="configs/short_history.toml", help="the training config (model, protocol)")
    parser.add_argument("--encoder", default=None, choices=("hstu", "sasrec"), help="model.encoder (default: the config's)")
    parser.add_argument("--rank", type=int, default=0, help="whose shard (default 0)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: one rank's share here)")
    parser.add_argument("--catalogs", default="100000,1000000",
                        help="catalog sizes for the full-catalog ranking alone, comma-separated ('' = none)")
    parser.add_argument("--catalog-queries", type=int, default=2048,
                        help="queries ranked in the catalog-size table (default 2048; the shard's batches of 64)")
    parser.add_argument("--output", default=None, help="also write the tables to this markdown file")
    args = parser.parse_args(argv)
    if not (Path(args.shards) / "manifest.json").is_file():
        parser.error(f"--shards {args.shards}: no manifest.json (not a freescale balance output)")
    if min(args.repeats, args.threads, args.catalog_queries) < 1:
        parser.error("--repeats, --threads and --catalog-queries must be >= 1")
    try:
        args.catalogs = [int(c) for c in args.catalogs.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--catalogs {args.catalogs!r}: not a comma-separated list of integers")
    return args


def timed_parts(model, manifest, rank: int, sampled: int, seed: int) -> tuple[dict[str, float], int]:
    """One validation pass, its parts timed apart (seconds), and the samples it scored."""
    import torch

    from freescale.training.eval.evaluator import EVAL_BATCH_SAMPLES, NegativeDraws, joined, score_queries
    from freescale.training.eval.ranking_metrics import retrieval_metrics, sampled_retrieval_metrics
    from freescale.training.data.shard_reader import build_loader

    parts = dict.fromkeys(("read", "negatives, first", "negatives, kept", "encode", "rank, full catalog",
                           "rank, sampled"), 0.0)
    start = time.perf_counter()
    batches = list(joined((b for b in build_loader(manifest, rank, prefetch=0) if b.batch_size), EVAL_BATCH_SAMPLES))
    parts["read"] = time.perf_counter() - start
    draws = NegativeDraws(manifest.num_items, sampled, seed)
    model.eval()
    with torch.no_grad():
        raw = model.all_item_embeddings(normalize=False)
        user_tables = model.all_user_feature_tables()
        table = torch.nn.functional.normalize(raw, dim=-1)
        for ordinal, batch in enumerate(batches):
            for part in ("negatives, first", "negatives, kept"):
                start = time.perf_counter()
                negatives = draws.of(ordinal, batch)
                parts[part] += time.perf_counter() - start
            start = time.perf_counter()
            query = score_queries(model, batch, "valid", raw, user_tables)
            parts["encode"] += time.perf_counter() - start
            start = time.perf_counter()
            retrieval_metrics(query, table, batch.valid_item)
            parts["rank, full catalog"] += time.perf_counter() - start
            start = time.perf_counter()
            sampled_retrieval_metrics(query, table, batch.valid_item, negatives)
            parts["rank, sampled"] += time.perf_counter() - start
    return parts, sum(b.batch_size for b in batches)


def catalog_ranking(queries: int, width: int, catalog: int, repeats: int) -> dict[str, list[float]]:
    """Seconds to rank ``queries`` targets against ``catalog`` random unit items, per repeat: as the
    evaluator does (``retrieval_metrics``' default) and with one score matrix per batch, alternating."""
    import torch

    from freescale.training.eval.ranking_metrics import retrieval_metrics

    generator = torch.Generator().manual_seed(0)
    table = torch.nn.functional.normalize(torch.randn(catalog + 1, width, generator=generator), dim=-1)
    query = torch.nn.functional.normalize(torch.randn(queries, width, generator=generator), dim=-1)
    targets = torch.randint(1, catalog + 1, (queries,), generator=generator)
    times: dict[str, list[float]] = {"default": [], "one matrix": []}
    for _ in range(repeats):
        for way, chunk in (("default", None), ("one matrix", catalog + 1)):
            start = time.perf_counter()
            for first in range(0, queries, 64):  # the shard's batch size: evaluate ranks one batch at a time
                retrieval_metrics(query[first:first + 64], table, targets[first:first + 64], item_chunk_size=chunk)
            times[way].append(time.perf_counter() - start)
    return times


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from freescale.shards.manifest import load_manifest
    from freescale.training.config import load_config
    from freescale.training.eval.evaluator import EVAL_BATCH_SAMPLES, NegativeDraws, evaluate
    from freescale.training.model.recommender import build_local_model

    torch.set_num_threads(args.threads)
    overrides = ["--model.encoder", args.encoder] if args.encoder else []
    config = load_config(args.config, overrides)
    manifest = load_manifest(args.shards)
    torch.manual_seed(0)
    model = build_local_model(manifest.num_items, config.model,
                              user_features=[(f.name, f.num_ids) for f in manifest.user_features])
    sampled, seed = config.evaluation.sampled_negatives or 100, config.training.seed
    protocol = dataclasses.replace(config.evaluation, sampled_negatives=sampled)
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        parts, samples = timed_parts(model, manifest, args.rank, sampled, seed)
        for part, seconds in parts.items():
            runs.setdefault(part, []).append(seconds)
        kept, apart = NegativeDraws(manifest.num_items, sampled, seed), NegativeDraws(manifest.num_items, sampled, seed)
        for label, draws, batch_samples in (("evaluate(), first", kept, EVAL_BATCH_SAMPLES),
                                            ("evaluate(), later", kept, EVAL_BATCH_SAMPLES),
                                            ("evaluate(), first, the shards' batches", apart, 0),
                                            ("evaluate(), later, the shards' batches", apart, 0)):
            start = time.perf_counter()
            evaluate(model, manifest, args.rank, 1, torch.device("cpu"), evaluation=protocol, seed=seed,
                     uses=("valid",), negatives=draws, batch_samples=batch_samples)
            runs.setdefault(label, []).append(time.perf_counter() - start)
    lines = [
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit()}; {platform.node()} "
        f"({platform.machine()}, {torch.get_num_threads()} torch thread(s)); torch {torch.__version__}",
        f"- command: `python -m benchmarks.eval_bench {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"- shard: rank {args.rank} of {args.shards}: {samples} samples in {manifest.num_steps} batches, "
        f"{manifest.num_items} items, scored {EVAL_BATCH_SAMPLES} samples at a time; encoder {config.model.encoder}, width {config.model.embedding_dim}, "
        f"{sampled} sampled negatives; median [min, max] of {args.repeats} passes",
        "",
        "| part of one validation pass | seconds | us per sample |",
        "| --- | --- | --- |",
    ]
    for part, values in runs.items():
        lines.append(f"| {part} | {cell(values)} | {1e6 * statistics.median(values) / max(samples, 1):.0f} |")
    if args.catalogs:
        queries = args.catalog_queries
        lines += ["", f"Full-catalog ranking alone, {queries} queries of width {config.model.embedding_dim} "
                  "(random unit embeddings), by catalog size:", "",
                  "| items | seconds | us per query | ns per query and item | one score matrix per batch, seconds | "
                  "one matrix / default |", "| --- | --- | --- | --- | --- | --- |"]
        for catalog in [manifest.num_items, *args.catalogs]:
            times = catalog_ranking(queries, config.model.embedding_dim, catalog, args.repeats)
            median = statistics.median(times["default"])
            lines.append(f"| {catalog:,} | {cell(times['default'])} | {1e6 * median / queries:.0f} | "
                         f"{1e9 * median / queries / catalog:.2f} | {cell(times['one matrix'])} | "
                         f"{statistics.median(times['one matrix']) / median:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
