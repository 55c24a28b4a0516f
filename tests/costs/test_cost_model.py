"""Cost model: predictions, JSON round trip, Spark/NumPy agreement, bad files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from freescale.costs.cost_model import FORMAT, CostModel, cost_column, default_cost_model
from freescale.runtime.errors import InputError

REPO_ROOT = Path(__file__).resolve().parents[2]

TABLE = CostModel(kind="table", lengths=(10, 20, 40), costs=(100, 200, 260), per_id=0.5,
                  unit="ms", provenance={"source": "test"})


def test_default_is_documented_hstu_estimate():
    m = default_cost_model()
    assert (m.kind, m.a, m.b, m.c, m.unit) == ("quadratic", 1.0, 160.0, 1000.0, "relative")
    assert "calibrate" in m.provenance["notes"]
    np.testing.assert_allclose(m.predict(np.array([0, 10, 100])), [1000, 100 + 1600 + 1000, 10000 + 16000 + 1000])


def test_table_interpolates_and_extrapolates_with_end_segments():
    m = CostModel(kind="table", lengths=(10, 20, 40), costs=(100, 200, 260))
    got = m.predict(np.array([5, 10, 15, 20, 30, 40, 100]))
    np.testing.assert_allclose(got, [50, 100, 150, 200, 230, 260, 440])
    # Falling below zero on the left is clipped, never negative.
    steep = CostModel(kind="table", lengths=(50, 60), costs=(100, 200))
    np.testing.assert_allclose(steep.predict(np.array([0, 40, 55])), [0, 0, 150])


def test_per_id_adds_linear_term():
    assert TABLE.predict(np.array([20.0]))[0] == pytest.approx(200 + 0.5 * 20)


@pytest.mark.parametrize("model", [default_cost_model(), TABLE], ids=["quadratic", "table"])
def test_json_round_trip(model, tmp_path):
    path = tmp_path / "sub" / "cost.json"
    text = model.save(path)
    # The file's layout (2-space indent, final newline) is what calibrate has always written.
    assert path.read_text() == text == json.dumps(model.to_json(), indent=2) + "\n"
    assert list(path.parent.iterdir()) == [path]  # written via a temporary sibling, renamed into place
    data = json.loads(text)
    assert data["format"] == FORMAT and data["kind"] == model.kind
    assert CostModel.load(path) == model
    assert CostModel.from_json(model.to_json()) == model


@pytest.mark.parametrize("model", [
    CostModel(kind="quadratic", a=0.7, b=123.4, c=987.6, per_id=2.5),
    CostModel(kind="table", lengths=(8, 16, 64, 256, 1024), costs=(900, 1000, 3000, 40000, 700000), per_id=1.5),
    CostModel(kind="table", lengths=(100, 200), costs=(50, 10)),  # decreasing: clipped to 0 on the right
], ids=["quadratic", "table", "table-clipped"])
def test_cost_column_matches_predict(spark, model):
    lengths = [0, 1, 7, 8, 9, 16, 17, 63, 64, 100, 150, 200, 255, 256, 300, 1023, 1024, 1500, 4096]
    df = spark.createDataFrame([(x,) for x in lengths], "length int")
    got = [r["cost"] for r in df.select("length", cost_column(model).alias("cost")).orderBy("length").collect()]
    np.testing.assert_allclose(got, model.predict(np.array(lengths)), rtol=1e-9, atol=0)


@pytest.mark.spawns
def test_module_import_does_not_load_pyspark():
    code = "import sys, freescale.costs.cost_model; sys.exit('pyspark' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


def _quadratic(**overrides):
    return {"format": FORMAT, "kind": "quadratic", "a": 1, "b": 2, "c": 3, **overrides}


def _table(**overrides):
    return {"format": FORMAT, "kind": "table", "lengths": [1, 2, 3], "costs": [1, 2, 3], **overrides}


@pytest.mark.parametrize("content, needle", [
    ("{not json", "not valid JSON"),
    (json.dumps([1, 2]), "JSON object"),
    (json.dumps(_quadratic(format="other/9")), "unknown format"),
    (json.dumps(_quadratic(kind="cubic")), "unknown kind"),
    (json.dumps(_quadratic(a=-1)), "negative"),
    (json.dumps(_quadratic(per_id=-0.1)), "negative"),
    (json.dumps(_quadratic(b="fast")), "must be a number"),
    (json.dumps(_table(lengths=[1, 3, 2])), "strictly increasing"),
    (json.dumps(_table(lengths=[1, 1, 2])), "strictly increasing"),
    (json.dumps(_table(costs=[1, 2])), "3 lengths but 2 costs"),
    (json.dumps(_table(lengths=[1], costs=[1])), "at least 2 points"),
    (json.dumps(_table(costs=[1, -2, 3])), "negative"),
    (json.dumps(_quadratic(provenance={"step_constant_s": -0.01})), "step_constant_s=-0.01 is not a finite number"),
    (json.dumps(_quadratic(provenance={"step_constant_s": "9 ms"})), "step_constant_s='9 ms' is not a finite"),
])
def test_bad_file_raises_input_error_naming_file(tmp_path, content, needle):
    path = tmp_path / "cost.json"
    path.write_text(content)
    with pytest.raises(InputError) as err:
        CostModel.load(path)
    msg = str(err.value)
    assert str(path) in msg and needle in msg and "\n" not in msg


def test_the_per_step_constant_is_calibrates_provenance_entry():
    """What `freescale calibrate` fits beside the per-sample costs, read where it writes it; 0 when absent."""
    assert default_cost_model().step_constant_s == 0.0
    fitted = CostModel(kind="quadratic", a=1e-9, unit="seconds", provenance={"step_constant_s": 0.0092})
    assert CostModel.from_json(fitted.to_json()).step_constant_s == 0.0092


def test_missing_file_raises_input_error(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(InputError, match="absent.json.*does not exist"):
        CostModel.load(path)


@pytest.mark.parametrize("fields", [
    {"kind": "quadratic", "a": 0.0, "b": 0.0, "c": 0.0},
    {"kind": "table", "lengths": [1, 100], "costs": [0.0, 0.0]},
])
def test_an_all_zero_model_is_refused_naming_the_file(tmp_path, fields):
    """It used to load, and the balance job then wrote NaN bubbles into the manifest."""
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"format": "freescale.cost_model/1", **fields}))
    with pytest.raises(InputError, match=f"^{path}: predicts zero cost at every length"):
        CostModel.load(path)
    CostModel(kind=fields["kind"], per_id=1.0, **{k: v for k, v in fields.items() if k != "kind"})  # per-id alone is a cost
