"""The recommend job's Spark side: an exported model and a `freescale prepare` output -> every user's top k.

    source = resolve_model(spec.model, tracking_uri, scratch)      # the export folder, on the driver
    frame = recommendations(spark, sequences, source, k, exclude)  # user_id, items, scores

The model is scored as MLflow's batch scoring does on Spark (``mlflow.pyfunc.spark_udf``): its folder is
shipped to the executors as an archive (``SparkContext.addArchive``) and loaded once per Python worker (Spark reuses
its workers: one load per executor core), and ``mapInArrow`` hands it the users a batch at a time (an
Arrow record batch, ``spark.sql.execution.arrow.maxRecordsPerBatch`` users: 10,000 by default).
What is scored is the model's own ``ExportedModel.rank``, the pyfunc's ``predict`` without the raw-id
lookups: the input was prepared with the model's vocabulary (``check_vocabulary``), so its dense ids
are the model's. A user's history is the whole prepared sequence -- the training items, then the
validation and test items -- with its timestamps, ratings and user feature ids, built for a whole batch at
once with Arrow and NumPy (``history_batch``), and the recommendations go back as Arrow arrays
(``recommendation_batch``): no Python object per user or item.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from freescale.runtime.errors import InputError

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

    from freescale.training.export.exported_model import ExportedModel, HistoryBatch

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
    return sequences.select(*columns).mapInArrow(scorer(name, k, exclude), OUTPUT_SCHEMA)


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


def scorer(name: str, k: int, exclude: bool) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function: each batch of sequences to its users' recommendations."""
    def score(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa

        model = loaded(name)
        raw_items = pa.array(model.raw_items, pa.string())
        for batch in batches:
            scores, ids = model.top(history_batch(batch, model.max_history), k, exclude)
            yield recommendation_batch(batch.column("user_id"), scores, ids, raw_items)
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


def history_batch(batch: pa.RecordBatch, max_history: int) -> HistoryBatch:
    """Each row's whole sequence (training items, then the validation and test items) as the model reads it:
    the list columns flattened, the two targets placed after each row's items by offset."""
    import numpy as np

    from freescale.training.export.exported_model import HistoryBatch, offsets_of

    lengths = _lengths(batch.column("items"))
    for name in ("timestamps", "ratings"):
        if not np.array_equal(_lengths(batch.column(name)), lengths):
            raise InputError(f"the input's {name} and items differ in length: not a `freescale prepare` output")
    full = lengths + 2
    offsets = offsets_of(full)
    # Row b's list values go to offsets[b]..: past the 2 targets of each row before it.
    listed = np.arange(offsets[-1] - 2 * len(lengths)) + np.repeat(2 * np.arange(len(lengths)), lengths)

    def sequence(name: str, valid: np.ndarray, test: np.ndarray | int, read=_ints) -> np.ndarray:
        values = np.empty(offsets[-1], np.int64)
        values[listed] = read(batch.column(name).flatten())
        values[offsets[1:] - 2], values[offsets[1:] - 1] = valid, test
        return values

    ids = sequence("items", _ints(batch.column("valid_item")), _ints(batch.column("test_item")))
    times = sequence("timestamps", _ints(batch.column("valid_timestamp")), _ints(batch.column("test_timestamp")))
    ratings = sequence("ratings", _ratings(batch.column("valid_rating")), 0, _ratings)  # the test's is not kept
    recent = np.repeat(offsets[1:], full) - np.arange(offsets[-1]) <= max_history
    return HistoryBatch(ids[recent], times[recent], ratings[recent], offsets_of(np.minimum(full, max_history)), ids,
                        offsets, _features(batch))


def _lengths(column: pa.Array) -> np.ndarray:
    """A list column's lengths (a null list: 0)."""
    import numpy as np

    return np.asarray(column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False), np.int64)


def _ints(values: pa.Array) -> np.ndarray:
    import numpy as np

    return np.array(values.to_numpy(zero_copy_only=False), np.int64)  # a copy: torch wants writable arrays


def _ratings(values: pa.Array) -> np.ndarray:
    """Prepared ratings (floats, null when unknown) as the model reads them: 0 unknown, else truncated."""
    import numpy as np

    return np.nan_to_num(values.to_numpy(zero_copy_only=False).astype(np.float64), nan=0.0).astype(np.int64)


def _features(batch: pa.RecordBatch) -> np.ndarray:
    """``[B, F]`` user feature ids (``F`` 0 without the column)."""
    import numpy as np

    if "user_features" not in batch.schema.names:
        return np.zeros((batch.num_rows, 0), np.int64)
    column = batch.column("user_features")
    lengths = _lengths(column)
    if len(set(lengths.tolist())) > 1:
        raise InputError("the input's user_features differ in length: not a `freescale prepare` output")
    return _ints(column.flatten()).reshape(batch.num_rows, int(lengths[0]) if len(lengths) else 0)


def recommendation_batch(users: pa.Array, scores: np.ndarray, ids: np.ndarray, raw_items: pa.Array) -> pa.RecordBatch:
    """The output's rows (``OUTPUT_SCHEMA``) from ``ExportedModel.top``'s arrays: a row keeps its finite scores
    (all k, unless fewer items were left to rank); ``raw_items``: the raw id of every dense id."""
    import numpy as np
    import pyarrow as pa

    from freescale.training.export.exported_model import offsets_of

    kept = np.isfinite(scores)
    offsets = pa.array(offsets_of(kept.sum(axis=1)).astype(np.int32))
    items = pa.ListArray.from_arrays(offsets, raw_items.take(pa.array(ids[kept])))
    values = pa.ListArray.from_arrays(offsets, pa.array(scores[kept], pa.float32()))
    return pa.RecordBatch.from_arrays([users.cast(pa.string()), items, values], names=["user_id", "items", "scores"])
