"""The MLflow model of a `freescale export` (``mlflow.pyfunc``, logged as code: MLflow runs this file to
load the model, so nothing is unpickled). Its artifact ``freescale_model`` is the exported folder;
loading and predicting need torch and this project, whose one name it imports is ``freescale.model``
(kept stable across moves, so a model exported today loads after one), never TorchRec.

    model = mlflow.pyfunc.load_model("models:/NAME/1")
    model.predict(pandas.DataFrame({"items": [["50", "172"]]}), params={"k": 10, "exclude_history": True})

Returns a DataFrame, one row per history in order: ``items`` (the top-k raw item ids, best first),
``scores`` (their cosines with the history's query), ``unknown_items`` (ids of the history the
vocabulary does not hold: skipped) and ``fallback`` (true: no item of the history was known, and
``items`` are the most popular ones). ``freescale.training.export.exported_model`` says how a history is scored.

The model's signature (``freescale.training.export.signature``) has MLflow check each request's columns and
types first; what only the model can check (a history's timestamps that do not match its items, a k
below 1) is an MlflowException of INVALID_PARAMETER_VALUE, so a server answers 400 with its message.
Models logged before the signature (none) also take a list of item-id lists.
"""
from __future__ import annotations

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import set_model
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from freescale.model import ARTIFACT, DEFAULT_K, ExportedModel, InputError


class FreeScaleRecommender(mlflow.pyfunc.PythonModel):
    """Top-k raw item ids per user history (``params``: ``k``, default 10; ``exclude_history``, default true)."""

    def load_context(self, context):
        self.model = ExportedModel(context.artifacts[ARTIFACT])

    # The hint is a DataFrame, from which mlflow infers no schema and so converts nothing: the schema is
    # the logged signature's.
    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        params = params or {}
        try:
            return self.model.predict(model_input, k=int(params.get("k", DEFAULT_K)),
                                      exclude_history=bool(params.get("exclude_history", True)))
        except InputError as bad:  # the client's fault: mlflow's server answers 400 with this message
            raise MlflowException(str(bad), error_code=INVALID_PARAMETER_VALUE) from None


set_model(FreeScaleRecommender())
