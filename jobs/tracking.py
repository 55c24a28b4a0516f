"""MLflow records of the jobs: one run per job invocation, parameters, statistics, artifacts."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_EXPERIMENT = "freescale"
DISABLED = "none"


def resolve_tracking_uri(cli_value: str | None) -> str:
    """CLI flag, then MLFLOW_TRACKING_URI, then the local sqlite file."""
    return cli_value or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def code_version() -> str:
    """The git commit of the checkout the job runs from, or 'unknown' outside one."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def log_job_run(job: str, *, tracking_uri: str, experiment: str, params: Mapping[str, Any],
                metrics: Mapping[str, float], tags: Mapping[str, str] | None = None,
                artifacts: Mapping[str, str] | None = None, run_name: str | None = None) -> str | None:
    """Record one finished job; return the run id, or None when tracking is disabled.

    Tracking never fails a job whose output is already committed: an unreachable
    server is reported on stderr and the job still exits 0.
    """
    if tracking_uri == DISABLED:
        return None
    try:
        import mlflow

        logging.getLogger("mlflow").setLevel(logging.WARNING)
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_experiment(experiment)
        with mlflow.start_run(run_name=run_name or job) as run:
            mlflow.set_tags({"freescale.job": job, "freescale.code_version": code_version(), **(tags or {})})
            mlflow.log_params({k: _param_value(v) for k, v in params.items()})
            mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None})
            for name, text in (artifacts or {}).items():
                mlflow.log_text(text, name)
            return run.info.run_id
    except Exception as exc:  # noqa: BLE001 - tracking must not turn a finished job into a failure
        print(f"freescale {job}: warning: MLflow logging to {tracking_uri} failed: "
              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return None


def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."
