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
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from jobs.job_errors import error_line, run_job
from pipeline.stops import Stopped
from training.tracking import Tracking, add_tracking_arguments  # no mlflow import until a run opens
from pipeline import options
from pipeline.errors import InputError
from pipeline.options import option
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


SOURCE = "what to compare (one of)"
HEAD = ("input", "shards", "world_size", "local_batch_size")
"""The options listed before the balanced variant's (BalanceSpec's "compare" surface) on the command line."""


@dataclass(frozen=True, kw_only=True)
class CompareSpec:
    """What to compare, how often and how long, and the balanced variant's plan options."""

    SURFACES = ("cli",)

    input: str | None = option(None, "a prepared dataset (`freescale prepare`'s output): the shard sets are built",
                               group=SOURCE)
    shards: str | None = option(None, "existing shard sets: contiguous=DIR,balanced=DIR[,control=DIR]", group=SOURCE)
    world_size: int | None = option(None, "ranks K (with --input; with --shards: the manifests')", positive=True)
    local_batch_size: int | None = option(None, "samples per rank per step B (with --input)", positive=True)
    balanced: dict[str, Any] = field(default_factory=dict)
    """BalanceSpec's "compare" options (strategy, window_steps, ...), for the balanced shard set."""
    cost_model: str | None = option(None, "cost-model JSON for every variant (default: the built-in analytic model)")
    control: bool = option(False, "also train on the mirror control (the noise floor)")
    repeats: int = option(3, "runs per variant (default 3); medians are reported", positive=True)
    max_steps: int | None = option(None, "steps per run", positive=True, exclusive="steps")
    epochs: int | None = option(None, "passes over the balanced shards per run (default 1)", positive=True,
                                exclusive="steps")
    seed: int = option(options.default_of(BalanceSpec, "seed"), "balance seed, and training seed of repeat "
                                                                 "r = seed + r", show_default=False)
    config: str | None = option(None, "training TOML config, for every run")
    comm_mode: CommMode | None = option(None, "comm mode of every run (default: the config's)")
    workdir: str | None = option(None, "shards, run logs and summaries (default out/compare/<comparison>)")
    summary_json: str | None = option(None, "write the comparison's numbers here")

    def check(self) -> None:
        if (self.input is None) == (self.shards is None):
            raise InputError("give --input PREPARED (build the shard sets) or --shards contiguous=DIR,balanced=DIR")
        if self.input is not None and (self.world_size is None or self.local_batch_size is None):
            raise InputError("--input needs --world-size and --local-batch-size")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale compare", description=__doc__.split("\n\n")[0],
                                epilog="Other --section.key VALUE arguments override the training config.")
    options.add_arguments(p, CompareSpec, "cli", only=HEAD)
    # The balanced variant's plan options: strategies are checked in check_args, which refuses contiguous too.
    options.add_arguments(p, BalanceSpec, "compare", choices=False)
    options.add_arguments(p, CompareSpec, "cli", skip=HEAD)
    add_tracking_arguments(p, experiment_default=None, experiment_note="freescale-<dataset>")
    return p


def spec_of_args(args: argparse.Namespace) -> CompareSpec:
    balanced = {f.name: getattr(args, f.name) for f in options.on_surface(BalanceSpec, "compare")}
    return options.from_values(CompareSpec, {**vars(args), "balanced": balanced})


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


def check_args(spec: CompareSpec, overrides: list[str]) -> dict:
    """Everything that needs no Spark, torch or MLflow: a bad argument is one line within a second.
    With --shards: their manifests ({variant: Manifest}); with --input: {}."""
    from training.attention_kernel import check_attention_kernel
    from training.config import load_config

    manifests = {}
    if spec.input is not None:
        if not is_prepared(spec.input):
            raise InputError(f"--input {spec.input}: no {METADATA_NAME} (not a `freescale prepare` output)")
        from balancing.strategies import STRATEGIES

        strategy = spec.balanced["strategy"]
        if strategy not in STRATEGIES or strategy == "contiguous":
            raise InputError(f"--strategy {strategy!r}: choose one of "
                             f"{', '.join(s for s in STRATEGIES if s != 'contiguous')}")
        shard_set_specs(spec, Path(spec.input))  # the balanced variant's values, checked as balance checks them
    else:
        manifests = check_shard_sets(parse_shard_sets(spec.shards, spec.control), spec.world_size,
                                     spec.local_batch_size)
    for flag, path in (("--cost-model", spec.cost_model), ("--config", spec.config)):
        if path is not None and not Path(path).is_file():
            raise InputError(f"{flag} {path}: no such file")
    if spec.summary_json and Path(spec.summary_json).is_dir():
        raise InputError(f"--summary-json {spec.summary_json} is a directory")
    # A bad key or value in the training config, or a kernel its ranks would refuse here: one line, now.
    check_attention_kernel(load_config(spec.config, overrides))
    return manifests


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


def shard_set_specs(args: CompareSpec, work: Path) -> dict[str, BalanceSpec]:
    """Each variant's shard set, to build into ``work``: the same input, sizes, seed and cost model
    (comparable predicted bubbles), the balanced one with the options compare was given."""
    common = {"input": str(args.input), "world_size": args.world_size, "local_batch_size": args.local_batch_size,
              "seed": args.seed, "cost_model": args.cost_model, "overwrite": True}
    plans = {"contiguous": {"strategy": "contiguous"}, "balanced": args.balanced}
    if args.control:
        plans["control"] = {"strategy": "contiguous", "control": "mirror"}
    return {variant: options.from_values(BalanceSpec, {**common, **plan, "output": str(work / f"shards-{variant}")})
            for variant, plan in plans.items()}


def build_shard_sets(args: CompareSpec, work: Path, tracking: Tracking) -> dict[str, Path]:
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


def run_trainings(args: CompareSpec, overrides: list[str], sets: dict[str, Path], steps: int | None,
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
    """One comparison's names, sizes and shard sets, fixed before its parent run opens."""

    name: str
    comparison: str
    experiment: str
    uri: str
    work: Path
    world_size: int
    local_batch_size: int
    strategy: str
    """The balanced variant's."""
    given_sets: dict[str, Path]
    """--shards' sets, by variant ({} with --input: they are built)."""
    control: str | None


def describe(spec: CompareSpec, manifests: dict, tracking: Tracking) -> Comparison:
    """The comparison's name (and so its MLflow names and folder) from its sizes and the time."""
    if spec.input is not None:
        prepared, world_size, batch = Path(spec.input), spec.world_size, spec.local_batch_size
        strategy, given = spec.balanced["strategy"], {}
    else:
        balanced = manifests["balanced"]
        world_size, batch, strategy = balanced.world_size, balanced.local_batch_size, balanced.strategy
        sets = parse_shard_sets(spec.shards, spec.control)
        # In VARIANTS' order, whatever the order given: the runs alternate in it.
        prepared, given = prepared_of(balanced), {v: sets[v] for v in VARIANTS if v in sets}
    name = f"compare-k{world_size}-b{batch}"
    comparison = f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    work = Path(spec.workdir or Path("out") / "compare" / comparison)
    control = "mirror" if spec.control or "control" in given else None
    return Comparison(name, comparison, tracking.experiment or f"freescale-{dataset_name(prepared)}", tracking.uri,
                      work, world_size, batch, strategy, given, control)


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


def run_comparison(args: CompareSpec, overrides: list[str], cmp: Comparison, started: float) -> dict:
    """The parent run: the shard sets, every training, the medians and the plot; the comparison's summary."""
    from training.tracking import job_run, run_tags

    params = {"input": args.input, "shards": args.shards, "world_size": cmp.world_size,
              "local_batch_size": cmp.local_batch_size, **args.balanced, "strategy": cmp.strategy,
              "cost_model": args.cost_model, "control": cmp.control, "repeats": args.repeats,
              "max_steps": args.max_steps, "epochs": args.epochs, "seed": args.seed, "config": args.config,
              "comm_mode": args.comm_mode, "overrides": " ".join(overrides), "workdir": str(cmp.work)}
    tags = {**run_tags(cmp.strategy, cmp.control, cmp.comparison), "freescale.world_size": str(cmp.world_size)}
    with job_run("compare", tracking_uri=cmp.uri, experiment=cmp.experiment, params=params, run_name=cmp.name,
                 tags=tags) as run:
        sets = (build_shard_sets(args, cmp.work, Tracking(cmp.uri, cmp.experiment, cmp.comparison))
                if args.input is not None else cmp.given_sets)
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
                   "world_size": cmp.world_size, "local_batch_size": cmp.local_batch_size, "strategy": cmp.strategy,
                   "control": cmp.control, "repeats": args.repeats, "max_steps": steps, "workdir": str(cmp.work),
                   "shards": {v: str(d) for v, d in sets.items()}, "metrics": metrics, "runs": runs,
                   "plot": str(plot), "seconds": time.time() - started}
        run.log_text(json.dumps(summary, indent=1), "comparison.json")
    return summary


def compare(spec: CompareSpec, overrides: list[str], tracking: Tracking) -> int:
    manifests = check_args(spec, overrides)  # before anything heavy

    from training.tracking import reachable_tracking_uri

    # One check for every stage: they get the answer (or 'none'), never a second warning.
    tracking = dataclasses.replace(tracking, uri=reachable_tracking_uri("compare", tracking.uri))
    cmp = describe(spec, manifests, tracking)
    cmp.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        with sigterm_raises_stopped():
            summary = run_comparison(spec, overrides, cmp, started)
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
    if spec.summary_json:
        Path(spec.summary_json).write_text(text)
    print(f"\n{cmp.name}: {spec.repeats} repeats, {summary['max_steps'] or 'one pass of'} steps, strategy "
          f"{cmp.strategy}; MLflow experiment {cmp.experiment}"
          + (f", parent run {summary['parent_run_id']}" if summary["parent_run_id"] else ", untracked") + "\n")
    print(format_table(summary["runs"], summary["metrics"]))
    print(f"\n(total {time.time() - started:.0f} s; logs, summaries and {PLOT_NAME} in {cmp.work})", flush=True)
    return 0


def run(spec_of: Callable[[], CompareSpec], overrides: list[str], tracking: Tracking) -> int:
    """The comparison of ``spec_of()`` (built inside the job's error handling), ``overrides`` on every
    training's config; its exit status. `freescale pipeline` calls it in-process."""
    return run_job("compare", lambda: compare(spec_of(), overrides, tracking))


def main(argv: list[str] | None = None) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    return run(lambda: spec_of_args(args), overrides, Tracking(args.tracking_uri, args.experiment))


if __name__ == "__main__":
    sys.exit(main())
