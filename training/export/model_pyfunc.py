"""The MLflow model of a `freescale export` (``mlflow.pyfunc``, logged as code: MLflow runs this file to
load the model, so nothing is unpickled). Its artifact ``freescale_model`` is the exported folder;
loading and predicting need torch and this project (``training.export.exported_model``), never TorchRec.

    model = mlflow.pyfunc.load_model("models:/NAME/1")
    model.predict(pandas.DataFrame({"items": [["50", "172"]]}), params={"k": 10, "exclude_history": True})
    model.predict([["50", "172"], ["1"]])                                            # a list of histories

Returns a DataFrame, one row per history in order: ``items`` (the top-k raw item ids, best first),
``scores`` (their cosines with the history's query) and ``unknown_items`` (ids of the history the
vocabulary does not hold: skipped). ``training.export.exported_model`` says how a history is scored.
"""
from __future__ import annotations

import mlflow
import pandas as pd
from mlflow.models import set_model

from training.export.exported_model import ARTIFACT, DEFAULT_K, ExportedModel


class FreeScaleRecommender(mlflow.pyfunc.PythonModel):
    """Top-k raw item ids per user history (``params``: ``k``, default 10; ``exclude_history``, default true)."""

    def load_context(self, context):
        self.model = ExportedModel(context.artifacts[ARTIFACT])

    # The hint is a DataFrame, from which mlflow infers no schema and so converts nothing: a list of
    # histories is taken as well (training.export.exported_model.queries_from).
    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        params = params or {}
        return self.model.predict(model_input, k=int(params.get("k", DEFAULT_K)),
                                  exclude_history=bool(params.get("exclude_history", True)))


set_model(FreeScaleRecommender())
