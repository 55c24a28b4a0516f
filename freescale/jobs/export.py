"""`freescale export`: a training checkpoint -> one unsharded model folder and an MLflow model.

    freescale export --checkpoint CKPT --output out/model [--register NAME] [--prepared PREPARED]

Reads a training's checkpoint folder (its newest complete step, or the step_<n> given) saved by
any number of ranks, in this one process without TorchRec, and writes one folder atomically: the
weights (fp32), the model config, the item vocabulary (dense id -> raw item id of the input logs),
the evaluation protocol. It is logged as an MLflow pyfunc model on the training's own run (or, when
the tracking store does not hold it, on this job's run) and, with --register, registered in the
model registry. The options are freescale/training/export/spec.py's ExportSpec; the work is
freescale/training/export/exporter.py's; the model's predict, freescale/training/export/exported_model.py's.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from freescale.runtime.job_errors import run_job
from freescale.runtime import options
from freescale.training.export.spec import ExportSpec, check_arguments  # standard library only
from freescale.tracking.store import Tracking, add_tracking_arguments  # no mlflow import


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale export", description=__doc__.split("\n\n")[0])
    options.add_arguments(p, ExportSpec, "cli")
    add_tracking_arguments(p)
    return p


def export(spec: ExportSpec, tracking: Tracking) -> int:
    # Arguments first: a bad one is reported before torch or mlflow loads, and before anything is written.
    check_arguments(spec, tracking.resolved_uri())
    from freescale.training.export.exporter import export as export_checkpoint

    return export_checkpoint(spec, tracking)


def run(spec_of: Callable[[], ExportSpec], tracking: Tracking) -> int:
    """The job on the spec ``spec_of()`` builds (inside the job's error handling: a bad value is its
    one line); its exit status. `freescale pipeline` can call it in-process."""
    return run_job("export", lambda: export(spec_of(), tracking))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(lambda: options.from_values(ExportSpec, vars(args)), Tracking.of(args))


if __name__ == "__main__":
    sys.exit(main())
