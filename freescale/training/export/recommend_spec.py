"""The recommend job's options, declared once: `freescale recommend`'s command line and the pipeline's
``[recommend]`` section are derived from ``RecommendSpec`` (freescale/runtime/options.py), and the spec is what
freescale/training/export/spark_recommend.py takes. Standard library only: the parser is built, and the arguments checked,
before Spark, torch or mlflow load.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from freescale.runtime.errors import InputError
from freescale.runtime.options import option

CLI = ("cli",)
MODEL_URI_SCHEMES = ("models:/", "runs:/")
"""Model URIs MLflow resolves through the tracking store (the model registry, a run's artifacts)."""


@dataclass(frozen=True, kw_only=True)
class RecommendSpec:
    """An exported model and a prepare output in, every user's top k out."""

    SURFACES = ("cli", "pipeline")
    """`freescale recommend`'s options; the pipeline's [recommend] keys (its paths are the pipeline's)."""

    model: str = option(help="the exported model: a `freescale export` folder, an MLflow model folder, or a "
                             "models:/NAME/VERSION (or runs:/) URI in the tracking store", surfaces=CLI)
    input: str = option(help="a `freescale prepare` output of the model's vocabulary: each user's whole "
                             "sequence is the history scored", surfaces=CLI)
    output: str = option(help="the Parquet folder to create: user_id (raw), items (raw ids, best first), scores",
                         surfaces=CLI)
    k: int = option(10, "recommendations per user", positive=True)
    exclude_history: Literal["true", "false"] | None = option(
        None, "leave the items of each user's history out (default: the model's own default, true)")
    users: str | None = option(None, "only these users: raw user ids, comma-separated, or @FILE (one per line)",
                               metavar="IDS", surfaces=CLI)
    overwrite: bool = option(False, "replace an existing output", surfaces=CLI)
    master: str | None = option(None, "Spark master (default: spark-submit's, else local[*])", surfaces=CLI)

    def user_ids(self) -> list[str] | None:
        """``--users`` as a list of raw ids (None: every user); a file's lines, blank ones skipped."""
        if self.users is None:
            return None
        if self.users.startswith("@"):
            path = Path(self.users[1:])
            if not path.is_file():
                raise InputError(f"--users {self.users}: no such file")
            ids = [line.strip() for line in path.read_text().splitlines()]
        else:
            ids = [part.strip() for part in self.users.split(",")]
        ids = [user for user in ids if user]
        if not ids:
            raise InputError(f"--users {self.users}: no user id")
        return ids

    def check(self) -> None:
        self.user_ids()


def check_arguments(spec: RecommendSpec) -> None:
    """Refuse, before Spark starts and before anything is written, what the arguments alone show is wrong (one
    line, exit 2): a model that is not there, an input that is not a prepare output, an output that exists."""
    from freescale.runtime.atomic_output import check_local_output_free, check_no_overlap
    from freescale.runtime.paths import local_path
    from freescale.prepare.prepared import is_prepared

    if not spec.model.startswith(MODEL_URI_SCHEMES):
        model = local_path(spec.model)
        if model is None or not Path(model).is_dir():
            raise InputError(f"--model {spec.model}: no such folder (an export folder, an MLflow model folder, "
                             "or a models:/ URI)")
    local_input = local_path(spec.input)
    if local_input is not None and not is_prepared(local_input):
        raise InputError(f"--input {spec.input}: not a `freescale prepare` output (no prepare.json)")
    check_no_overlap(spec.output, {"--input": spec.input,
                                   "--model": None if spec.model.startswith(MODEL_URI_SCHEMES) else spec.model})
    check_local_output_free(spec.output, spec.overwrite)
