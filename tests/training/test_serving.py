"""Serving an exported model (freescale/training/export/exported_model.py, freescale/training/export/signature.py, freescale/model_pyfunc.py):
a cold start gets the most popular items, marked; the MLflow model carries a signature and an input
example, so MLflow checks each request; a bad request is a 400 whose message names the column. The
last tests go over real HTTP, to `mlflow models serve --env-manager local` on a free loopback port
(benchmarks/serving_bench.py starts it and drives it; its measured load is docs/results/serving_bench.md).

The model is a random one-layer HSTU over 30 items (tests/training/test_export.py's small_folder): what is
checked here is the request's path, not the ranking (test_export checks that against the trainer's).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import helpers
from tests.training.test_export import small_folder

NUM_ITEMS = 30
# Interaction counts that rank the items otherwise than their ids: i30 most popular, ..., i1 least.
COUNTS = [None] + list(range(1, NUM_ITEMS + 1))


def saved_model(root: Path) -> Path:
    """The small folder (with COUNTS) saved as the MLflow pyfunc model `freescale export` logs."""
    import mlflow

    from freescale.training.export.exporter import pyfunc_arguments, quiet_mlflow

    folder, _ = small_folder(root, NUM_ITEMS, counts=COUNTS)
    with quiet_mlflow():
        mlflow.pyfunc.save_model(str(root / "pyfunc"), **pyfunc_arguments(folder))
    return root / "pyfunc"


def test_a_cold_start_gets_the_most_popular_items_by_count_marked_as_fallback(tmp_path):
    from freescale.training.export.exported_model import ExportedModel

    folder, _ = small_folder(tmp_path, NUM_ITEMS, counts=COUNTS)
    model = ExportedModel(folder)
    out = model.predict([["unknown-1", "unknown-2"], [], ["i3", "unknown"]], k=4)
    assert out["items"][0] == out["items"][1] == ["i30", "i29", "i28", "i27"]
    total = sum(COUNTS[1:])
    assert out["scores"][0] == pytest.approx([30 / total, 29 / total, 28 / total, 27 / total])
    assert out["fallback"].tolist() == [True, True, False] and out["unknown_items"].tolist() == [2, 0, 1]
    assert "i3" not in out["items"][2] and len(out["items"][2]) == 4  # a known item: the model's ranking
    assert len(model.predict([["nope"]], k=100)["items"][0]) == NUM_ITEMS  # k beyond the catalog: all of it


def invocation(model, body: dict) -> tuple[int, str]:
    """What `mlflow models serve` answers ``body`` (its request handler, in this process): status and text."""
    from mlflow.exceptions import MlflowException
    from mlflow.pyfunc import scoring_server

    try:
        answer = scoring_server.invocations(json.dumps(body), "application/json", model,
                                            model.metadata.get_input_schema())
    except MlflowException as refused:
        return refused.get_http_status_code(), refused.message
    return answer.status, answer.response


# A request that is wrong in one column, and the words its 400 must hold.
BAD_REQUESTS = {
    "no items column": ({"dataframe_records": [{"itemz": ["i1", "i2"]}]}, ["missing inputs ['items']"]),
    "timestamps not numbers": ({"dataframe_records": [{"items": ["i1", "i2"], "timestamps": ["noon", 3]}]},
                               ["column timestamps", "Array(long)"]),
    "items not a list": ({"dataframe_records": [{"items": "i1"}]}, ["column items", "Array(string)"]),
    "timestamps not one per item": ({"dataframe_records": [{"items": ["i1", "i2"], "timestamps": [1]}]},
                                    ["row 0: 1 timestamps for 2 items"]),
    "k below 1": ({"dataframe_records": [{"items": ["i1"]}], "params": {"k": 0}},
                  ["k must be a positive integer, got 0"]),
}


@pytest.mark.spawns  # saving an MLflow model runs `uname -p` (its environment's description)
def test_the_mlflow_model_checks_each_request_against_its_signature(tmp_path):
    import mlflow
    import pandas as pd

    path = saved_model(tmp_path)
    model = mlflow.pyfunc.load_model(str(path))
    schema = model.metadata.get_input_schema()
    assert schema.input_names() == ["items", "timestamps", "ratings"]
    assert [spec.required for spec in schema.inputs] == [True, False, False]
    assert {p.name: p.default for p in model.metadata.get_params_schema().params} == {"k": 10, "exclude_history": True}
    example = json.loads((path / "serving_input_example.json").read_text())
    assert example == {"dataframe_split": {"columns": ["items"], "data": [[["i30", "i29", "i28"]]]}}
    status, text = invocation(model, {"dataframe_records": [{"items": ["i1", "i2"], "timestamps": [1, 2],
                                                              "ratings": [4, 5]},
                                                             # MLflow takes a missing optional column as NaN,
                                                             # which its check refuses: null says "none"
                                                             {"items": ["gone"], "timestamps": None, "ratings": None}],
                                      "params": {"k": 3}})
    assert status == 200, text
    first, cold = json.loads(text)["predictions"]
    assert first["fallback"] is False and len(first["items"]) == 3 and not {"i1", "i2"} & set(first["items"])
    assert cold == {"items": ["i30", "i29", "i28"], "scores": pytest.approx([30 / 465, 29 / 465, 28 / 465]),
                    "unknown_items": 1, "fallback": True}
    same = pd.DataFrame({"items": [["i1", "i2"]], "timestamps": [[1, 2]], "ratings": [[4, 5]]})
    assert model.predict(same, params={"k": 3})["items"][0] == first["items"]
    for case, (body, words) in BAD_REQUESTS.items():
        status, text = invocation(model, body)
        assert status == 400 and all(word in text for word in words), (case, status, text)


# ------------------------------------------------------------------ over real HTTP


@pytest.fixture(scope="module")
@helpers.spawns
def served(tmp_path_factory):
    """`mlflow models serve --env-manager local` of the small model on a free loopback port; its address."""
    from benchmarks.serving_bench import serve_model

    root = tmp_path_factory.mktemp("served")
    with serve_model(saved_model(root), root / "server.log") as address:
        yield address


def test_over_http_a_cold_start_gets_k_fallback_items(served):
    from benchmarks.serving_bench import invoke

    status, answer = invoke(served, {"dataframe_records": [{"items": ["never-seen", "nor-this"]}],
                                     "params": {"k": 5}})
    assert status == 200, answer
    assert answer["predictions"] == [{"items": ["i30", "i29", "i28", "i27", "i26"], "scores": pytest.approx(
        [n / 465 for n in (30, 29, 28, 27, 26)]), "unknown_items": 2, "fallback": True}]


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_over_http_a_bad_request_is_a_400_naming_its_column(served, case):
    from benchmarks.serving_bench import invoke

    body, words = BAD_REQUESTS[case]
    status, answer = invoke(served, body)
    assert status == 400 and answer["error_code"] in ("BAD_REQUEST", "INVALID_PARAMETER_VALUE"), answer
    assert all(word in answer["message"] for word in words), answer["message"]


def test_over_http_concurrent_clients_get_every_answer(served):
    """A short, bounded load (the benchmark's driver: 4 clients, 3 s): every request answered 200."""
    from benchmarks.serving_bench import drive

    bodies = [json.dumps({"dataframe_records": [{"items": [f"i{n}", f"i{n + 1}"]}]}).encode() for n in range(1, 29)]
    load = drive(served, bodies, clients=4, seconds=3)
    assert load.errors == [] and len(load.latencies) >= 4
    row = load.row()
    assert row["p50_ms"] <= row["p99_ms"] and row["requests"] == len(load.latencies)


# ------------------------------------------------------------------ models exported before the one package


@pytest.mark.spawns  # in process, but saving an MLflow model runs uname -p (platform.processor)
def test_a_model_exported_before_the_one_package_still_loads(tmp_path):
    """Its loader (model_pyfunc.py as it was copied into each model before the move) imports
    runtime.errors and training.export.exported_model; freescale/__init__.py maps those names (and the
    older training.exported_model) to their homes: the same module objects, the same predictions."""
    import sys

    import mlflow
    import pandas as pd

    import freescale.model
    from freescale.training.export.exporter import pyfunc_arguments, quiet_mlflow

    folder, _ = small_folder(tmp_path, NUM_ITEMS, counts=COUNTS)
    arguments = pyfunc_arguments(folder)
    loader = Path(arguments["python_model"]).read_text()
    stable = "from freescale.model import ARTIFACT, DEFAULT_K, ExportedModel, InputError\n"
    assert stable in loader  # what a model exported from now on imports: one stable name
    old_loader = tmp_path / "model_pyfunc.py"
    old_loader.write_text(loader.replace(stable, "from runtime.errors import InputError\n"
                                         "from training.export.exported_model import ARTIFACT, DEFAULT_K, ExportedModel\n"))
    with quiet_mlflow():
        mlflow.pyfunc.save_model(str(tmp_path / "old"), **{**arguments, "python_model": str(old_loader)})
    model = mlflow.pyfunc.load_model(str(tmp_path / "old"))
    histories = pd.DataFrame({"items": [["i3", "i5"], ["nope"], ["i7", "unknown"]]})
    got = model.predict(histories, params={"k": 3}).to_dict("list")
    assert got == freescale.model.ExportedModel(folder).predict(histories, k=3).to_dict("list")
    assert got["fallback"] == [False, True, False]
    home = sys.modules["freescale.training.export.exported_model"]
    import runtime.errors
    import training.export.exported_model
    import training.exported_model

    assert training.exported_model is training.export.exported_model is home
    assert runtime.errors.InputError is freescale.model.InputError
