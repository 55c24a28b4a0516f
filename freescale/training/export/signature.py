"""What the MLflow model of a `freescale export` says about its requests: the signature (the input
columns and their types, the params) and an input example, so that MLflow checks a request before the
model sees it (a missing ``items`` column or a non-numeric timestamp is a 400 naming that column) and
shows the schema (the model's page, ``serving_input_example.json``).

    items        array<string>  required   the history's raw item ids, oldest first
    timestamps   array<long>    optional   seconds, one per item
    ratings      array<long>    optional   one per item (1..5; 0 unknown)
    <feature>    any            optional   one column per user feature the model was trained with, raw values
    params: k (long, 10), exclude_history (boolean, true)

User features are ``any``: prepare compared their string form (``freescale.training.export.exported_model``), so an age sent
as 24 or "24" is the same value. mlflow is imported when called.
"""
from __future__ import annotations

from typing import Any, Sequence

from freescale.training.export.exported_model import DEFAULT_K, ITEMS, RATINGS, TIMESTAMPS, ExportedModel

EXAMPLE_ITEMS = 3
"""Items of the input example: the catalog's most popular ones."""


def signature(feature_names: Sequence[str]) -> Any:
    """The model's ModelSignature: the columns above and the params ``k`` and ``exclude_history``."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, Array, ColSpec, ParamSchema, ParamSpec, Schema

    columns = [ColSpec(Array("string"), ITEMS), ColSpec(Array("long"), TIMESTAMPS, required=False),
               ColSpec(Array("long"), RATINGS, required=False),
               *(ColSpec(AnyType(), name, required=False) for name in feature_names)]
    params = ParamSchema([ParamSpec("k", "long", DEFAULT_K), ParamSpec("exclude_history", "boolean", True)])
    return ModelSignature(inputs=Schema(columns), params=params)


def input_example(model: ExportedModel) -> Any:
    """One history: the model's most popular items."""
    import pandas as pd

    return pd.DataFrame({ITEMS: [[str(model.raw_items[i]) for i in model.popular[:EXAMPLE_ITEMS]]]})
