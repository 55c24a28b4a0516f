"""The exported model's stable name: every MLflow model `freescale export` writes loads through this
module (its loader, ``freescale/model_pyfunc.py``, imports nothing else of the project), so the
implementation may move without breaking a model exported before the move. What it names is
``freescale.training.export.exported_model``'s (the folder, the scoring) and the one error a query
can raise.
"""
from __future__ import annotations

from freescale.runtime.errors import InputError
from freescale.training.export.exported_model import ARTIFACT, DEFAULT_K, FORMAT, ExportedModel, Query

__all__ = ["ARTIFACT", "DEFAULT_K", "FORMAT", "ExportedModel", "InputError", "Query"]
