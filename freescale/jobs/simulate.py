"""`freescale simulate`: predicted step time, bubble_fraction and idle_fraction on K ranks.

    freescale simulate --input PREPARED --world-sizes 256,1024 --local-batch-size 16 \\
        --cost-model cost_model.json --noise-from control.json --calibrate-from control.json
    freescale simulate --lengths lognormal:4.2,0.9 --world-sizes 8,64,512,4096 --noise-cv 0.1
    freescale simulate --shards SHARDS --noise-from control.json --calibrate-from control.json

With --input or --lengths, every K gets two plans from the real planner (freescale.balancing.window.plan):
`contiguous` (the data-parallel baseline) and `balanced` (--strategy over windows of
--window-steps steps), on K x B x --steps sample lengths: a seeded shuffle of the dataset's, or,
when it has fewer, drawn with replacement from its length distribution (the output says so).
With --shards, the shard set's own plan at its world size. Each plan's per-step loads go through
the Monte Carlo of freescale/balancing/simulate.py: seconds per cost unit, per-rank noise and the
non-compute part of a step, each fitted on measured runs (`freescale train --summary-json`) or
given explicitly, and the per-step constant of the plans' cost model (what `freescale calibrate`
measured every step costs whatever its samples), in every rank's compute. Output: a table (per K and plan, and the balanced/contiguous reduction),
--json, and one MLflow run with the numbers and a bubble-vs-K plot.

The options are freescale/balancing/simulation_spec.py's SimulationSpec; the time model and built plans are
freescale/balancing/simulation_run.py's, the shard set's plan and a dataset's lengths freescale/shards/simulation.py's,
the tables, metrics and plot freescale/balancing/simulation_report.py's.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from freescale.balancing.simulation_spec import SimulationSpec, add_simulation_arguments  # numpy only
from freescale.runtime.job_errors import run_job
from freescale.runtime import options
from freescale.tracking.store import add_tracking_arguments  # no mlflow import until a run opens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale simulate", description=__doc__.split("\n\n")[0])
    add_simulation_arguments(p)  # SimulationSpec's options
    p.add_argument("--json", help="write the predictions here")
    p.add_argument("--plot", help="also write the bubble-vs-K PNG here")
    add_tracking_arguments(p)
    p.add_argument("--run-name", help="MLflow run name (default simulate)")
    return p


def warn(message: str) -> None:
    print(f"freescale simulate: warning: {message}", file=sys.stderr)


def simulate(spec: SimulationSpec, args: argparse.Namespace) -> int:
    """Predict ``spec``'s plans, print and record them (--json, --plot, the MLflow run of ``args``)."""
    from freescale.balancing.simulation_report import (PLOT_NAME, plot_bubbles, plot_title, print_report, reduction_metrics,
                                             row_metrics)
    from freescale.balancing.simulation_run import build_time_model, read_measured
    from freescale.balancing.time_model import predict, reductions
    from freescale.runtime.json_files import write_json
    from freescale.shards.simulation import simulation_plans
    from freescale.tracking.runs import job_run
    from freescale.tracking.store import Tracking

    measured = read_measured(spec, warn)  # measured runs first: a bad file fails before planning
    uri = Tracking.of(args).reachable_uri("simulate")
    params = {k: v for k, v in vars(args).items() if v is not None and k not in ("tracking_uri", "json", "plot")}
    with job_run("simulate", tracking_uri=uri, experiment=args.experiment, params=params,
                 run_name=args.run_name or "simulate") as run:
        plans, what, plans_model = simulation_plans(spec, measured.cost_model)
        model, described = build_time_model(spec, measured, plans_model, warn)  # with the plans' per-step constant
        rows = predict(plans, model, what["local_batch_size"], spec.seed)
        reduced = reductions(rows)
        print_report(what, described, rows, reduced)
        result = {"what": what, "model": described, "predictions": rows, "reductions": reduced}
        if args.json:
            write_json(args.json, result)
        run.log_metrics(row_metrics(rows))
        run.log_metrics(reduction_metrics(reduced))
        run.log_metrics({"step_constant_s": described["step_constant_s"]})
        run.log_text(json.dumps(result, indent=2), "simulation.json")
        if args.plot or run.active:
            with tempfile.TemporaryDirectory() as tmp:
                picture = plot_bubbles(rows, Path(tmp) / PLOT_NAME, plot_title(what))
                if args.plot:
                    shutil.copyfile(picture, args.plot)
                run.log_artifact(picture)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The spec is checked inside the job's error handling: a bad value is its one line, exit 2.
    return run_job("simulate", lambda: simulate(options.from_values(SimulationSpec, vars(args)), args))


if __name__ == "__main__":
    sys.exit(main())
