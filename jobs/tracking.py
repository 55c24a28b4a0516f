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
        print(f"freescale {job}: warning: MLflow logging to {tracking_uri} failed: {failure(exc)}", file=sys.stderr)
        return None


def failure(exc: BaseException) -> str:
    """A tracking error as warnings name it: its type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


# ------------------------------------------------------- a server that does not answer

CHECK_TIMEOUT_S = 5.0
# mlflow's own HTTP client retries 7 times with a 120 s timeout: minutes per call on a
# dead server. Once the server answered the check, a server that dies mid-job should
# cost seconds; a user's own settings win.
SHORT_MLFLOW_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def reachable_tracking_uri(job: str, cli_value: str | None) -> str:
    """The job's tracking URI (see resolve_tracking_uri), or DISABLED when its server does not answer.

    Called once before the job's work starts, so tracking never stops or stalls a job:
    an unreachable server costs at most CHECK_TIMEOUT_S and one warning line, and the
    job runs untracked.
    """
    uri = resolve_tracking_uri(cli_value)
    if uri == DISABLED:
        return uri
    for name, value in SHORT_MLFLOW_RETRIES.items():
        os.environ.setdefault(name, value)
    reason = unreachable_reason(uri)
    if reason is None:
        return uri
    sys.stderr.write(f"freescale {job}: warning: MLflow at {uri} is unreachable ({reason}); running untracked\n")
    sys.stderr.flush()
    return DISABLED


def unreachable_reason(uri: str, timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """Why an http(s) tracking server does not answer, or None when it does.

    A plain GET of its /health with a socket timeout, not mlflow's retrying client. An
    MLflow server answers 200; 401/403 (an authenticating proxy in front of one) count as
    reachable too, anything else as not (a 404 is some other server). Local stores
    (sqlite, file) need no network and are not checked.
    """
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    if urlsplit(uri).scheme not in ("http", "https"):
        return None
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError as exc:
        return None if exc.code in (401, 403) else f"HTTP {exc.code} from /health"
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            return f"no answer in {timeout_s:g} s"
        return getattr(reason, "strerror", None) or str(reason) or type(reason).__name__
