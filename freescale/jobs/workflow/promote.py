"""The promote stage of an incremental `freescale pipeline` (freescale/jobs/workflow/days.py): the day's
exported model, registered by its export, against the version the registered model's alias points at,
both scored the same way on the day's held-out targets; the alias moves only when the new version is
not worse.

Held-out data: each user the day's logs touched has their newest event held out (prepare's
leave-one-out ``test_item``); the history is everything before it (``items`` and ``valid_item``), in
raw item ids, so each model reads it through its own vocabulary (yesterday's champion skips the
items it never saw). Both are ranked over their full catalog with the history left out, as the
trainer's unseen ranking does; HR@10 and NDCG@10 are the shares of users whose target is in the top
10 and its discounted gain. User features are not given to either model (unknown ids), the same for
both.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freescale.runtime.errors import InputError
from freescale.runtime.json_files import read_json, write_json

K = 10
MODEL_DIR_TAG, DAY_TAG = "freescale.model_dir", "freescale.day"


@dataclass(frozen=True)
class HeldOut:
    """Histories (raw ids, oldest first, with their times and ratings) and each one's held-out target."""

    items: list[list[str]]
    timestamps: list[list[int]]
    ratings: list[list[int]]
    targets: list[str]


def held_out(prepared: Path, max_users: int) -> HeldOut:
    """The held-out targets of a prepare output's users, the first ``max_users`` by user id (0: all)."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from freescale.prepare.prepared import sequences_path

    columns = ["user_id", "items", "timestamps", "ratings", "valid_item", "valid_timestamp", "valid_rating",
               "test_item"]
    table = pq.read_table(sequences_path(prepared), columns=columns)
    table = table.take(pc.sort_indices(table, [("user_id", "ascending")]))
    if max_users:
        table = table.slice(0, max_users)
    vocab = pq.read_table(prepared / "item_vocab", columns=["raw_item", "item_id"])
    raw = np.empty(int(pc.max(vocab["item_id"]).as_py() or 0) + 1, dtype=object)
    raw[vocab["item_id"].to_numpy()] = vocab["raw_item"].to_numpy(zero_copy_only=False)
    rows = table.to_pylist()

    def rating(value: Any) -> int:
        return 0 if value is None or (isinstance(value, float) and math.isnan(value)) else int(value)

    return HeldOut([[raw[i] for i in r["items"]] + [raw[r["valid_item"]]] for r in rows],
                   [[int(t) for t in r["timestamps"]] + [int(r["valid_timestamp"])] for r in rows],
                   [[rating(x) for x in r["ratings"]] + [rating(r["valid_rating"])] for r in rows],
                   [raw[r["test_item"]] for r in rows])


def ranking_metrics(model_dir: Path, data: HeldOut) -> dict[str, float]:
    """HR@10 and NDCG@10 of an exported model on held-out targets (full catalog, history left out)."""
    from freescale.training.export.exported_model import ExportedModel, Query

    model = ExportedModel(model_dir)
    queries = [Query(i, t, r) for i, t, r in zip(data.items, data.timestamps, data.ratings)]
    hits = gains = 0.0
    for found, target in zip(model.recommend(queries, K, exclude_history=True), data.targets):
        if target in found.items:
            position = found.items.index(target)
            hits += 1.0
            gains += 1.0 / math.log2(position + 2)
    users = max(len(data.targets), 1)
    return {"hr_at_10": hits / users, "ndcg_at_10": gains / users, "users": float(len(data.targets))}


def champion_folder(client, name: str, version: Any, scratch: Path) -> Path:
    """The exported-model folder of a registered version: where the pipeline left it (its tag), else
    downloaded from the registry."""
    import mlflow

    from freescale.training.export.exported_model import ARTIFACT

    local = (version.tags or {}).get(MODEL_DIR_TAG)
    if local and (Path(local) / "model.json").is_file():
        return Path(local)
    scratch.mkdir(parents=True, exist_ok=True)
    downloaded = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version.version}",
                                                          dst_path=str(scratch), tracking_uri=client.tracking_uri))
    found = sorted(downloaded.rglob(f"{ARTIFACT}/model.json"))
    if not found:
        raise InputError(f"registered model {name} version {version.version}: no {ARTIFACT} folder in its artifacts")
    return found[0].parent


def promote(*, model: Path, prepared: Path, uri: str, alias: str, metric: str, max_users: int, day: str,
            output: Path) -> dict[str, Any]:
    """Compare the day's registered version with the alias's, move the alias when it is not worse, write
    ``output`` (promotion.json) and return what it holds."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    logged = read_json(model / "mlflow.json", "the export's MLflow record")
    name, version = logged.get("registered_name"), logged.get("registered_version")
    if not name or version is None:
        raise InputError(f"{model}: the model was not registered: incremental mode needs [export] register = NAME")
    client = MlflowClient(uri)
    data = held_out(prepared, max_users)
    new = ranking_metrics(model, data)
    client.set_model_version_tag(name, str(version), MODEL_DIR_TAG, str(model.resolve()))
    client.set_model_version_tag(name, str(version), DAY_TAG, day)
    try:
        current = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        current = None
    old = None
    if current is not None and int(current.version) != int(version):
        old = ranking_metrics(champion_folder(client, name, current, output.parent / "champion"), data)
    moved = current is None or (old is not None and new[metric] >= old[metric])
    if moved:
        client.set_registered_model_alias(name, alias, str(version))
    result = {"day": day, "registered_name": name, "version": int(version), "alias": alias, "metric": metric,
              "held_out_users": int(new["users"]), "new": new,
              "champion": None if current is None else {"version": int(current.version), **(old or new)},
              "alias_moved": moved, "alias_points_at": int(version) if moved or old is None else int(current.version)}
    write_json(output, result)
    return result


def report(result: dict[str, Any]) -> str:
    """The stage's line."""
    metric, new, champion = result["metric"], result["new"], result["champion"]
    versus = ("no earlier version" if champion is None else
              f"version {champion['version']} {metric} {champion[metric]:.4f}")
    return (f"freescale promote: {result['registered_name']} version {result['version']} {metric} {new[metric]:.4f} "
            f"vs {versus} on {result['held_out_users']} held-out users of day {result['day']}: alias "
            f"{result['alias']} -> version {result['alias_points_at']}"
            + ("" if result["alias_moved"] else " (kept: the new version is worse)"))


def run(values: dict[str, Any], tracking) -> int:
    """The stage's job: promote with ``values`` (model, prepared, alias, metric, max_users, output), recorded as
    its own MLflow run. The day is the name of the day's working directory, the output's folder."""
    from freescale.tracking.runs import job_run

    uri = tracking.resolved_uri()
    values = {**values, "day": Path(values["output"]).parent.name}
    with job_run("promote", tracking_uri=uri, experiment=tracking.experiment,
                 params={k: values[k] for k in ("alias", "metric", "max_users", "day")},
                 run_name=f"promote {values['day']}") as job:
        result = promote(model=Path(values["model"]), prepared=Path(values["prepared"]), uri=uri,
                         alias=values["alias"], metric=values["metric"], max_users=values["max_users"],
                         day=values["day"], output=Path(values["output"]))
        job.log_metrics({f"new_{k}": v for k, v in result["new"].items()}
                        | ({f"champion_{k}": v for k, v in result["champion"].items()} if result["champion"] else {})
                        | {"alias_moved": float(result["alias_moved"])})
    print(report(result), file=sys.stdout, flush=True)
    return 0
