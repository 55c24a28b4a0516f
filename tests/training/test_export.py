"""`freescale export` (freescale/jobs/export.py, freescale/training/export/exporter.py, freescale/training/export/exported_model.py): a training
checkpoint -> one model folder and an MLflow pyfunc model.

The end-to-end tests share the session's row_run (tests/scenarios.py: a short 2-rank training with
checkpoints, recorded on the session's mlflow server) and one export of it. A fresh process loads
the MLflow model and predicts every test user's top 10 with no TorchRec imported: they are the
trainer's own evaluation ranking (its model rebuilt here with TorchRec tables from the same
checkpoint, scored by freescale.training.eval.evaluator), and HR@10 and NDCG@10 computed from them
are the run's summary. The fast tests build a model folder from
a random dense model: the unknown-id policy, the input forms, the registry and bad-input refusals.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import helpers
from tests.scenarios import STEPS

REGISTERED = "freescale-export-test"


def export(*argv: str) -> int:
    from freescale.jobs import cli

    return cli.main(["export", *argv])


def nothing_beside(output: Path) -> list[str]:
    """What exists at the output or beside it under its name (a staging folder left behind)."""
    return sorted(p.name for p in output.parent.glob(f"{output.name}*"))


# ------------------------------------------------------------------ a model folder without a training


def small_folder(root: Path, num_items: int = 30, counts: list[int] | None = None) -> tuple[Path, list[str]]:
    """An export folder of a random one-layer HSTU over ``num_items`` items whose raw ids are ``i<n>`` (with
    ``counts``: each item's interaction count, index 0 padding)."""
    import torch

    from freescale.training.config import TrainConfig
    from freescale.training.export.exporter import Source, Vocabulary, write_folder
    from freescale.training.export.exported_model import ITEM_TABLE
    from freescale.training.model.recommender import build_dense_model

    torch.manual_seed(0)
    config = TrainConfig()
    config.model.hstu.num_layers = 1
    model, table = build_dense_model(num_items, config.model)
    state = {ITEM_TABLE: table.table.weight.detach().clone(), **model.state_dict()}
    raw = [None] + [f"i{n}" for n in range(1, num_items + 1)]
    source = Source(root / "ckpt" / "step_1", 1, config, {}, SimpleNamespace(state_dict_metadata={}))
    vocab = Vocabulary(root, raw, [], {}, max_history=8, counts=counts)
    write_folder(root / "model", source, vocab, state, {})
    return root / "model", raw


def test_unknown_items_are_skipped_and_counted(tmp_path):
    import pandas as pd

    from freescale.training.export.exported_model import ExportedModel

    folder, raw = small_folder(tmp_path)
    model = ExportedModel(folder)
    known = model.predict([["i3", "i7", "i2"]], k=5)
    mixed = model.predict(pd.DataFrame({"items": [["nope", "i3", "i7", 99, "i2"], ["gone"], []]}), k=5)
    assert list(mixed.columns) == ["items", "scores", "unknown_items", "fallback"]
    assert mixed["unknown_items"].tolist() == [2, 1, 0] and mixed["fallback"].tolist() == [False, True, True]
    assert mixed["items"][0] == known["items"][0] and mixed["scores"][0] == known["scores"][0]
    # no known item: the most popular (no counts recorded: by dense id, prepare's popularity order)
    assert mixed["items"][1] == mixed["items"][2] == raw[1:6] and mixed["scores"][1] == [0.0] * 5
    assert len(known["items"][0]) == 5 and known["scores"][0] == sorted(known["scores"][0], reverse=True)


def test_the_history_is_excluded_unless_asked_and_ids_may_be_integers(tmp_path):
    from freescale.training.export.exported_model import ExportedModel

    folder, raw = small_folder(tmp_path)
    model = ExportedModel(folder)
    history = [f"i{n}" for n in range(1, 26)]
    excluded = model.predict([history], k=10)["items"][0]
    assert len(excluded) == 5 and not set(excluded) & set(history)  # 30 items, 25 seen: 5 left
    everything = model.predict([history], k=30, exclude_history=False)["items"][0]
    assert sorted(everything, key=lambda r: int(r[1:])) == raw[1:]
    assert [r for r in everything if r not in history] == excluded  # the same order, the seen ones removed
    # prepare's string form of an integer id is its digits: 7 and 7.0 look up "7"
    from freescale.training.export.exported_model import raw_key
    assert raw_key(7) == raw_key(7.0) == raw_key("7") == "7"


def test_only_the_most_recent_history_counts_and_bad_rows_are_one_line(tmp_path):
    import pandas as pd

    from freescale.runtime.errors import InputError
    from freescale.training.export.exported_model import ExportedModel

    folder, _ = small_folder(tmp_path)
    model = ExportedModel(folder)  # max_history 8
    long = [f"i{n}" for n in range(1, 21)]
    assert (model.predict([long], exclude_history=False)["scores"][0]
            == model.predict([long[-8:]], exclude_history=False)["scores"][0])
    with pytest.raises(InputError, match=r"^row 0: 2 timestamps for 3 items$"):
        model.predict(pd.DataFrame({"items": [["i1", "i2", "i3"]], "timestamps": [[1, 2]]}))
    with pytest.raises(InputError, match="no 'items' column"):
        model.predict(pd.DataFrame({"history": [["i1"]]}))
    with pytest.raises(InputError, match="k must be a positive integer"):
        model.predict([["i1"]], k=0)


def test_the_best_validations_weights_are_exported_when_the_run_restored_them(tmp_path):
    """The trainer tests the best validation's weights when it kept them (restored after its last
    checkpoint, which holds them beside the last step's): so does the export. A checkpoint written by DCP
    in this one process, as the trainer's ranks lay it out."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from freescale.training.config import TrainConfig
    from freescale.training.export.exporter import ITEM_KEY, Source, load_weights
    from freescale.training.checkpoint.safe_load import read_dcp_metadata

    last = {"model." + ITEM_KEY: torch.zeros(4, 2), "model.encoder.w": torch.zeros(3)}
    best = {key.replace("model.", "best_weights.", 1): torch.ones_like(value) for key, value in last.items()}
    step = tmp_path / "step_2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**last, **best}, checkpoint_id=str(step), no_dist=True)
    source = Source(step, 2, TrainConfig(), {"trainer": {"validation": {"best_epoch": 1}}}, read_dcp_metadata(step))
    assert source.weights == "best" and float(load_weights(source)[ITEM_KEY].sum()) == 8
    source.own["trainer"]["validation"]["best_epoch"] = 0  # no validation chose them: the model's
    assert source.weights == "last" and float(load_weights(source)[ITEM_KEY].sum()) == 0
    assert sorted(load_weights(source)) == [ITEM_KEY, "encoder.w"]


@pytest.mark.parametrize("uri", ["file:/tmp/mlruns", "mlruns", "/abs/mlruns", "none"])
def test_register_without_a_registry_is_refused_before_anything_is_written(fresh_log, tmp_path, capsys, uri):
    (tmp_path / "ckpt").mkdir()
    out = tmp_path / "model"
    assert export("--checkpoint", str(tmp_path / "ckpt"), "--output", str(out), "--register", "m",
                  "--tracking-uri", uri) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("freescale export: error: --register") and (uri == "none" or "no model registry" in line)
    assert nothing_beside(out) == [] and not (tmp_path / "mlruns").exists()


def test_the_registry_check_accepts_databases_and_servers():
    from freescale.training.export.spec import check_registry

    for uri in ("sqlite:///mlflow.db", "http://127.0.0.1:5000", "postgresql://db/mlflow"):
        check_registry(uri)


def half_written(root: Path) -> dict[str, tuple[Path, str]]:
    """Checkpoint folders an export must refuse, with the error each gives."""
    no_marker = root / "a" / "step_3"
    no_marker.mkdir(parents=True)
    (no_marker / ".metadata").write_bytes(b"")
    no_metadata = root / "b" / "step_5"
    no_metadata.mkdir(parents=True)
    (no_metadata / "COMPLETE").write_text("5\n")
    return {"step without COMPLETE": (no_marker, f"checkpoint {no_marker} is half-written (no COMPLETE"),
            "folder of half-written steps": (root / "a", f"{root / 'a'} holds no complete checkpoint (step_3 "
                                                         "without COMPLETE"),
            "COMPLETE without DCP metadata": (root / "b", f"checkpoint {no_metadata} has no DCP metadata"),
            "no step at all": (root / "c", f"{root / 'c'} holds no complete checkpoint (no step_<n> folder)")}


@pytest.mark.parametrize("case", ["step without COMPLETE", "folder of half-written steps",
                                  "COMPLETE without DCP metadata", "no step at all"])
def test_a_half_written_checkpoint_is_refused(fresh_log, tmp_path, capsys, case):
    (tmp_path / "c").mkdir()
    checkpoint, message = half_written(tmp_path)[case]
    out = tmp_path / "model"
    assert export("--checkpoint", str(checkpoint), "--output", str(out), "--tracking-uri", "none") == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"freescale export: error: {message}"), line
    assert nothing_beside(out) == []


# ------------------------------------------------------------------ a real training, exported


@pytest.fixture(scope="module")
def trained(row_run, movielens_shards, tmp_path_factory):
    """The session's row_run (tests/scenarios.py): 8 steps on 2 ranks, checkpoints at steps 4 and 8,
    evaluated on every user, recorded on the session's server. Exports go to a folder of this module's."""
    return SimpleNamespace(root=tmp_path_factory.mktemp("export"), checkpoint=row_run.folder, shards=movielens_shards,
                           uri=row_run.uri, summary=row_run.log)


@pytest.fixture(scope="module")
def exported(trained):
    """The checkpoint folder exported once (its newest step, 8), the model logged on the training's run."""
    out = trained.root / "model"
    assert export("--checkpoint", str(trained.checkpoint), "--output", str(out), "--tracking-uri", trained.uri,
                  "--experiment", "export-e2e") == 0
    return SimpleNamespace(folder=out, mlflow=json.loads((out / "mlflow.json").read_text()))


def reference(trained, prepared: Path, users_table: Path):
    """Every shard user's test query as raw ids (with timestamps, ratings and raw user features), and the
    trainer's evaluation of it: its top 10 over the whole catalog, its top 10 without the history, and the
    evaluator's metric sums both ways -- from the checkpoint loaded into the TorchRec model."""
    import warnings

    import pandas as pd
    import pyarrow.parquet as pq
    import torch
    import torch.distributed.checkpoint as dcp

    from freescale.shards.manifest import load_manifest
    from freescale.training.eval.evaluator import evaluate_batch, history_of, score_queries
    from freescale.training.export.exporter import saved_config
    from freescale.training.ops.jagged import jagged_concat_last
    from freescale.training.model.recommender import build_local_model
    from freescale.training.eval.ranking_metrics import RetrievalMetrics
    from freescale.training.checkpoint.safe_load import SafePlanner, SafeReader
    from freescale.training.data.shard_reader import build_loader

    step = trained.checkpoint / f"step_{STEPS}"
    config = saved_config(step)
    manifest = load_manifest(str(trained.shards), 2, 0)
    model = build_local_model(manifest.num_items, config.model, precision=config.training.precision,
                              user_features=[(f.name, f.num_ids) for f in manifest.user_features])
    state = {f"model.{key}": value for key, value in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeReader(step), planner=SafePlanner(step), no_dist=True)
    model.load_state_dict({key[len("model."):]: value for key, value in state.items()})
    model.eval()
    vocab = pq.read_table(prepared / "item_vocab").to_pydict()
    raw = dict(zip(vocab["item_id"], vocab["raw_item"]))
    users = pd.read_parquet(users_table).set_index("user_id")
    rows, full, unseen = [], [], []
    sums = {"full": RetrievalMetrics(), "unseen": RetrievalMetrics()}
    with torch.no_grad():
        table = model.all_item_embeddings()
        for rank in range(2):
            for batch in build_loader(load_manifest(str(trained.shards), 2, rank), rank, prefetch=0):
                if batch.batch_size == 0:
                    continue
                scores = score_queries(model, batch, "test") @ table.t()
                scores[:, 0] = float("-inf")
                full += torch.topk(scores, 10).indices.tolist()
                ids, offsets = jagged_concat_last(batch.item_ids, batch.offsets, batch.valid_item)
                seen = torch.repeat_interleave(torch.arange(batch.batch_size), batch.lengths + 1)
                scores[seen, ids] = float("-inf")
                unseen += torch.topk(scores, 10).indices.tolist()
                metrics = evaluate_batch(model, batch, table, history=history_of(batch, "test"))
                sums["full"], sums["unseen"] = sums["full"] + metrics.full, sums["unseen"] + metrics.unseen
                rows += query_rows(batch, raw, users)
    named = {name: [[raw[i] for i in top] for top in tops] for name, tops in (("full", full), ("unseen", unseen))}
    return rows, named, {name: metrics.means() for name, metrics in sums.items()}


def query_rows(batch, raw: dict, users) -> list[dict]:
    """A batch's test queries as a user would send them: raw ids, times, ratings and raw feature values."""
    rows = []
    for i, user in enumerate(batch.user_ids):
        a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
        features = users.loc[int(user)].to_dict() if int(user) in users.index else {}
        rows.append({"user": user, "target": raw[int(batch.test_item[i])],
                     "items": [raw[int(x)] for x in batch.item_ids[a:b]] + [raw[int(batch.valid_item[i])]],
                     "timestamps": batch.timestamps[a:b].tolist() + [int(batch.valid_timestamp[i])],
                     "ratings": batch.ratings[a:b].tolist() + [int(batch.valid_rating[i])], **features})
    return rows


PREDICT = textwrap.dedent("""
    import json, sys
    import mlflow, pandas as pd, torch
    uri, model_uri, inputs, output = sys.argv[1:]
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(model_uri)
    frame = pd.DataFrame(json.loads(open(inputs).read()))
    full = model.predict(frame, params={"k": 10, "exclude_history": False})
    unseen = model.predict(frame)
    unknown = frame.head(3).copy()
    unknown["items"] = [["no-such-item"] + items for items in unknown["items"]]
    unknown["timestamps"] = [[0] + ts for ts in unknown["timestamps"]]
    unknown["ratings"] = [[0] + rs for rs in unknown["ratings"]]
    odd = model.predict(unknown, params={"k": 10, "exclude_history": False})
    lists = model.predict(frame[["items"]].head(2), params={"k": 5})  # items alone: the rest is optional
    cold = model.predict(pd.DataFrame({"items": [["no-such-item"]]}), params={"k": 4})
    json.dump({"full": full["items"].tolist(), "full_scores": full["scores"].tolist(),
               "unseen": unseen["items"].tolist(), "unknown": odd["unknown_items"].tolist(),
               "unknown_items": odd["items"].tolist(), "lists": lists["items"].tolist(),
               "cold": cold[["items", "fallback"]].to_dict("records"),
               "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torchrec", "fbgemm_gpu")),
               "process_group": torch.distributed.is_available() and torch.distributed.is_initialized()},
              open(output, "w"))
""")


def metrics_of(tops: list[list[str]], targets: list[str]) -> dict[str, float]:
    """HR@10 and NDCG@10 of the targets in top-10 lists (one relevant item: NDCG = 1/log2(rank + 2))."""
    ranks = [top.index(target) if target in top else None for top, target in zip(tops, targets)]
    return {"hr@10": sum(r is not None for r in ranks) / len(ranks),
            "ndcg@10": sum(1 / math.log2(r + 2) for r in ranks if r is not None) / len(ranks)}


@pytest.mark.slow
def test_a_fresh_process_predicts_the_trainers_ranking_without_torchrec(trained, exported, movielens_prepared,
                                                                        movielens_dir, tmp_path):
    import pyarrow.parquet as pq

    rows, top, sums = reference(trained, movielens_prepared, movielens_dir / "users.parquet")
    summary = trained.summary["summary"]
    assert sums["full"]["count"] == summary["eval_samples"] == len(rows)
    for name in ("hr@10", "ndcg@10"):  # the reference is the trainer's own evaluation
        assert sums["full"][name] == pytest.approx(summary[name.replace("@", "_at_")], abs=1e-9)
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps([{k: v for k, v in row.items() if k not in ("user", "target")} for row in rows]))
    result = subprocess.run([sys.executable, "-c", PREDICT, trained.uri, exported.mlflow["model_uri"], str(inputs),
                             str(tmp_path / "out.json")], cwd=helpers.REPO, capture_output=True, text=True,
                            timeout=helpers.TIMEOUT_S, env={**helpers.train_env(),
                                                            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["modules"] == [] and out["process_group"] is False
    assert out["full"] == top["full"]  # every user's top 10: the trainer's ranking
    assert out["unseen"] == top["unseen"]
    targets = [row["target"] for row in rows]
    for name, value in metrics_of(out["full"], targets).items():
        assert value == pytest.approx(summary[name.replace("@", "_at_")], abs=1e-9)
    for name, value in metrics_of(out["unseen"], targets).items():
        assert value == pytest.approx(sums["unseen"][name], abs=1e-9)
    assert all(not set(unseen) & set(row["items"]) for unseen, row in zip(out["unseen"], rows))
    assert out["unknown"] == [1, 1, 1] and out["unknown_items"] == top["full"][:3]
    assert [len(items) for items in out["lists"]] == [5, 5]
    # a cold start: the prepared data's most popular items (prepare numbers items by count: ids 1..4)
    raw = dict(zip(*pq.read_table(movielens_prepared / "item_vocab", columns=["item_id", "raw_item"])
                   .to_pydict().values()))
    assert out["cold"] == [{"items": [raw[i] for i in range(1, 5)], "fallback": True}]


@pytest.mark.slow
def test_the_model_is_logged_on_the_trainings_run_and_the_folder_is_complete(trained, exported):
    from mlflow.tracking import MlflowClient

    run_id = trained.summary["mlflow_run_id"]
    assert exported.mlflow["run_id"] == run_id and exported.mlflow["registered_version"] is None
    client = MlflowClient(trained.uri)
    assert client.get_run(run_id).info.status == "FINISHED"  # as the training left it
    assert client.get_logged_model(exported.mlflow["model_id"]).source_run_id == run_id
    meta = json.loads((exported.folder / "model.json").read_text())
    assert meta["source"]["step"] == STEPS and meta["source"]["weights"] == "last"
    assert meta["source"]["mlflow_run_id"] == run_id and meta["num_items"] == 1682
    assert [f["name"] for f in meta["user_features"]] == ["age", "gender", "occupation", "zip_code"]
    evaluation = json.loads((exported.folder / "evaluation.json").read_text())
    assert evaluation["metrics"]["hr_at_10"] == pytest.approx(trained.summary["summary"]["hr_at_10"])
    assert nothing_beside(exported.folder) == ["model"]


@pytest.mark.slow
def test_registering_twice_gives_versions_1_and_2(trained, fresh_log, capsys):
    from mlflow.tracking import MlflowClient

    versions = []
    for name in ("r1", "r2"):
        out = trained.root / name
        assert export("--checkpoint", str(trained.checkpoint / "step_4"), "--output", str(out),
                      "--tracking-uri", trained.uri, "--experiment", "export-e2e", "--register", REGISTERED) == 0
        versions.append(json.loads((out / "mlflow.json").read_text())["registered_version"])
        assert capsys.readouterr().out.strip().endswith(f"registered {REGISTERED} version {versions[-1]}")
    assert versions == [1, 2]
    client = MlflowClient(trained.uri)
    found = {v.version: v for v in client.search_model_versions(f"name = '{REGISTERED}'")}
    assert sorted(found) == ["1", "2"] and {v.run_id for v in found.values()} == {trained.summary["mlflow_run_id"]}
    assert json.loads((trained.root / "r1" / "model.json").read_text())["source"]["step"] == 4


def broken_copy(trained, root: Path, edit) -> Path:
    copy = root / "ckpt"
    shutil.copytree(trained.checkpoint / f"step_{STEPS}", copy / f"step_{STEPS}")
    edit(copy / f"step_{STEPS}")
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("case", ["config no longer loads", "half-written", "metadata missing", "output exists"])
def test_bad_checkpoints_are_one_line_and_exit_2_with_nothing_written(trained, fresh_log, tmp_path, capsys, case):
    def config(step: Path):
        saved = json.loads((step / "CONFIG").read_text())
        (step / "CONFIG").write_text(json.dumps({**saved, "model.hstu.wings": 2}))

    edits = {"config no longer loads": (config, "saved config no longer loads: ", "unknown key 'model.hstu.wings'"),
             "half-written": (lambda step: (step / "COMPLETE").unlink(), "holds no complete checkpoint",
                              "without COMPLETE"),
             "metadata missing": (lambda step: (step / ".metadata").unlink(), "has no DCP metadata", ""),
             "output exists": (lambda step: None, "already exists (pass --overwrite", "")}
    edit, message, detail = edits[case]
    checkpoint = broken_copy(trained, tmp_path, edit)
    out = tmp_path / "model"
    if case == "output exists":
        out.mkdir()
    assert export("--checkpoint", str(checkpoint), "--output", str(out), "--tracking-uri", trained.uri,
                  "--experiment", "export-e2e-bad") == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("freescale export: error: ") and message in line and detail in line, line
    assert nothing_beside(out) == (["model"] if case == "output exists" else [])
    assert helpers.runs_of(trained.uri, "export-e2e-bad") == []  # refused before its run opened
