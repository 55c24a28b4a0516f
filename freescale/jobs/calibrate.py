"""`freescale calibrate`: fit the balancer's cost model to this machine and measure relative rank speeds.

    freescale calibrate --output cost_model.json [--config FILE] [--lengths 16,32,64,...] [--repeats N]
                        [--num-items N] [--held-out-batches N] [--rank-speeds-output rank_speeds.json]
                        [--nproc-per-node 2] [--overwrite] [--tracking-uri URI] [--model.hstu.num_layers 1 ...]
    freescale balance ... --cost-model cost_model.json --capacities @rank_speeds.json

1. Times the configured model's dense forward+backward on synthetic batches, the encoder
   at the config's ``training.precision`` (freescale/training/calibration/calibrate.py explains the design), fits
   ``cost = a L^2 + b L + c`` and a table of costs at the profiled lengths
   (freescale/costs/calibration.py), and writes the form that predicts held-out lengths better
   as a cost-model JSON whose ``provenance`` records the machine, config, fits, errors and
   the choice.
2. Checks the written model against held-out mixed batches of heavy-tailed lengths.
3. With ``--rank-speeds-output``: starts ``--nproc-per-node`` gloo ranks (torch's
   launcher, as `freescale train` does) that time the same batches in lock-step;
   each rank's capacity (mean time over all ranks / its own) gets a bootstrap
   confidence interval, and capacities other than 1 are written only when the
   difference is real and larger than 2% (freescale/costs/rank_speeds.py: the
   statistics and the file, which `freescale balance` reads).
4. Prints the report and records it, with both JSON files, in MLflow.

Bad input (unparseable or non-positive --lengths, an existing output without
--overwrite, ...) ends the job with one line on stderr and exit status 2. The
arguments are checked before torch is loaded, so that takes a fraction of a second.

This module is the command line and the entry points (`freescale pipeline` calls :func:`run`
with a spec; each rank-speed rank runs ``python -m freescale.jobs.calibrate --rank-speeds-worker``). The
options are freescale/training/calibration/calibrate_spec.py's, the run in its MLflow run freescale/launch/calibration_run.py's,
the ranks freescale/training/calibration/rank_speed_ranks.py's, the timing freescale/training/calibration/calibrate.py's.

Timing is on this machine's CPU with one intra-op thread (the trainer's setting
when ranks fill the cores, as on a 2-core machine with 2 ranks). CUDA ranks would
need CUDA-event timing, which this command does not do yet.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Callable

from freescale.runtime.job_errors import run_job
from freescale.runtime import options
from freescale.training.calibration.calibrate_spec import CalibrateSpec  # standard library only
from freescale.launch.calibration_run import calibrate_and_record, calibration_device  # torch loads when they run
from freescale.training.calibration.rank_speed_ranks import WORKER_FLAG
from freescale.launch.rank_speed_launch import WORKER_MODULE, RankSpeedsFailed  # torch loads in the ranks
from freescale.tracking.store import Tracking, add_tracking_arguments  # no mlflow import until a run opens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale calibrate", description=__doc__.split("\n\n")[0],
                                epilog="Other --section.key VALUE arguments override the config, as for `freescale train`.")
    options.add_arguments(p, CalibrateSpec, "cli", skip=("run_name",))
    add_tracking_arguments(p)
    options.add_arguments(p, CalibrateSpec, "cli", only=("run_name",))
    return p


def log(message: str) -> None:
    print(f"freescale calibrate: {message}", flush=True)


def calibrate(spec: CalibrateSpec, overrides: list[str], tracking: Tracking) -> int:
    # The arguments were checked as the spec was built; the config (typed, torch-free) next: a bad
    # one is reported before the imports below, which load torch (seconds).
    from freescale.training.config import load_config

    config = load_config(spec.config, overrides)
    device = calibration_device(spec.device, config.model)

    from freescale.tracking.runs import job_run
    uri = tracking.reachable_uri("calibrate")  # unreachable: one warning, untracked

    # The run spans the job's work (profiling, rank speeds), FAILED if the job fails.
    with job_run("calibrate", tracking_uri=uri, experiment=tracking.experiment,
                 tags={"freescale.output": str(Path(spec.output))},
                 run_name=spec.run_name or f"calibrate-{socket.gethostname()}") as run:
        try:
            chosen = calibrate_and_record(spec, config, overrides, device, run, log)
        except RankSpeedsFailed as err:
            print(f"freescale calibrate: error: {err}\n(the cost model {spec.output} was written; "
                  "no rank speeds were)", file=sys.stderr)
            run.end("FAILED")
            return 1
    log(f"wrote {spec.output} ({chosen})" + (f" and {spec.rank_speeds_output}" if spec.rank_speeds_output else ""))
    return 0


def run(spec_of: Callable[[], CalibrateSpec], overrides: list[str], tracking: Tracking) -> int:
    """The calibration of ``spec_of()`` (built inside the job's error handling: a bad value is its one
    line), ``overrides`` on the timed config (``--section.key VALUE``); its exit status.
    `freescale pipeline` calls it in-process."""
    return run_job("calibrate", lambda: calibrate(spec_of(), overrides, tracking))


def main(argv: list[str] | None = None) -> int:
    args, overrides = build_parser().parse_known_args(argv)
    return run(lambda: options.from_values(CalibrateSpec, vars(args)), overrides, Tracking.of(args))


def rank_main(argv: list[str]) -> None:
    """One rank of the rank-speed measurement (``python -m freescale.jobs.calibrate --rank-speeds-worker``)."""
    from freescale.training.parallel.distributed import exit_without_finalization
    from freescale.training.calibration.rank_speed_ranks import rank_speeds_worker

    exit_without_finalization(run_job(f"calibrate (rank {os.environ.get('RANK', '0')})",
                                      lambda: rank_speeds_worker(argv, f"{WORKER_MODULE} {WORKER_FLAG}")))


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER_FLAG]:
        rank_main(sys.argv[2:])
    sys.exit(main(sys.argv[1:]))
