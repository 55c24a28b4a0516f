"""`freescale export`: a training checkpoint -> one unsharded model folder, logged as an MLflow model.

    export(spec, tracking)      # freescale/jobs/export.py parses and checks; `freescale pipeline` may call it too

The checkpoint (``freescale.training.checkpoint.checkpointer``: DCP's shards of any world size, each rank's own file,
``CONFIG``, ``COMPLETE``) is read in this one process, without a process group and without TorchRec:
DCP assembles every table from its shards (``no_dist``), through the safe reader and planner
(``freescale.training.checkpoint.safe_load``: nothing of a checkpoint runs code). The weights the trainer's summary
evaluated are exported: the best validation's when the checkpoint keeps best weights and a
validation chose them, else the model's. The folder (``freescale.training.export.exported_model`` describes it) is
written under ``<output>.tmp-<hex>`` and renamed into place last, so a failure leaves no output; it
is loaded and queried once before that. The MLflow model (``mlflow.pyfunc``, its code
``freescale/model_pyfunc.py``) is logged on the training's own run when the tracking store holds it
(the run id is in rank 0's file), else on this job's run, and registered with ``--register NAME``.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shutil
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from freescale.runtime.errors import InputError, ServiceUnavailable, one_line
from freescale.training.checkpoint.checkpointer import COMPLETE, CONFIG, STEP_DIR, Checkpointer
from freescale.training.config import ConfigError, TrainConfig, apply_table, moved_flat, to_flat_dict
from freescale.training.export.spec import ExportSpec
from freescale.training.export.exported_model import ARTIFACT, ExportedModel, Query, nested
from freescale.training.export.layout import (EVALUATION_FILE, FORMAT, ITEM_TABLE, ITEMS_FILE, MODEL_FILE, USER_FEATURES_FILE,
                                              USER_TABLE, WEIGHTS_FILE)
from freescale.training.model.recommender import ITEM_TABLE as CHECKPOINT_ITEM_TABLE, USER_TABLE as CHECKPOINT_USER_TABLE
from freescale.tracking.store import DISABLED, Tracking

ITEM_KEY = f"embedding_collection.embeddings.{CHECKPOINT_ITEM_TABLE}.weight"
USER_KEY = "user_embedding_collection.embedding_bags.{table}.weight"
MODEL_FOLDER = ARTIFACT
"""The folder's name inside the staging folder, and so the MLflow model's artifact (``artifacts/freescale_model``)."""
MLFLOW_FILE = "mlflow.json"
"""Written beside the folder's files once the model is logged: its URI, run and registered version."""
STAGING = re.compile(r"\.tmp-[0-9a-f]{12}$")
SUMMARY_PREFIXES = ("hr_at_", "ndcg_at_", "mrr", "valid_", "sampled_", "popular_", "eval_samples", "best_")


@dataclass
class Source:
    """A complete checkpoint step, read: its config, rank 0's own state and DCP's metadata."""

    folder: Path
    step: int
    config: TrainConfig
    own: dict[str, Any]
    metadata: Any

    @property
    def run_id(self) -> str | None:
        return (self.own.get("trainer", {}).get("sink") or {}).get("run_id")

    @property
    def weights(self) -> str:
        """``"best"`` when the trainer evaluated the best validation's weights (restored), else ``"last"``."""
        best = self.own.get("trainer", {}).get("validation", {}).get("best_epoch", 0)
        keeps = any(key.startswith("best_weights.") for key in self.metadata.state_dict_metadata)
        return "best" if keeps and best else "last"


def step_folder(path: Path) -> Path:
    """The complete step to export: ``path`` itself (a ``step_<n>``) or the newest complete one in it."""
    if STEP_DIR.match(path.name):
        if not (path / COMPLETE).exists():
            raise InputError(f"checkpoint {path} is half-written (no {COMPLETE}: its save was cut short); "
                             "export a complete step")
        return path
    checkpointer = Checkpointer(str(path), rank=0)
    step = checkpointer.latest_step()
    if step is None:
        half = checkpointer.half_written()
        raise InputError(f"{path} holds no complete checkpoint"
                         + (f" ({', '.join(p.name for p in half)} without {COMPLETE}: a save cut short)" if half
                            else " (no step_<n> folder)"))
    return checkpointer.step_dir(step)


def saved_config(folder: Path) -> TrainConfig:
    """The training config the checkpoint recorded, loaded as a config file is (one line when it no longer loads)."""
    path = folder / CONFIG
    if not path.is_file():
        raise InputError(f"checkpoint {folder} records no {CONFIG} (the training config): it cannot be exported")
    try:
        flat = moved_flat(json.loads(path.read_text()))
        config = TrainConfig()
        apply_table(config, nested(flat), str(path))
    except (ValueError, AttributeError) as exc:
        raise ConfigError(f"checkpoint {folder}'s saved config no longer loads: {exc}") from None
    return config


def open_checkpoint(path: str) -> Source:
    from freescale.training.checkpoint.safe_load import read_dcp_metadata, read_own_state

    folder = step_folder(Path(path))
    if not (folder / ".metadata").is_file():
        raise InputError(f"checkpoint {folder} has no DCP metadata (.metadata): it is damaged or half-written")
    config = saved_config(folder)
    own = read_own_state(folder / "rank_0.pt") if (folder / "rank_0.pt").is_file() else {}
    return Source(folder, int(folder.name[len("step_"):]), config, own, read_dcp_metadata(folder))


def load_weights(source: Source) -> dict[str, torch.Tensor]:
    """The exported weights, fp32, assembled from every rank's shards in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from freescale.training.checkpoint.safe_load import SafePlanner, SafeReader

    prefix = "best_weights." if source.weights == "best" else "model."
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in source.metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeReader(source.folder), planner=SafePlanner(source.folder),
                     no_dist=True)
    except CheckpointException as failed:  # a BaseException: a job's one line would miss it
        first = next(iter(failed.failures.values()))[0]
        raise (first if isinstance(first, InputError) else
               InputError(f"checkpoint {source.folder} cannot be read ({one_line(first).split('. ')[0][:160]}): "
                          "it is damaged; export another step")) from None
    return {key[len(prefix):]: value.float().contiguous() for key, value in state.items()}


def exported_state(weights: dict[str, torch.Tensor], features: int) -> dict[str, torch.Tensor]:
    """The checkpoint's model keys as the folder's: the item table, each user table, the dense rest."""
    if ITEM_KEY not in weights:
        raise InputError(f"the checkpoint holds no item table ({ITEM_KEY})")
    state = {ITEM_TABLE: weights.pop(ITEM_KEY)}
    for index in range(features):
        key = USER_KEY.format(table=CHECKPOINT_USER_TABLE.format(index=index))
        if key not in weights:
            raise InputError(f"the checkpoint holds no table for user feature {index} ({key})")
        state[USER_TABLE.format(index=index)] = weights.pop(key)
    return {**state, **weights}


@dataclass
class Vocabulary:
    prepared: Path
    raw_items: list[str | None]
    features: list[tuple[str, int]]
    feature_ids: dict[str, dict[str, int]]
    max_history: int
    counts: list[int | None] | None = None
    """Each dense id's interaction count in the prepared data (item_vocab's ``count``): the cold-start
    fallback's ranking (``freescale.training.export.exported_model.popularity``)."""


def prepared_folder(spec: ExportSpec, config: TrainConfig) -> Path:
    """``--prepared``, else the prepare output the training's shards were balanced from (their manifest's input)."""
    from freescale.runtime.paths import local_path
    from freescale.prepare.prepared import SEQUENCES_DIR, is_prepared

    if spec.prepared is not None:
        folder = Path(spec.prepared)
    else:
        manifest = Path(config.data.shards) / "manifest.json"
        if not manifest.is_file():
            raise InputError(f"the shards the checkpoint trained on ({config.data.shards}) are gone, and with them "
                             "the way to the item vocabulary: pass --prepared (the `freescale prepare` output)")
        uri = (json.loads(manifest.read_text()).get("input") or {}).get("uri") or ""
        local = local_path(uri)
        folder = Path(local) if local is not None else Path("")
        folder = folder.parent if folder.name == SEQUENCES_DIR else folder
        if local is None or not is_prepared(folder):
            raise InputError(f"the shards' input {uri or '(none recorded)'} is not a local `freescale prepare` "
                             "output: pass --prepared")
    if not is_prepared(folder):
        raise InputError(f"--prepared {folder} is not a `freescale prepare` output (no prepare.json)")
    return folder


def read_vocabulary(folder: Path, num_items: int, tables: list[int]) -> Vocabulary:
    """The item vocabulary (raw id of each dense id) and user feature vocabularies of a prepare output,
    checked against the checkpoint's tables (``tables``: each user table's rows)."""
    import pyarrow.parquet as pq

    from freescale.prepare.prepared import read_metadata

    vocab = pq.read_table(folder / "item_vocab").to_pydict()
    raw_items: list[str | None] = [None] * (num_items + 1)
    counts: list[int | None] = [None] * (num_items + 1)
    for row, (raw, index) in enumerate(zip(vocab["raw_item"], vocab["item_id"])):
        if not 1 <= index <= num_items or raw_items[index] is not None:
            raise InputError(f"{folder}/item_vocab does not fit the checkpoint's {num_items} items (id {index})")
        raw_items[index] = raw
        counts[index] = int(vocab["count"][row]) if "count" in vocab else None
    if len(vocab["item_id"]) != num_items:
        raise InputError(f"{folder}/item_vocab holds {len(vocab['item_id'])} items, the checkpoint's table "
                         f"{num_items}: another prepare output")
    meta = read_metadata(folder)
    features = [(f["name"], int(f["num_ids"])) for f in meta.get("user_features", [])]
    if [size for _, size in features] != tables:
        raise InputError(f"{folder}'s user features {features} do not fit the checkpoint's user tables "
                         f"(rows {tables}): another prepare output")
    feature_ids: dict[str, dict[str, int]] = {name: {} for name, _ in features}
    if features:
        rows = pq.read_table(folder / "user_feature_vocab", columns=["feature", "value", "id"]).to_pydict()
        for name, value, index in zip(rows["feature"], rows["value"], rows["id"]):
            feature_ids[name][value] = int(index)
    return Vocabulary(folder, raw_items, features, feature_ids, int(meta.get("max_seq_len", 1024)) + 1,
                      counts if "count" in vocab else None)


def user_table_rows(source: Source) -> list[int]:
    """Rows of each user feature table the checkpoint holds, in feature order."""
    sizes = []
    while (meta := source.metadata.state_dict_metadata.get(
            "model." + USER_KEY.format(table=CHECKPOINT_USER_TABLE.format(index=len(sizes))))) is not None:
        sizes.append(int(meta.size[0]))
    return sizes


def evaluation_protocol(config: TrainConfig, metrics: dict[str, float]) -> dict[str, Any]:
    """How the trainer evaluated (``freescale.training.eval.evaluator``), and what it measured when the run is known."""
    return {"k": 10, "query": "the encoder's output at the last position of the history; the test item's "
                              "history ends with the validation item",
            "candidates": "every item 1..num_items (full catalog); padding never ranked",
            "ties": "count against the target (a target's rank is the number of other items scoring >= it)",
            "history": "not excluded from the summary's full-catalog ranking (the unseen_* ranking, with "
                       "evaluation.unseen_ranking, excludes it); predict excludes it unless exclude_history=false",
            "score": "cosine of the query and the item's row (both L2-normalised)",
            "sampled_negatives": config.evaluation.sampled_negatives, "seed": config.training.seed,
            "eval_max_samples": config.training.eval_max_samples, "precision": config.training.precision,
            "metrics": metrics}


def write_folder(folder: Path, source: Source, vocab: Vocabulary, state: dict[str, torch.Tensor],
                 metrics: dict[str, float]) -> None:
    folder.mkdir(parents=True)
    num_items = state[ITEM_TABLE].shape[0] - 1
    torch.save(state, folder / WEIGHTS_FILE)
    config = source.config
    meta = {"format": FORMAT, "num_items": num_items, "max_history": vocab.max_history,
            "model": to_flat_dict(config.model), "precision": config.training.precision,
            "user_features": [{"name": name, "num_ids": size} for name, size in vocab.features],
            "source": {"checkpoint": str(source.folder.resolve()), "step": source.step, "weights": source.weights,
                       "mlflow_run_id": source.run_id, "shards": config.data.shards,
                       "prepared": str(vocab.prepared.resolve())}}
    (folder / MODEL_FILE).write_text(json.dumps(meta, indent=1, default=str) + "\n")
    items = {"raw_items": vocab.raw_items, **({"counts": vocab.counts} if vocab.counts else {})}
    (folder / ITEMS_FILE).write_text(json.dumps(items) + "\n")
    if vocab.features:
        (folder / USER_FEATURES_FILE).write_text(json.dumps(vocab.feature_ids) + "\n")
    (folder / EVALUATION_FILE).write_text(json.dumps(evaluation_protocol(config, metrics), indent=1) + "\n")
    # Loaded and queried once, as a user would: a folder that cannot serve is never put in place.
    ExportedModel(folder).recommend([Query(items=[vocab.raw_items[1]])], k=1)


@contextlib.contextmanager
def staged(output: str, overwrite: bool) -> Iterator[Path]:
    """A folder to write; on success it becomes ``output`` (an old one replaced only with ``overwrite``), on
    any failure it is removed. Staging folders a killed export left (``<output>.tmp-<hex>``) are removed."""
    target = Path(output)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f"{target.name}.tmp-*"):
        if STAGING.search(stale.name):
            shutil.rmtree(stale, ignore_errors=True)
    tag = uuid.uuid4().hex[:12]
    staging = target.parent / f"{target.name}.tmp-{tag}"
    staging.mkdir()
    try:
        yield staging / MODEL_FOLDER
        if target.exists() and not overwrite:
            raise InputError(f"output {output} already exists (pass --overwrite to replace it)")
        retired = target.parent / f"{target.name}.old-{tag}"
        if target.exists():
            target.rename(retired)
        (staging / MODEL_FOLDER).rename(target)
        shutil.rmtree(retired, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def run_metrics(uri: str, run_id: str | None) -> tuple[Any, dict[str, float]]:
    """The training's MLflow run in the store at ``uri`` (None when it holds none) and its summary's quality numbers."""
    if run_id is None or uri == DISABLED:
        return None, {}
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        run = MlflowClient(uri).get_run(run_id)
    except MlflowException:
        return None, {}
    return run, {k: v for k, v in sorted(run.data.metrics.items()) if k.startswith(SUMMARY_PREFIXES)}


def export(spec: ExportSpec, tracking: Tracking) -> int:
    """The job: ``spec``'s checkpoint to its folder and MLflow model; the arguments were checked
    (``freescale.training.export.spec.check_arguments``)."""
    from freescale.tracking.runs import job_run

    source = open_checkpoint(spec.checkpoint)
    vocab = read_vocabulary(prepared_folder(spec, source.config),
                            int(source.metadata.state_dict_metadata["model." + ITEM_KEY].size[0]) - 1,
                            user_table_rows(source))
    state = exported_state(load_weights(source), len(vocab.features))
    uri = tracking.reachable_uri("export")
    if spec.register is not None and uri == DISABLED:
        raise ServiceUnavailable(f"--register {spec.register}: MLflow at {tracking.uri or 'the default store'} "
                                 "cannot be used; nothing was written")
    training_run, metrics = run_metrics(uri, source.run_id)
    params = {**{k: v for k, v in asdict(spec).items() if k != "overwrite"}, "step": source.step,
              "weights": source.weights}
    tags = {"freescale.training_run": source.run_id} if source.run_id else {}
    with job_run("export", tracking_uri=uri, experiment=tracking.experiment, params=params, tags=tags,
                 output=spec.output) as run:
        with staged(spec.output, spec.overwrite) as folder:
            write_folder(folder, source, vocab, state, metrics)
            logged = None
            if spec.register is not None and not run.active:  # its warning line said why
                raise ServiceUnavailable(f"--register {spec.register}: MLflow at {uri} failed; nothing was written")
            if run.active:
                target = training_run.info.run_id if training_run is not None else run.run_id
                logged = log_model(folder, uri, target, spec.register)
                (folder / MLFLOW_FILE).write_text(json.dumps(logged, indent=1) + "\n")
                run.set_tags({"freescale.model_uri": logged["model_uri"]})
    print(summary_line(spec, source, vocab, logged, training_run is not None))
    return 0


def summary_line(spec: ExportSpec, source: Source, vocab: Vocabulary, logged: dict | None,
                 on_training_run: bool) -> str:
    model = source.config.model
    line = (f"freescale export: wrote {spec.output} ({model.encoder}, {len(vocab.raw_items) - 1} items, "
            f"{source.weights} weights of step {source.step}) from {source.folder}")
    if logged is None:
        return line + "; no MLflow model (tracking is off, or failed: its warning is above)"
    where = "the training's run" if on_training_run else "this export's run (the training's run is not in this store)"
    line += f"; MLflow model {logged['model_uri']} on {where} {logged['run_id']}"
    if logged.get("registered_version"):
        line += f"; registered {logged['registered_name']} version {logged['registered_version']}"
    return line


@contextlib.contextmanager
def tracking_at(uri: str) -> Iterator[None]:
    """mlflow's fluent API (``log_model``) pointed at ``uri`` for the block; its URI, and
    MLFLOW_TRACKING_URI, as they were afterwards."""
    import os

    import mlflow
    from mlflow.tracking._tracking_service import utils

    previous, environment = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)
        if environment is not None:
            os.environ["MLFLOW_TRACKING_URI"] = environment


def requirements() -> list[str]:
    """What loading the model needs: torch and this project (its wheel: `make dist`), mlflow, pandas."""
    from importlib.metadata import PackageNotFoundError, version

    import mlflow

    found = [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "pandas", "numpy"]
    try:
        found.append(f"freescale=={version('freescale')}")
    except PackageNotFoundError:
        pass
    return found


def pyfunc_arguments(folder: Path) -> dict[str, Any]:
    """What ``mlflow.pyfunc.log_model`` (or ``save_model``) takes for the folder: the code, the artifact, the
    signature and input example (``freescale.training.export.signature``), the requirements."""
    from freescale.training.export.signature import input_example, signature

    model = ExportedModel(folder)
    return {"python_model": importlib.util.find_spec("freescale.model_pyfunc").origin,  # found, not imported
            "artifacts": {MODEL_FOLDER: str(folder)},
            "signature": signature([name for name, _ in model.user_features]),
            "input_example": input_example(model), "pip_requirements": requirements()}


def log_model(folder: Path, uri: str, run_id: str, register: str | None) -> dict[str, Any]:
    """Log ``folder`` as an MLflow pyfunc model (its code ``freescale/model_pyfunc.py``) on run ``run_id``,
    which ends in the status it had; registered as ``register`` (a new version) when given."""
    import mlflow
    from mlflow.tracking import MlflowClient

    status = MlflowClient(uri).get_run(run_id).info.status
    # mlflow's chatter (its check of the input example, progress bars, "Created version 2") is
    # dropped: the job's last line says what was logged and registered.
    with tracking_at(uri), warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), quiet_mlflow():
        warnings.simplefilter("ignore")
        mlflow.start_run(run_id=run_id)
        try:
            info = mlflow.pyfunc.log_model(name="model", registered_model_name=register, **pyfunc_arguments(folder))
        finally:
            mlflow.end_run(status=status)
    return {"model_uri": info.model_uri, "model_id": info.model_id, "run_id": run_id,
            "registered_name": register,
            "registered_version": None if register is None else int(info.registered_model_version)}


@contextlib.contextmanager
def quiet_mlflow() -> Iterator[None]:
    """mlflow's own loggers at ERROR for the block: they write to the stderr they found at import (not
    redirect_stderr's), e.g. "Validating input example against model signature"."""
    import logging

    logger = logging.getLogger("mlflow")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
