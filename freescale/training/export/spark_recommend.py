"""The recommend job's Spark side: an exported model and a `freescale prepare` output -> every user's top k.

    source = resolve_model(spec.model, tracking_uri, scratch)      # the export folder, on the driver
    frame = recommendations(spark, sequences, source, k, exclude)  # user_id, items, scores

The model is scored as MLflow's batch scoring does on Spark (``mlflow.pyfunc.spark_udf``): its folder is
shipped to the executors as an archive (``SparkContext.addArchive``) and loaded once per Python worker (Spark reuses
its workers: one load per executor core), and ``mapInPandas`` hands it the users a batch at a time.
What is scored is the model's own ``ExportedModel.rank``, the pyfunc's ``predict`` without the raw-id
lookups: the input was prepared with the model's vocabulary (``check_vocabulary``), so its dense ids
are the model's. A user's history is the whole prepared sequence -- the training items, then the
validation and test items -- with its timestamps, ratings and user feature ids.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from freescale.runtime.errors import InputError

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame, SparkSession

    from freescale.training.export.exported_model import ExportedModel, History

OUTPUT_SCHEMA = "user_id string, items array<string>, scores array<float>"
SEQUENCE_COLUMNS = ("user_id", "items", "timestamps", "ratings", "valid_item", "valid_timestamp", "valid_rating",
                    "test_item", "test_timestamp")


@dataclass(frozen=True)
class ModelSource:
    """The exported model a run scores with: its local export folder, what the user named (a path or an
    MLflow model URI), and the pyfunc's default for ``exclude_history``."""

    folder: Path
    uri: str
    exclude_default: bool = True


def resolve_model(model: str, tracking_uri: str, scratch: Path) -> ModelSource:
    """``--model`` as a local export folder: the folder itself, an MLflow model folder's artifact, or a
    models:/ or runs:/ URI's, downloaded into ``scratch`` from the tracking store."""
    from freescale.runtime.paths import local_path
    from freescale.tracking.store import DISABLED
    from freescale.training.export.recommend_spec import MODEL_URI_SCHEMES

    if model.startswith(MODEL_URI_SCHEMES):
        if tracking_uri == DISABLED:
            raise InputError(f"--model {model}: a model URI needs MLflow tracking, and --tracking-uri is none")
        return mlflow_model(Path(download(model, tracking_uri, scratch)), model)
    folder = Path(local_path(model) or model)
    if (folder / "MLmodel").is_file():
        return mlflow_model(folder, model)
    from freescale.training.export.exported_model import MODEL_FILE

    if not (folder / MODEL_FILE).is_file():
        raise InputError(f"--model {model}: neither a `freescale export` folder (no {MODEL_FILE}) nor an MLflow model "
                         "(no MLmodel)")
    return ModelSource(folder, str(folder))


def download(uri: str, tracking_uri: str, scratch: Path) -> str:
    """An MLflow model URI's files, downloaded; one line when the store does not hold it."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from freescale.training.export.exporter import quiet_mlflow, tracking_at

    try:
        with tracking_at(tracking_uri), quiet_mlflow():
            return mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(scratch))
    except MlflowException as missing:
        raise InputError(f"--model {uri}: MLflow at {tracking_uri} has no such model ({missing.message[:200]})") \
            from None


def mlflow_model(folder: Path, uri: str) -> ModelSource:
    """An MLflow model folder of `freescale export`: its artifact and the signature's ``exclude_history`` default."""
    from mlflow.models import Model

    from freescale.training.export.exported_model import ARTIFACT

    model = Model.load(str(folder))
    # Where log_model put the artifact (artifacts/<the folder's name>), as the pyfunc flavor records it.
    artifacts = model.flavors.get("python_function", {}).get("artifacts", {})
    artifact = folder / (artifacts.get(ARTIFACT) or {}).get("path", f"artifacts/{ARTIFACT}")
    if not artifact.is_dir():
        raise InputError(f"--model {uri}: an MLflow model, but not a `freescale export` (no {ARTIFACT} artifact)")
    params = model.get_params_schema()
    defaults = {param.name: param.default for param in (params.params if params else [])}
    return ModelSource(artifact, uri, bool(defaults.get("exclude_history", True)))


def check_vocabulary(source: ModelSource, vocab: dict[int, str], features: list[tuple[str, int]],
                     input_name: str) -> None:
    """The input holds the model's items under the model's ids (``vocab``: the input's item_vocab, id -> raw
    id) and its user features with their sizes; else one line: it was prepared from other data."""
    from freescale.training.export.exported_model import ITEMS_FILE, MODEL_FILE

    raw_items = json.loads((source.folder / ITEMS_FILE).read_text())["raw_items"]
    meta = json.loads((source.folder / MODEL_FILE).read_text())
    differs = next((i for i in range(1, len(raw_items)) if vocab.get(i) != raw_items[i]), None)
    if len(vocab) != len(raw_items) - 1 or differs is not None:
        where = "" if differs is None else f"; item id {differs} is {raw_items[differs]!r} there, {vocab.get(differs)!r} here"
        raise InputError(f"--model {source.uri} was exported with another item vocabulary than --input {input_name} "
                         f"({len(raw_items) - 1} items there, {len(vocab)} here{where}): score the prepare output "
                         "the model was trained on")
    wanted = [(f["name"], int(f["num_ids"])) for f in meta.get("user_features", [])]
    if wanted != features:
        raise InputError(f"--model {source.uri} takes user features {wanted}, --input {input_name} has {features}: "
                         "score the prepare output the model was trained on")


def recommendations(spark: SparkSession, sequences: DataFrame, source: ModelSource, k: int, exclude: bool,
                    scratch: Path) -> DataFrame:
    """``user_id, items, scores`` of every row of ``sequences`` (a prepare output's), by the model of ``source``
    (shipped from ``scratch``, which must outlive the frame's actions)."""
    name = ship(spark, source.folder, scratch)
    columns = [*SEQUENCE_COLUMNS, *(["user_features"] if "user_features" in sequences.columns else [])]
    return sequences.select(*columns).mapInPandas(scorer(name, k, exclude), OUTPUT_SCHEMA)


def ship(spark: SparkSession, folder: Path, scratch: Path) -> str:
    """The folder, as an archive of its own name, sent to every executor and unpacked there
    (``SparkContext.addArchive``: a folder itself can be added on local masters only); the name under
    which ``SparkFiles.get`` finds it. A name is registered once per SparkContext: each run ships its own."""
    import zipfile

    archive = scratch / f"freescale-model-{uuid.uuid4().hex[:12]}.zip"
    # Stored, not deflated: the weights do not compress, and every executor unpacks the archive once.
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as packed:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            packed.write(path, path.relative_to(folder).as_posix())
    spark.sparkContext.addArchive(str(archive))
    return archive.name


def scorer(name: str, k: int, exclude: bool) -> Callable[[Iterator[pd.DataFrame]], Iterator[pd.DataFrame]]:
    """The ``mapInPandas`` function: each batch of sequences to its users' recommendations."""
    def score(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        import pandas as pd

        model = loaded(name)
        for batch in batches:
            found = model.rank(histories(batch, model.max_history), k, exclude)
            yield pd.DataFrame({"user_id": batch["user_id"].astype(str), "items": [r.items for r in found],
                                "scores": [r.scores for r in found]})
    return score


_LOADED: dict[str, Any] = {}
"""The models this Python worker loaded, by shipped name: one load per worker, however many tasks it runs."""


def loaded(name: str) -> ExportedModel:
    if name not in _LOADED:
        import torch
        from pyspark import SparkFiles

        from freescale.training.export.exported_model import ExportedModel

        torch.set_num_threads(1)  # a worker per executor core: intra-op threads would only contend
        _LOADED[name] = ExportedModel(SparkFiles.get(name))
    return _LOADED[name]


def histories(batch: pd.DataFrame, max_history: int) -> list[History]:
    """Each row's whole sequence (training items, then the validation and test items) as the model reads it."""
    from freescale.training.export.exported_model import History

    found = []
    features = batch["user_features"] if "user_features" in batch.columns else None
    for row, record in enumerate(batch.itertuples(index=False)):
        ids = [*record.items, record.valid_item, record.test_item]
        times = [*record.timestamps, record.valid_timestamp, record.test_timestamp]
        ratings = [*record.ratings, record.valid_rating, None]  # the test item's rating is not kept
        events = [(int(i), int(t), _rating(r)) for i, t, r in zip(ids, times, ratings)]
        found.append(History.of(events, max_history, 0, [] if features is None else [int(f) for f in features[row]]))
    return found


def _rating(value: Any) -> int:
    """A prepared rating (a float, null when unknown) as the model reads one: 0 unknown."""
    return 0 if value is None or value != value else int(value)
