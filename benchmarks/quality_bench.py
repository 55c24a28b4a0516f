"""Model quality: HSTU against the SASRec baseline and most-popular, trained by the same trainer
with the same recipe, under both evaluation protocols, over several seeds.

MovieLens-100K (with its user features), 2 gloo ranks on kk-balanced shards built by the real
jobs, `configs/ml100k_recipe.toml` (validation every pass, early stopping on the validation
item's sampled NDCG@10 with patience, the best epoch's weights tested); the SASRec runs add
`--model.encoder sasrec` and nothing else. Each run is scored by the full-catalog ranking
(`ndcg_at_10`, ...) and SASRec's protocol (the held-out item against 100 items its user never
interacted with: `sampled_ndcg_at_10`, ...); most-popular is scored on the same queries and
negatives (the same for every model of a seed).

Targets (issue 16): SASRec beats most-popular under both protocols; HSTU beats SASRec on NDCG@10
under both protocols by more than the seed spread.

Usage (from the repository root): python -m benchmarks.quality_bench [--seeds 3] [--local-batch-size 32]
           [--models hstu,sasrec] [--workdir out/quality-bench] [--report-only] [--section.key=value ...]
           [--input FILE... [--format FMT] | --prepared DIR...] [--config FILE] [--grid MODEL:KEY=V1,V2;KEY2=...]...
           [--stop-after-epochs N]

``--models hstu`` trains one model only (a sweep's probe of that model's settings; the comparison
lines need both). ``--repeats`` is ``--seeds``' old name.

Other data (issue 27): ``--input FILE --format FMT`` prepares FILE once in the workdir
(``freescale prepare``, e.g. ``--format user-item-lines`` for Amazon Beauty), or ``--prepared DIR``
takes sequences prepared already; either is balanced once (kk, 2 ranks, ``--leftover keep``: every
user trains and is tested), no user features. ``--config`` then names the recipe (default
``configs/short_history.toml``; MovieLens keeps ``configs/ml100k_recipe.toml``). Checkpoints stay off
and early stopping is the config's (both shipped recipes validate every pass with patience).
Several ``--input`` (or ``--prepared``) run one after another in one command, each in its own
``--workdir`` subfolder named after it, with a table per dataset and the whole command's wall time
at the end. ``--resume`` keeps the runs an interrupted bench finished (each run's minutes are
saved beside its summary) and trains the rest; ``--record DIR`` also keeps each finished run's summary and
minutes, a few kB, in ``DIR/<dataset>/``, and ``--resume`` takes runs from there too, so a bench longer
than a machine's lease goes on elsewhere from a committed ``DIR``. ``--stop-after-epochs N`` cuts every run after N epochs of the config's schedule
(``--max-steps`` N x the dataset's steps per epoch): the same budget in epochs on every dataset.

A grid per model: ``--grid "hstu:model.hstu.dropout=0.3,0.5;loss.num_negatives=128,512"`` trains every
combination of the listed values (each an override of that model's runs only) for every seed. Each
model's setting is chosen by the median over seeds of the validation score early stopping followed
(``best_<evaluation.metric>``; the test item never chooses); the tables then report the test item of
the chosen setting only, under both protocols, with the seed spread, and list every setting's
validation median.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from benchmarks.common import REPO, add_run_arguments, build_shards, spread, train

CONFIG = "configs/ml100k_recipe.toml"
OTHER_DATA_CONFIG = "configs/short_history.toml"
MODELS = {"hstu": [], "sasrec": ["--model.encoder", "sasrec"]}
METRICS = (("ndcg_at_10", "NDCG@10"), ("hr_at_10", "HR@10"), ("mrr", "MRR"))
# The unseen ranking (the catalog less the query's history) only where the runs had evaluation.unseen_ranking.
PROTOCOLS = (("", "full catalog"), ("sampled_", "100 sampled negatives"), ("unseen_", "full catalog less the history"))


def parse_grid(specs: list[str], models: list[str]) -> dict[str, list[list[str]]]:
    """``MODEL:KEY=V1,V2;KEY2=...`` (repeatable) -> per model, every combination as override
    arguments (one empty setting for a model without a grid)."""
    import itertools

    axes: dict[str, list[tuple[str, list[str]]]] = {name: [] for name in models}
    for spec in specs:
        model, _, body = spec.partition(":")
        if model not in axes or not body:
            raise SystemExit(f"--grid {spec!r}: expected MODEL:KEY=V1,V2;... with MODEL one of {', '.join(models)}")
        for part in filter(None, (p.strip() for p in body.split(";"))):
            key, _, values = part.partition("=")
            if not key or not values:
                raise SystemExit(f"--grid {spec!r}: {part!r} is not KEY=V1,V2")
            axes[model].append((key.strip().removeprefix("--"), [v.strip() for v in values.split(",")]))
    settings: dict[str, list[list[str]]] = {}
    for model, model_axes in axes.items():
        combos = itertools.product(*[[(key, v) for v in values] for key, values in model_axes])
        settings[model] = [[arg for key, v in combo for arg in (f"--{key}", v)] for combo in combos]
    return settings


def setting_name(overrides: list[str]) -> str:
    """A setting's label and file-name part: ``model.hstu.dropout=0.3,loss.num_negatives=512`` (``default``)."""
    pairs = [f"{overrides[i].removeprefix('--')}={overrides[i + 1]}" for i in range(0, len(overrides), 2)]
    return ",".join(pairs) or "default"


def other_data_shards(work: Path, args, source: str, prepared_already: bool) -> Path:
    """``source`` (a log, or sequences when ``prepared_already``) prepared once in ``work/prepared``,
    balanced once for 2 ranks (kk, every sample kept)."""
    from benchmarks.common import freescale, run

    prepared = Path(source).resolve() if prepared_already else work / "prepared"
    if not prepared_already and not (prepared / "prepare.json").exists():
        fmt = ["--format", args.format] if args.format else []
        run(freescale("prepare", "--input", str(Path(source).resolve()), *fmt, "--output", str(prepared),
                      "--overwrite", "--tracking-uri", "none"), work / "prepare.log")
    shards = work / f"shards-{args.strategy}"
    if not (shards / "manifest.json").exists():
        run(freescale("balance", "--input", str(prepared), "--output", str(shards), "--world-size", "2",
                      "--local-batch-size", str(args.local_batch_size), "--strategy", args.strategy,
                      "--leftover", "keep", "--seed", "0", "--overwrite", "--tracking-uri", "none"),
            work / "balance.log")
    return shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "out/quality-bench")
    parser.set_defaults(local_batch_size=32)
    parser.add_argument("--seeds", dest="repeats", type=int, help="seeds per model and setting (--repeats)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"which models to train, comma-separated (default {','.join(MODELS)})")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--input", action="append",
                      help="interaction log to prepare (repeatable: one table each; default: MovieLens-100K with "
                           "its user features)")
    data.add_argument("--prepared", action="append", help="sequences written by freescale prepare (repeatable)")
    parser.add_argument("--format", help="freescale prepare --format of every --input (e.g. user-item-lines)")
    parser.add_argument("--config", help=f"recipe (default {CONFIG} on MovieLens, {OTHER_DATA_CONFIG} on other data)")
    parser.add_argument("--grid", action="append", default=[], metavar="MODEL:KEY=V1,V2;KEY2=...",
                        help="settings to choose from by the validation item, per model (repeatable)")
    parser.add_argument("--stop-after-epochs", type=int, default=0, metavar="N",
                        help="cut each run after N epochs of the config's schedule (default: the config's end)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs a stopped bench finished in --workdir (their summaries and minutes)")
    parser.add_argument("--record", type=Path, metavar="DIR",
                        help="also keep each finished run's summary and minutes in DIR/<dataset>/ (small enough "
                             "to commit); with --resume, runs found there are not trained again")
    args, args.overrides = parser.parse_known_args()  # the rest: config overrides for every run
    names = args.models.split(",")
    if not set(names) <= set(MODELS):
        parser.error(f"--models: choose from {', '.join(MODELS)}, got {args.models!r}")
    if args.format and not args.input:
        parser.error("--format needs --input")
    sources = [(p, False) for p in args.input or []] + [(p, True) for p in args.prepared or []]
    stems = [dataset_name(p, prepared) for p, prepared in sources]
    if len(set(stems)) < len(stems):
        parser.error(f"two datasets share a name ({', '.join(stems)}): their workdirs would collide")
    settings = parse_grid(args.grid, names)
    args.config = args.config or (OTHER_DATA_CONFIG if sources else CONFIG)
    args.user_features, args.user_feature_cols = True, "age,gender,occupation,zip_code"
    root = (REPO / args.workdir).resolve()
    args.record = (REPO / args.record).resolve() if args.record else None
    started = time.time()
    if not sources:
        bench_dataset(args, "MovieLens-100K", root, None, names, settings)
    for (source, prepared), stem in zip(sources, stems):
        bench_dataset(args, stem, root / stem if len(sources) > 1 else root, (source, prepared), names, settings)
    if len(sources) > 1:
        print(f"\n(whole command: {len(sources)} datasets, {time.time() - started:.0f} s)")


def dataset_name(source: str, prepared: bool) -> str:
    """A dataset's label and workdir name: the prepared folder's name, or the log file's stem."""
    return Path(source).name if prepared else Path(source).stem


def bench_dataset(args, dataset: str, work: Path, source: tuple[str, bool] | None, names: list[str],
                  settings: dict[str, list[list[str]]]) -> None:
    """Every model, setting and seed on one dataset (``source`` None: MovieLens-100K), then its tables."""
    models = {name: MODELS[name] for name in names}
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    # results[model][setting label] = one summary per seed
    results: dict[str, dict[str, list[dict]]] = {name: {} for name in models}
    minutes: dict[str, dict[str, list[float]]] = {name: {} for name in models}
    shards, steps = None, 0
    if not args.report_only:
        shards = build_shards(work, args)["balanced"] if source is None else other_data_shards(work, args, *source)
        if args.stop_after_epochs:
            steps = args.stop_after_epochs * json.loads((shards / "manifest.json").read_text())["num_steps"]
    for rep in range(args.repeats):
        for name, extra in models.items():
            for overrides in settings[name]:
                label = setting_name(overrides)
                # One setting (no grid): the file names the bench always wrote, so old workdirs still report.
                stem = f"{name}-{rep}" if len(settings[name]) == 1 else f"{name}-{label.replace('/', '_')}-{rep}"
                out = work / f"{stem}.json"
                took = out.with_suffix(".minutes")  # written after the summary: the run finished
                record = args.record / dataset / out.name if args.record else None
                if args.resume and record:
                    restore_run(record, out, took)
                if not args.report_only and not (args.resume and took.exists()):
                    began = time.time()
                    train(shards, steps, rep, out, args, "--config", args.config, *extra, *args.overrides, *overrides)
                    took.write_text(f"{(time.time() - began) / 60}\n")
                if record:
                    record_run(out, took, record)
                if took.exists():
                    minutes[name].setdefault(label, []).append(float(took.read_text()))
                summary = json.loads(out.read_text())["summary"]
                results[name].setdefault(label, []).append(summary)
                # A grid's runs show the validation item only: the test item is reported for the chosen setting.
                test = "" if len(settings[name]) > 1 else (f"  test ndcg@10 {summary['ndcg_at_10']:.4f}  "
                                                           f"sampled ndcg@10 {summary['sampled_ndcg_at_10']:.4f}")
                print(f"{dataset} seed {rep} {name:7s} {label}: best epoch {summary['best_epoch']:.0f}  "
                      f"valid {validation_score(summary):.4f}{test}", flush=True)
    chosen = {name: choose(by_setting) for name, by_setting in results.items()}
    if any(len(by_setting) > 1 for by_setting in results.values()):
        report_selection(results, chosen)
    budget = f", each run cut after {args.stop_after_epochs} epochs ({steps} steps)" if steps else ""
    report({name: results[name][chosen[name]] for name in models},
           {name: minutes[name].get(chosen[name], []) for name in models},
           argparse.Namespace(**{**vars(args), "dataset": dataset + budget}), work, time.time() - started,
           {name: chosen[name] for name in models})


def record_run(out: Path, took: Path, record: Path) -> None:
    """Keep a finished run's summary and minutes in ``record`` (a few kB; the run's own file also
    holds its losses and timings, megabytes), for a bench resumed on another machine."""
    if took.exists() and not record.exists():
        record.parent.mkdir(parents=True, exist_ok=True)
        kept = {"summary": json.loads(out.read_text())["summary"], "minutes": float(took.read_text())}
        record.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")


def restore_run(record: Path, out: Path, took: Path) -> None:
    """A run ``record_run`` kept, put back in the workdir as the bench writes it, unless the workdir
    has the run already."""
    if record.exists() and not took.exists():
        kept = json.loads(record.read_text())
        out.write_text(json.dumps({"summary": kept["summary"]}))
        took.write_text(f"{kept['minutes']}\n")


def validation_key(summary: dict) -> str:
    """The validation score early stopping followed (``best_<evaluation.metric>``), else the
    end-of-run validation item's sampled NDCG@10 (full-catalog without sampled negatives)."""
    best = next((k for k in summary if k.startswith("best_valid")), None)
    return best or ("valid_sampled_ndcg_at_10" if "valid_sampled_ndcg_at_10" in summary else "valid_ndcg_at_10")


def validation_score(summary: dict) -> float:
    return summary[validation_key(summary)]


def choose(by_setting: dict[str, list[dict]]) -> str:
    """The setting with the best median validation score over its seeds (the first listed on a tie)."""
    return max(by_setting, key=lambda label: statistics.median(validation_score(s) for s in by_setting[label]))


def report_selection(results: dict[str, dict[str, list[dict]]], chosen: dict[str, str]) -> None:
    print("\n#### Settings, chosen by the validation item (median over seeds; the test item not looked at)\n")
    key = validation_key(next(iter(next(iter(results.values())).values()))[0])
    print(f"| model | setting | {key.removeprefix('best_')} median [min, max] | best epochs | chosen |")
    print("| --- | --- | --- | --- | --- |")
    for name, by_setting in results.items():
        for label, rows in by_setting.items():
            print(f"| {name} | {label} | {spread([validation_score(r) for r in rows])} | "
                  f"{', '.join(format(r['best_epoch'], '.0f') for r in rows)} | {'**yes**' if label == chosen[name] else ''} |")


def report(results: dict[str, list[dict]], minutes: dict[str, list[float]], args, work: Path,
           total_s: float, chosen: dict[str, str] | None = None) -> None:
    first_rows = next(iter(results.values()))  # most-popular is scored on every run's queries alike
    first = first_rows[0]
    print(f"\n#### Model quality: {args.dataset}, 2 gloo ranks x {args.local_batch_size} samples, "
          f"{args.repeats} seeds (median [min, max]), {int(first['eval_samples'])} test users\n")
    settings = "".join(f"; {name}: {label}" for name, label in (chosen or {}).items() if label != "default")
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores; config {args.config} "
          f"{' '.join(args.overrides)}{settings}\n")
    # The validation score early stopping followed (evaluation.metric): what a sweep chooses by.
    chosen = next((k for k in first if k.startswith("best_valid")), None)
    print(f"| protocol | model | {' | '.join(label for _, label in METRICS)} | best epoch | "
          f"{chosen.removeprefix('best_') if chosen else 'validation'} at it | minutes |")
    print("|" + " --- |" * (5 + len(METRICS)))
    protocols = [(prefix, protocol) for prefix, protocol in PROTOCOLS
                 if all(f"{prefix}ndcg_at_10" in r for rows in results.values() for r in rows)]
    for prefix, protocol in protocols:
        for name, rows in results.items():
            cells = [spread([r[f"{prefix}{key}"] for r in rows]) for key, _ in METRICS]
            extra = [spread([r["best_epoch"] for r in rows]).replace(".0000", ""),
                     spread([r[chosen] for r in rows]) if chosen else "-",
                     spread(minutes[name], ".1f") if minutes[name] else "-"]
            print(f"| {protocol} | {name} | {' | '.join(cells)} | {' | '.join(extra)} |")
        cells = [spread([r[f"popular_{prefix}{key}"] for r in first_rows]) for key, _ in METRICS]
        print(f"| {protocol} | most-popular | {' | '.join(cells)} | - | - | - |")
    print()
    for prefix, protocol in protocols if set(results) == set(MODELS) else ():
        key = f"{prefix}ndcg_at_10"
        sasrec = [r[key] for r in results["sasrec"]]
        popular = [r[f"popular_{key}"] for r in results["sasrec"]]
        hstu = [r[key] for r in results["hstu"]]
        spread_width = max(max(hstu) - min(hstu), max(sasrec) - min(sasrec))
        gap = sorted(hstu)[len(hstu) // 2] - sorted(sasrec)[len(sasrec) // 2]
        print(f"- {protocol}: SASRec beats most-popular in every run: "
              f"{'yes' if all(s > p for s, p in zip(sasrec, popular)) else 'NO'}; HSTU - SASRec median NDCG@10 "
              f"{gap:+.4f}, seed spread {spread_width:.4f}: HSTU ahead by more than the spread: "
              f"{'yes' if gap > spread_width else 'NO'}; HSTU not below: {'yes' if gap >= 0 else 'NO'}")
    # A resumed bench restores runs trained earlier: their own minutes, not this command's, are its cost.
    runs = [m for by_model in minutes.values() for m in by_model]
    print(f"\n(total {total_s:.0f} s; the runs above took {sum(runs):.0f} min between them; per-run logs and "
          f"summaries in {work})")


if __name__ == "__main__":
    main()
