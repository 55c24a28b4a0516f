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
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from freescale.runtime.job_errors import error_line, run_job
from freescale.runtime import options
from freescale.runtime.errors import InputError
from freescale.prepare.prepared import METADATA_NAME, is_prepared  # standard library only
from freescale.runtime.stops import Stopped, stops_on_signals
from freescale.shards.balance_spec import BalanceSpec  # the balancing registry's names only: numpy
from freescale.shards.shard_sets import check_shard_sets, parse_shard_sets
from freescale.launch.comparison import (  # no torch
    HEAD,
    PLOT_NAME,
    Comparison,
    CompareSpec,
    StageFailed,
    comparison_metrics,
    comparison_note,
    describe,
    format_table,
    medians,
    plot_comparison,
    run_trainings,
)
from freescale.tracking.store import Tracking, add_tracking_arguments  # no mlflow import until a run opens


# ----------------------------------------------------------------------- arguments


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


def check_args(spec: CompareSpec, overrides: list[str]) -> dict:
    """Everything that needs no Spark, torch or MLflow: a bad argument is one line within a second.
    With --shards: their manifests ({variant: Manifest}); with --input: {}."""
    from freescale.training.parallel.rank_checks import check_ranks_can_run
    from freescale.training.config import load_config

    manifests = {}
    if spec.input is not None:
        if not is_prepared(spec.input):
            raise InputError(f"--input {spec.input}: no {METADATA_NAME} (not a `freescale prepare` output)")
        from freescale.balancing.strategies import STRATEGIES

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
    # A bad key or value in the training config, or what its ranks would refuse here: one line, now.
    check_ranks_can_run(load_config(spec.config, overrides))
    return manifests


# ----------------------------------------------------------------------- names


# ----------------------------------------------------------------------- running the stages


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
    from freescale.jobs import balance

    sets = {}
    for variant, spec in shard_set_specs(args, work).items():
        code = balance.run(lambda spec=spec: spec, tracking)
        if code:
            raise StageFailed(code)
        sets[variant] = Path(spec.output)
    return sets


# ----------------------------------------------------------------------- the numbers


# ----------------------------------------------------------------------- the job


def run_comparison(args: CompareSpec, overrides: list[str], cmp: Comparison, started: float) -> dict:
    """The parent run: the shard sets, every training, the medians and the plot; the comparison's summary."""
    from freescale.shards.schema import MANIFEST_NAME
    from freescale.tracking.datasets import DataRef
    from freescale.tracking.runs import NOTE_TAG, job_run, run_tags
    from freescale.tracking.store import run_url

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
            from freescale.shards.manifest import load_manifest

            steps = args.epochs * load_manifest(sets["balanced"]).num_steps
        run.log_inputs({v: DataRef.shards(str(d.resolve()), (d / MANIFEST_NAME).read_text()) for v, d in sets.items()})

        def tag(variant: str, row: dict) -> None:  # MLflow's charts group the nested runs by these
            if row["run_id"]:
                run.set_tags({"variant": variant, "repeat": str(row["repeat"])}, run_id=row["run_id"])
        runs = run_trainings(args, overrides, sets, steps, cmp.work, cmp.uri, cmp.experiment, cmp.name,
                             cmp.comparison, run.run_id, on_run=tag)
        metrics = comparison_metrics(medians(runs))
        run.log_metrics(metrics)
        plot = plot_comparison(runs, cmp.work / PLOT_NAME, title=f"{cmp.comparison} ({cmp.experiment})")
        run.log_artifact(plot)
        summary = {"comparison": cmp.comparison, "name": cmp.name, "experiment": cmp.experiment,
                   "experiment_id": run.experiment_id, "parent_run_id": run.run_id, "tracking_uri": cmp.uri,
                   "world_size": cmp.world_size, "local_batch_size": cmp.local_batch_size, "strategy": cmp.strategy,
                   "control": cmp.control, "repeats": args.repeats, "max_steps": steps, "workdir": str(cmp.work),
                   "shards": {v: str(d) for v, d in sets.items()}, "metrics": metrics, "runs": runs,
                   "plot": str(plot), "seconds": time.time() - started,
                   "experiment_url": run_url(cmp.uri, run.experiment_id),
                   "parent_run_url": run_url(cmp.uri, run.experiment_id, run.run_id)}
        run.log_text(json.dumps(summary, indent=1), "comparison.json")
        run.set_tags({NOTE_TAG: comparison_note(summary)})
    return summary


def compare(spec: CompareSpec, overrides: list[str], tracking: Tracking) -> int:
    manifests = check_args(spec, overrides)  # before anything heavy

    # One check for every stage: they get the answer (or 'none'), never a second warning.
    tracking = dataclasses.replace(tracking, uri=tracking.reachable_uri("compare"))
    cmp = describe(spec, manifests, tracking)
    cmp.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        with stops_on_signals():
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
          + (f", parent run {summary['parent_run_id']}" if summary["parent_run_id"] else ", untracked")
          + (f"\n{summary['parent_run_url']}" if summary["parent_run_url"] else "") + "\n")
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
