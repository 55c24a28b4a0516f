"""`freescale compare`: the same model trained on contiguous and balanced shards (and the mirror
control), repeated, recorded as one MLflow parent run with the training runs nested under it.

    freescale compare --input PREPARED --world-size 2 --local-batch-size 16 --repeats 3 --control
    freescale compare --shards contiguous=DIR,balanced=DIR[,control=DIR] --repeats 3

The shard sets come from the real balance job (contiguous; --strategy, default kk; with
--control the mirror control, whose bubble is the machine's noise floor). Runs alternate
(contiguous, balanced, control, contiguous, ...) so drift in machine load hits every variant
alike, and repeat r trains with seed --seed + r on every variant. The parent run records the
medians over repeats: `bubble_reduction` (the share of the removable bubble removed: contiguous
minus control), `idle_reduction` (the same with idle_fraction), `speedup` (samples/s balanced
over contiguous), `delta_<metric>` (balanced minus contiguous model quality), each variant's
medians as `<variant>/<metric>`, and a side-by-side per-rank timeline plot. Other
`--section.key VALUE` arguments override the training config, as for `freescale train`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from jobs.job_errors import error_line, run_job
from pipeline.stops import Stopped
from jobs.tracking import Tracking, add_tracking_arguments  # no mlflow import until a run opens
from pipeline import options
from pipeline.errors import InputError
from pipeline.prepared import METADATA_NAME, dataset_name, is_prepared  # standard library only
from pipeline.run_summary import read_run_summary, timings  # standard library only
from shards.balance_spec import BalanceSpec  # the balancing registry's names only: numpy
from training.comparison import comparison_metrics, medians  # stdlib only
from training.config import CommMode  # typed config, no torch

VARIANTS = ("contiguous", "balanced", "control")
TABLE = (("bubble_fraction", "bubble", "{:.4f}", 1), ("idle_fraction", "idle", "{:.3f}", 1),
         ("step_time_s", "step time (ms)", "{:.1f}", 1e3), ("samples_per_s", "samples/s", "{:.0f}", 1),
         ("hr_at_10", "HR@10", "{:.4f}", 1), ("ndcg_at_10", "NDCG@10", "{:.4f}", 1))
PLOT_NAME = "comparison_timelines.png"


# ----------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale compare", description=__doc__.split("\n\n")[0],
                                epilog="Other --section.key VALUE arguments override the training config.")
    source = p.add_argument_group("what to compare (one of)")
    source.add_argument("--input", help="a prepared dataset (`freescale prepare`'s output): the shard sets are built")
    source.add_argument("--shards", help="existing shard sets: contiguous=DIR,balanced=DIR[,control=DIR]")
    p.add_argument("--world-size", type=int, help="ranks K (with --input; with --shards: the manifests')")
    p.add_argument("--local-batch-size", type=int, help="samples per rank per step B (with --input)")
    # The balanced variant's plan options (BalanceSpec's "compare" surface): strategies are checked
    # in check_args, which refuses contiguous too.
    options.add_arguments(p, BalanceSpec, "compare", choices=False)
    p.add_argument("--cost-model", help="cost-model JSON for every variant (default: the built-in analytic model)")
    p.add_argument("--control", action="store_true", help="also train on the mirror control (the noise floor)")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant (default 3); medians are reported")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--max-steps", type=int, help="steps per run")
    steps.add_argument("--epochs", type=int, help="passes over the balanced shards per run (default 1)")
    p.add_argument("--seed", type=int, default=options.default_of(BalanceSpec, "seed"),
                   help="balance seed, and training seed of repeat r = seed + r")
    p.add_argument("--config", help="training TOML config, for every run")
    p.add_argument("--comm-mode", choices=typing.get_args(CommMode), help="comm mode of every run "
                                                                         "(default: the config's)")
    p.add_argument("--workdir", help="shards, run logs and summaries (default out/compare/<comparison>)")
    p.add_argument("--summary-json", help="write the comparison's numbers here")
    add_tracking_arguments(p, experiment_default=None, experiment_note="freescale-<dataset>")
    return p


def parse_shard_sets(text: str, control: bool) -> dict[str, Path]:
    """``contiguous=DIR,balanced=DIR[,control=DIR]`` -> {variant: DIR}, each holding a manifest."""
    sets: dict[str, Path] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, folder = item.partition("=")
        if not sep or name not in VARIANTS or not folder:
            raise InputError(f"--shards: {item!r} is not VARIANT=DIR with VARIANT one of {', '.join(VARIANTS)}")
        if name in sets:
            raise InputError(f"--shards names {name} twice")
        sets[name] = Path(folder)
    missing = [v for v in VARIANTS[:2] if v not in sets]
    if missing:
        raise InputError(f"--shards lacks {' and '.join(missing)} (contiguous=DIR,balanced=DIR[,control=DIR])")
    if control and "control" not in sets:
        raise InputError("--control with --shards needs control=DIR in --shards")
    return sets  # their manifests are loaded (and checked) once the arguments are known to be sane


def planned_as(variant: str, manifest) -> bool:
    """Whether a shard set was planned as ``variant``: the contiguous baseline, a balanced plan
    (any other strategy) or the mirror control, as its manifest says."""
    if variant == "control":
        return manifest.control == "mirror"
    return manifest.control is None and (manifest.strategy == "contiguous") == (variant == "contiguous")


def check_shard_sets(sets: dict[str, Path], world_size: int | None, local_batch_size: int | None) -> dict:
    """The manifests of ``--shards``' sets ({variant: Manifest}), refused unless they can be
    compared: one shape (world size, local batch size), no set given twice (the same folder, or a
    copy: the same manifest bytes), and each set planned as its label says."""
    from shards.manifest import load_manifest

    manifests = {v: load_manifest(d) for v, d in sets.items()}
    shapes = {(m.world_size, m.local_batch_size) for m in manifests.values()}
    if len(shapes) != 1:
        raise InputError(f"--shards: the shard sets differ in (world size, local batch size): {sorted(shapes)}")
    k, b = next(iter(shapes))
    if world_size not in (None, k) or local_batch_size not in (None, b):
        raise InputError(f"--shards were balanced for --world-size {k} --local-batch-size {b}")
    seen: dict[tuple[str, str], str] = {}
    for variant, manifest in manifests.items():
        for key in (("folder", str(sets[variant].resolve())), ("content", manifest.sha256)):
            if key in seen:
                how = "the same folder" if key[0] == "folder" else "copies of one shard set (the same manifest.json)"
                raise InputError(f"--shards: {seen[key]}={sets[seen[key]]} and {variant}={sets[variant]} are {how}: "
                                 "a comparison needs different shard sets")
            seen[key] = variant
    for variant, manifest in manifests.items():
        if not planned_as(variant, manifest):
            planned = f"the {manifest.control} control" if manifest.control else f"strategy {manifest.strategy}"
            raise InputError(f"--shards: {variant}={sets[variant]} was planned with {planned} (its manifest.json), "
                             f"not as the {variant} set")
    return manifests


def check_args(args: argparse.Namespace, overrides: list[str]) -> None:
    """Everything that needs no Spark, torch or MLflow: a bad argument is one line within a second."""
    from training.attention_kernel import check_attention_kernel
    from training.config import load_config

    if (args.input is None) == (args.shards is None):
        raise InputError("give --input PREPARED (build the shard sets) or --shards contiguous=DIR,balanced=DIR")
    positive = [("--repeats", args.repeats), ("--max-steps", args.max_steps),
                ("--epochs", args.epochs), ("--world-size", args.world_size),
                ("--local-batch-size", args.local_batch_size)]
    for flag, value in positive:
        if value is not None and value < 1:
            raise InputError(f"{flag} must be a positive integer, got {value}")
    args.balanced = {f.name: getattr(args, f.name) for f in options.on_surface(BalanceSpec, "compare")}
    if args.input is not None:
        if args.world_size is None or args.local_batch_size is None:
            raise InputError("--input needs --world-size and --local-batch-size")
        if not is_prepared(args.input):
            raise InputError(f"--input {args.input}: no {METADATA_NAME} (not a `freescale prepare` output)")
        from balancing.strategies import STRATEGIES

        if args.strategy not in STRATEGIES or args.strategy == "contiguous":
            raise InputError(f"--strategy {args.strategy!r}: choose one of "
                             f"{', '.join(s for s in STRATEGIES if s != 'contiguous')}")
        shard_set_specs(args, Path(args.input))  # the balanced variant's values, checked as balance checks them
    else:
        args.shard_sets = parse_shard_sets(args.shards, args.control)
        args.manifests = check_shard_sets(args.shard_sets, args.world_size, args.local_batch_size)
    for flag, path in (("--cost-model", args.cost_model), ("--config", args.config)):
        if path is not None and not Path(path).is_file():
            raise InputError(f"{flag} {path}: no such file")
    if args.summary_json and Path(args.summary_json).is_dir():
        raise InputError(f"--summary-json {args.summary_json} is a directory")
    # A bad key or value in the training config, or a kernel its ranks would refuse here: one line, now.
    check_attention_kernel(load_config(args.config, overrides))


# ----------------------------------------------------------------------- names


def prepared_of(manifest) -> Path | None:
    """The prepared folder a shard set was balanced from (its manifest's input), when local."""
    from pipeline.paths import local_path

    uri = manifest.input.get("uri")
    local = local_path(uri) if uri else None
    return Path(local) if local else None


# ----------------------------------------------------------------------- running the stages


class StageFailed(Exception):
    """A stage (balance, train) failed; its own line was printed, or ``message`` says why."""

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message or f"a stage failed with exit status {code}")
        self.code, self.message = code, message


def shard_set_specs(args: argparse.Namespace, work: Path) -> dict[str, BalanceSpec]:
    """Each variant's shard set, to build into ``work``: the same input, sizes, seed and cost model
    (comparable predicted bubbles), the balanced one with the options compare was given."""
    common = {"input": str(args.input), "world_size": args.world_size, "local_batch_size": args.local_batch_size,
              "seed": args.seed, "cost_model": args.cost_model, "overwrite": True}
    plans = {"contiguous": {"strategy": "contiguous"}, "balanced": args.balanced}
    if args.control:
        plans["control"] = {"strategy": "contiguous", "control": "mirror"}
    return {variant: options.from_values(BalanceSpec, {**common, **plan, "output": str(work / f"shards-{variant}")})
            for variant, plan in plans.items()}


def build_shard_sets(args: argparse.Namespace, work: Path, tracking: Tracking) -> dict[str, Path]:
    """The real balance job, once per variant, into ``work``; their MLflow runs carry the comparison's tags."""
    from jobs import balance

    sets = {}
    for variant, spec in shard_set_specs(args, work).items():
        code = balance.run(lambda spec=spec: spec, tracking)
        if code:
            raise StageFailed(code)
        sets[variant] = Path(spec.output)
    return sets


def train_once(shards: Path, out: Path, settings: list[str]) -> dict:
    """One `freescale train` in a child process, its output in ``out``.log; its summary JSON."""
    cmd = [sys.executable, "-m", "jobs.cli", "train", "--shards", str(shards), "--summary-json", str(out), *settings]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
    log = out.with_suffix(".log")
    with open(log, "w") as handle:
        child = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT)
        try:
            code = child.wait()
        except BaseException:
            child.send_signal(signal.SIGTERM)  # the launcher passes it on; the runs end KILLED
            child.wait()
            raise
    if code:
        lines = [line for line in log.read_text(errors="replace").splitlines() if ": error: " in line]
        reason = lines[-1].split(": error: ", 1)[1] if lines else f"exit status {code}"
        raise StageFailed(code, f"training {out.stem} failed: {reason} (output: {log})")
    return read_run_summary(out)


def run_trainings(args: argparse.Namespace, overrides: list[str], sets: dict[str, Path], steps: int | None,
                  work: Path, uri: str, experiment: str, name: str, comparison: str,
                  parent_run_id: str | None) -> dict[str, list[dict]]:
    """Every repeat, variants alternating, the same seed per repeat; the summaries per variant."""
    runs: dict[str, list[dict]] = {v: [] for v in sets}
    (work / "runs").mkdir(parents=True, exist_ok=True)
    from shards.manifest import load_manifest

    world_size = load_manifest(sets["balanced"]).world_size
    for rep in range(args.repeats):
        for variant in sets:
            settings = ["--nproc-per-node", str(world_size), "--tracking-uri", uri,
                        "--run-name", f"{name}-{variant}-r{rep}", "--training.seed", str(args.seed + rep),
                        "--tracking.experiment", experiment, "--tracking.comparison", comparison]
            settings += ["--tracking.parent_run_id", parent_run_id] if parent_run_id else []
            settings += ["--max-steps", str(steps)] if steps else []
            settings += ["--config", args.config] if args.config else []
            settings += ["--comm-mode", args.comm_mode] if args.comm_mode else []
            result = train_once(sets[variant], work / "runs" / f"{variant}-{rep}.json", [*settings, *overrides])
            summary = result["summary"]
            runs[variant].append({"repeat": rep, "seed": args.seed + rep, "run_id": result.get("mlflow_run_id"),
                                  "summary_json": str(work / "runs" / f"{variant}-{rep}.json"), "summary": summary})
            print(f"freescale compare: repeat {rep} {variant:10s} bubble {summary['bubble_fraction']:.4f}  "
                  f"idle {summary['idle_fraction']:.3f}  step {summary['step_time_s'] * 1e3:.1f} ms  "
                  f"hr@10 {summary['hr_at_10']:.4f}", flush=True)
    return runs


# ----------------------------------------------------------------------- the numbers


def format_table(runs: dict[str, list[dict]], metrics: dict[str, float | None]) -> str:
    """What the terminal shows: per variant the median [min, max] of each number, then the reductions."""
    def cell(rows: list[dict], key: str, fmt: str, scale: float) -> str:
        values = [float(r["summary"][key]) * scale for r in rows]
        return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"

    lines = ["| shards | " + " | ".join(label for _, label, _, _ in TABLE) + " |",
             "| --- " * (len(TABLE) + 1) + "|"]
    for variant, rows in runs.items():
        lines.append(f"| {variant} | " + " | ".join(cell(rows, key, fmt, scale) for key, _, fmt, scale in TABLE) + " |")

    def pct(value: float | None) -> str:
        if value is None:
            return "n/a (nothing to remove)"
        return f"{value:.1%}" + (" (balanced below the floor: the floor is noise)" if value > 1 else "")

    floor = "control" if "control" in runs else "0 (no control)"
    con, bal = (f"{metrics[f'{v}/bubble_fraction']:.4f}" for v in ("contiguous", "balanced"))
    lines += ["",
              f"bubble_reduction: {pct(metrics['bubble_reduction'])} of the removable bubble removed "
              f"(contiguous {con} -> balanced {bal}; floor: {floor})",
              f"idle_reduction:   {pct(metrics['idle_reduction'])} of the removable idle time removed "
              f"({metrics['contiguous/idle_fraction']:.3f} -> {metrics['balanced/idle_fraction']:.3f})",
              "speedup:          " + ("n/a" if metrics["speedup"] is None else
                                      f"{metrics['speedup']:.3f}x samples/s "
                                      f"({metrics['contiguous/samples_per_s']:.0f} -> "
                                      f"{metrics['balanced/samples_per_s']:.0f})"),
              "quality, balanced - contiguous (medians): "
              + ", ".join(f"{k[len('delta_'):]} {v:+.4f}" for k, v in metrics.items() if k.startswith("delta_"))]
    return "\n".join(lines)


def plot_comparison(runs: dict[str, list[dict]], path: Path, title: str) -> Path:
    """Contiguous and balanced side by side: for each, the repeat with its median bubble."""
    import numpy as np

    from training.bubble_plot import plot_comparison_timelines

    columns = {}
    for variant in ("contiguous", "balanced"):
        rows = sorted(runs[variant], key=lambda r: r["summary"]["bubble_fraction"])
        chosen = rows[(len(rows) - 1) // 2]
        saved = read_run_summary(chosen["summary_json"])
        table = np.asarray(timings(saved)[1], dtype=float)
        columns[f"{variant} (repeat {chosen['repeat']}): bubble {chosen['summary']['bubble_fraction']:.2%}"] = \
            (table, saved["steps"])
    return plot_comparison_timelines(columns, path, title=title)


# ----------------------------------------------------------------------- the job


@dataclass
class Comparison:
    """One comparison's names and sizes, fixed before its parent run opens."""

    name: str
    comparison: str
    experiment: str
    uri: str
    work: Path
    world_size: int
    local_batch_size: int
    variants: tuple[str, ...]

    @property
    def control(self) -> str | None:
        return "mirror" if "control" in self.variants else None


def describe(args: argparse.Namespace, uri: str) -> Comparison:
    """The comparison's name (and so its MLflow names and folder) from its sizes and the time."""
    if args.input is not None:
        prepared, world_size, batch = Path(args.input), args.world_size, args.local_batch_size
    else:
        balanced = args.manifests["balanced"]
        world_size, batch = balanced.world_size, balanced.local_batch_size
        prepared = prepared_of(balanced)
        args.strategy = balanced.strategy
    name = f"compare-k{world_size}-b{batch}"
    comparison = f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    work = Path(args.workdir or Path("out") / "compare" / comparison)
    variants = VARIANTS if (args.control or "control" in getattr(args, "shard_sets", {})) else VARIANTS[:2]
    return Comparison(name, comparison, args.experiment or f"freescale-{dataset_name(prepared)}", uri, work,
                      world_size, batch, variants)


@contextlib.contextmanager
def sigterm_raises_stopped() -> Iterator[None]:
    """A scheduler's SIGTERM ends the parent run KILLED, like Ctrl-C (signals reach the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_comparison(args: argparse.Namespace, overrides: list[str], cmp: Comparison, started: float) -> dict:
    """The parent run: the shard sets, every training, the medians and the plot; the comparison's summary."""
    from jobs.tracking import job_run, run_tags

    params = {"input": args.input, "shards": args.shards, "world_size": cmp.world_size,
              "local_batch_size": cmp.local_batch_size, **args.balanced, "strategy": args.strategy,
              "cost_model": args.cost_model, "control": cmp.control, "repeats": args.repeats,
              "max_steps": args.max_steps, "epochs": args.epochs, "seed": args.seed, "config": args.config,
              "comm_mode": args.comm_mode, "overrides": " ".join(overrides), "workdir": str(cmp.work)}
    tags = {**run_tags(args.strategy, cmp.control, cmp.comparison), "freescale.world_size": str(cmp.world_size)}
    with job_run("compare", tracking_uri=cmp.uri, experiment=cmp.experiment, params=params, run_name=cmp.name,
                 tags=tags) as run:
        sets = (build_shard_sets(args, cmp.work, Tracking(cmp.uri, cmp.experiment, cmp.comparison))
                if args.input is not None else {v: args.shard_sets[v] for v in cmp.variants})
        steps = args.max_steps
        if steps is None and args.epochs is not None:
            from shards.manifest import load_manifest

            steps = args.epochs * load_manifest(sets["balanced"]).num_steps
        runs = run_trainings(args, overrides, sets, steps, cmp.work, cmp.uri, cmp.experiment, cmp.name,
                             cmp.comparison, run.run_id)
        metrics = comparison_metrics(medians(runs))
        run.log_metrics(metrics)
        plot = plot_comparison(runs, cmp.work / PLOT_NAME, title=f"{cmp.comparison} ({cmp.experiment})")
        run.log_artifact(plot)
        summary = {"comparison": cmp.comparison, "name": cmp.name, "experiment": cmp.experiment,
                   "experiment_id": run.experiment_id, "parent_run_id": run.run_id, "tracking_uri": cmp.uri,
                   "world_size": cmp.world_size, "local_batch_size": cmp.local_batch_size, "strategy": args.strategy,
                   "control": cmp.control, "repeats": args.repeats, "max_steps": steps, "workdir": str(cmp.work),
                   "shards": {v: str(d) for v, d in sets.items()}, "metrics": metrics, "runs": runs,
                   "plot": str(plot), "seconds": time.time() - started}
        run.log_text(json.dumps(summary, indent=1), "comparison.json")
    return summary


def compare(args: argparse.Namespace, overrides: list[str]) -> int:
    check_args(args, overrides)  # before anything heavy

    from jobs.tracking import reachable_tracking_uri

    # One check for every stage: they get the answer (or 'none'), never a second warning.
    cmp = describe(args, reachable_tracking_uri("compare", args.tracking_uri))
    cmp.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        with sigterm_raises_stopped():
            summary = run_comparison(args, overrides, cmp, started)
    except StageFailed as failed:
        if failed.message:
            error_line("compare", failed.message, details=False)
        return failed.code
    except (Stopped, KeyboardInterrupt) as stopped:
        signum = getattr(stopped, "signum", signal.SIGINT)
        error_line("compare", f"stopped by signal {signum}; the parent run ended KILLED", details=False)
        return 128 + signum
    text = json.dumps(summary, indent=1)
    (cmp.work / "comparison.json").write_text(text)
    if args.summary_json:
        Path(args.summary_json).write_text(text)
    print(f"\n{cmp.name}: {args.repeats} repeats, {summary['max_steps'] or 'one pass of'} steps, strategy "
          f"{args.strategy}; MLflow experiment {cmp.experiment}"
          + (f", parent run {summary['parent_run_id']}" if summary["parent_run_id"] else ", untracked") + "\n")
    print(format_table(summary["runs"], summary["metrics"]))
    print(f"\n(total {time.time() - started:.0f} s; logs, summaries and {PLOT_NAME} in {cmp.work})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    return run_job("compare", lambda: compare(args, overrides))


if __name__ == "__main__":
    sys.exit(main())
