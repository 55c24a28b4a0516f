"""Where the jobs' MLflow runs go: the tracking URI (``--tracking-uri``, its default, a check that it
answers and takes writes before a job starts work), the experiment, and the links FreeScale prints."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from freescale.runtime.errors import one_line

DEFAULT_EXPERIMENT = "freescale"  # every job's MLflow experiment unless told otherwise


DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


DISABLED = "none"


TRACKING_URI_HELP = f"MLflow URI (default $MLFLOW_TRACKING_URI or {DEFAULT_TRACKING_URI}; '{DISABLED}' disables)"


def add_tracking_arguments(parser: argparse.ArgumentParser, experiment: bool = True,
                           experiment_default: str | None = DEFAULT_EXPERIMENT,
                           experiment_note: str = DEFAULT_EXPERIMENT) -> None:
    """Every job's ``--tracking-uri`` and (unless ``experiment`` is False) ``--experiment``."""
    parser.add_argument("--tracking-uri", help=TRACKING_URI_HELP)
    if experiment:
        parser.add_argument("--experiment", default=experiment_default,
                            help=f"MLflow experiment (default {experiment_note})")


@dataclass(frozen=True)
class Tracking:
    """Where a job records its run: the tracking URI setting, ``--experiment``, and the `freescale
    compare` it belongs to (MLflow tag freescale.comparison). Every job and stage reads its tracking
    URI through one of these: :meth:`resolved_uri`, or :meth:`reachable_uri` before its run opens."""

    uri: str | None = None
    """``--tracking-uri``, ``[tracking] uri`` or ``[pipeline] tracking_uri``: None (unset: resolve_tracking_uri's
    default), DISABLED or a URI. A config file's unset is "": it is None here."""
    experiment: str | None = DEFAULT_EXPERIMENT
    """None: the job names it (compare: freescale-<dataset>)."""
    comparison: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "uri", self.uri or None)  # the one meaning of unset, whatever set it

    @classmethod
    def of(cls, args: argparse.Namespace) -> Tracking:
        return cls(args.tracking_uri, args.experiment, getattr(args, "comparison", None))

    def resolved_uri(self) -> str:
        """The tracking URI the setting names (resolve_tracking_uri); DISABLED when disabled."""
        return resolve_tracking_uri(self.uri)

    def reachable_uri(self, job: str) -> str:
        """The resolved URI, or DISABLED when it cannot be used (reachable_tracking_uri: at most one
        warning line of ``freescale JOB``)."""
        return reachable_tracking_uri(job, self.uri)


def resolve_tracking_uri(setting: str | None) -> str:
    """A tracking URI setting (None: unset), then MLFLOW_TRACKING_URI, then the local sqlite file."""
    return setting or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


# What an experiment holds, for MLflow UIs that choose their view by it. MLflow 3.17's own UI does
# not (its bundle reads the GenAI / model-training switch, a URL parameter kept per browser), so
# the links FreeScale prints carry TRAINING_VIEW: run_url.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


TRAINING_VIEW = "workflowType=machine_learning"


def run_url(uri: str, experiment_id: str | None, run_id: str | None = None) -> str | None:
    """The MLflow UI page of a run (or, without one, of its experiment's runs) in the training-runs
    view; None unless ``uri`` is a tracking server (http, https)."""
    if not uri.startswith(("http://", "https://")) or not experiment_id:
        return None
    page = f"runs/{run_id}" if run_id else "runs"
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/{page}?{TRAINING_VIEW}"


def find_or_create_experiment(client, name: str) -> str:
    """The id of experiment `name`, created when missing (every job's and training's run), in MLflow's
    training-runs view (EXPERIMENT_KIND_TAG; set on one made before it had that tag, never changed)."""
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except Exception:  # noqa: BLE001 - another job created it first: use theirs
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if EXPERIMENT_KIND_TAG not in found.tags:
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return found.experiment_id


CHECK_TIMEOUT_S = 5.0


# mlflow's own HTTP client retries 7 times with a 120 s timeout: minutes per call on a
# dead server. Once the server answered the check, a server that dies mid-job should
# cost seconds; a user's own settings win.
SHORT_MLFLOW_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def reachable_tracking_uri(job: str, setting: str | None) -> str:
    """The job's tracking URI (see resolve_tracking_uri), or DISABLED when its server does not
    answer or its local store cannot be written.

    Called once before the job's work starts, so tracking never stops or stalls a job:
    an unreachable server or an unwritable store costs at most CHECK_TIMEOUT_S and one
    warning line, and the job runs untracked.
    """
    uri = resolve_tracking_uri(setting)
    if uri == DISABLED:
        return uri
    for name, value in SHORT_MLFLOW_RETRIES.items():
        os.environ.setdefault(name, value)
    reason = unreachable_reason(uri)
    if reason is None:
        reason = unwritable_store_reason(uri)
        if reason is None:
            return uri
        problem = f"cannot be written ({reason})"
    else:
        problem = f"is unreachable ({reason})"
    sys.stderr.write(f"freescale {job}: warning: MLflow at {uri} {problem}; running untracked\n")
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


def unwritable_store_reason(uri: str, timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """Why a local store (``sqlite:///FILE``, ``file:DIR`` or a plain folder) cannot be written,
    or None when it can (and for every other kind of store, which is not checked).

    mlflow retries opening an unusable sqlite file for about 100 s, logging each attempt, and
    creates missing parent folders: so the file must be a readable sqlite database in a folder
    this process can create files in (sqlite's journal goes beside it), or, when missing, its
    nearest existing parent folder must take a new file. The probe is a nameless temporary
    file: nothing is left behind.
    """
    import sqlite3
    import tempfile
    from urllib.parse import quote, urlsplit

    from freescale.runtime.paths import local_path

    scheme = urlsplit(uri).scheme
    if scheme == "sqlite":
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        if path in ("", ":memory:"):
            return None
    elif scheme in ("", "file") and local_path(uri) is not None:
        path = local_path(uri)
    else:
        return None
    target = Path(path).absolute()
    if target.exists():
        if scheme == "sqlite":
            if target.is_dir():
                return f"{target} is a folder, not a sqlite file"
            try:
                with contextlib.closing(sqlite3.connect(f"file:{quote(str(target))}?mode=rw", uri=True,
                                                        timeout=timeout_s)) as db:
                    db.execute("select count(*) from sqlite_master").fetchone()
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc):  # busy with another job's write: usable
                    return f"{target}: {exc}"
            except sqlite3.DatabaseError as exc:
                return f"{target}: {exc}"
            if not os.access(target, os.R_OK | os.W_OK):
                return f"{target} is read-only"
        folder = target.parent if scheme == "sqlite" else target
    else:
        folder = next(p for p in target.parents if p.exists())
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"cannot create files in {folder}: {exc.strerror or one_line(exc)}"
    return None
