"""freescale/training/loop/mlflow_sink.py's resume: a resumed training continues its run with every point once."""
from __future__ import annotations

import pytest

from freescale.training.loop.mlflow_sink import MLflowSink
from tests.helpers import sqlite_store


def series(sink: MLflowSink, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sink.client.get_metric_history(sink.run_id, key)]


@pytest.mark.spawns  # in process, but MLflow's run context runs git (GitPython) and uname -p
def test_a_resumed_run_logs_what_its_record_lacks_series_by_series(tmp_path) -> None:
    uri = sqlite_store(tmp_path / "mlflow.db")
    first = MLflowSink(uri, "sink", "train", {}, {})
    for step in range(5):
        first.log_step(step, {"step/loss": float(step)})
        if step == 1:  # epoch 1 ends after step 1
            first.log_step(step, {"epoch/epoch": 1.0, "epoch/valid_hr_at_10": 0.2})
    first.finish("KILLED")
    # Killed once step 4's loss was sent, before epoch 2's validation (after step 3) was logged;
    # the job resumes from its checkpoint after step 0: trains from step 1 and validates epoch 1 again.
    second = MLflowSink(uri, "sink", "train", {}, {}, resumed={"run_id": first.run_id})
    assert second.run_id == first.run_id
    for step in range(1, 6):
        second.log_step(step, {"step/loss": 10.0 + step})
        if step in (1, 3):
            second.log_step(step, {"epoch/epoch": float((step + 1) // 2), "epoch/valid_hr_at_10": 0.3})
    second.finish("FINISHED")
    assert series(second, "step/loss") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 15.0)]
    assert series(second, "epoch/epoch") == [(1, 1.0), (3, 2.0)]
    assert series(second, "epoch/valid_hr_at_10") == [(1, 0.2), (3, 0.3)]
