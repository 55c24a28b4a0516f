"""The export job's options, declared once: `freescale export`'s command line is derived from
``ExportSpec`` (freescale/runtime/options.py), and the spec is what the export takes (freescale/training/export/exporter.py).
Standard library only: the parser is built, and the arguments checked, before torch or mlflow load.

``check_arguments`` is every check that needs no checkpoint read: the paths, the output, and a
``--register`` against a tracking store that has no model registry (a file store, or none).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from freescale.runtime.errors import InputError
from freescale.runtime.options import option

CLI = ("cli",)
FILE_STORE_SCHEMES = (None, "file")
"""MLflow's file store: a ``file:`` URI or a plain path. FreeScale registers models only in a database
(``sqlite:///...``, ...) or through a tracking server."""


@dataclass(frozen=True, kw_only=True)
class ExportSpec:
    """One export: the checkpoint read, the folder written, the vocabulary's source, the registry name."""

    SURFACES = ("cli", "pipeline")
    """`freescale export`'s options; the pipeline's [export] section (its paths are the pipeline's)."""

    checkpoint: str = option(help="a training's checkpoint.folder (its newest complete step) or one "
                                  "step_<n> folder in it", surfaces=CLI)
    output: str = option(help="the model folder to create", surfaces=CLI)
    prepared: str | None = option(None, "the `freescale prepare` output the shards came from, for its "
                                        "item_vocab/ (default: found through the shards' manifest)", surfaces=CLI)
    register: str | None = option(None, "also register the MLflow model under this name in the model registry "
                                        "(versions 1, 2, ... on repeated exports); needs a database or server "
                                        "tracking URI", metavar="NAME")
    overwrite: bool = option(False, "replace an existing output", surfaces=CLI)

    def check(self) -> None:
        if self.register is not None and not self.register.strip():
            raise InputError("--register needs a model name")


def check_arguments(spec: ExportSpec, tracking_uri: str) -> None:
    """Refuse, before anything is read or written, what the arguments alone show is wrong (one line,
    exit 2). ``tracking_uri``: the resolved one (``freescale.tracking.store.Tracking.resolved_uri``)."""
    from freescale.runtime.atomic_output import check_local_output_free, check_no_overlap
    from freescale.runtime.paths import local_path

    checkpoint = Path(spec.checkpoint)
    if not checkpoint.is_dir():
        raise InputError(f"--checkpoint {spec.checkpoint}: no such folder")
    if local_path(spec.output) is None:
        raise InputError(f"--output {spec.output}: export writes a local folder (a path or file: URI)")
    check_no_overlap(spec.output, {"--checkpoint": spec.checkpoint, "--prepared": spec.prepared})
    check_local_output_free(spec.output, spec.overwrite)
    if spec.prepared is not None and not Path(spec.prepared).is_dir():
        raise InputError(f"--prepared {spec.prepared}: no such folder")
    if spec.register is not None:
        check_registry(os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri)


def check_registry(uri: str) -> None:
    """A model registry at ``uri``, or one line saying why there is none."""
    from freescale.runtime.paths import split_path
    from freescale.tracking.store import DISABLED

    if uri == DISABLED:
        raise InputError("--register needs MLflow tracking, and --tracking-uri is none")
    if split_path(uri)[0] in FILE_STORE_SCHEMES:
        raise InputError(f"--register: MLflow's file store {uri} has no model registry; track in a database "
                         "(--tracking-uri sqlite:///mlflow.db) or a server (http://HOST:5000)")
