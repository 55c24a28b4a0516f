"""An exported model (`freescale export`'s folder), loaded and queried with torch and this project alone:
no TorchRec, no FBGEMM, no process group.

    model = ExportedModel("out/model")
    model.predict(pandas.DataFrame({"items": [["50", "172", "133"]]}), k=10)   # or [["50", "172", "133"]]

The folder (written by ``freescale.training.export.exporter``):

    model.json                FORMAT, the catalog size, the model config, precision, user features, the source
    weights.pt                the weights as one plain fp32 state dict (torch.save): ``item_table`` [N+1, D],
                              ``user_tables.<i>`` per user feature, the dense model's own keys
    item_vocab.json           ``{"raw_items": [null, raw id of item 1, ...], "counts": [null, ...]}``: dense
                              index -> raw item id, and each item's interaction count in the prepared
                              data (the cold-start fallback's ranking; absent in older folders)
    user_feature_vocab.json   with user features: ``{feature: {value: id}}``
    evaluation.json           the protocol the trainer evaluated with, and its numbers when known

A query is a user's history, oldest first: raw item ids as in the input logs (strings or integers),
optionally with ``timestamps`` (seconds) and ``ratings`` (1..5) per item and the user's features (a
column per feature, raw values). Its recommendations are scored exactly as the trainer's evaluation
scores a held-out item (``freescale.training.eval.evaluator.score_queries``): the encoder's output at the history's
last position, against every item's L2-normalised row; the score is that cosine. Items of the
history (all of it, also beyond the ``max_history`` most recent items the query reads) are left out
unless ``exclude_history`` is False (the trainer's summary ranks the whole catalog: with False the
top-k are its ranking).

Unknown ids: items the vocabulary does not hold are skipped (with their timestamps and ratings) and
counted per user in ``unknown_items``. A history with no known item (a cold start, or an empty one)
gets the most popular items instead, marked ``fallback``: the catalog by descending interaction count
of the prepared data the model was exported with (``item_vocab.json``'s ``counts``; a folder exported
before they were recorded ranks by dense id, which prepare assigns by descending count), scored by
their share of those interactions (0 when the counts are not recorded). A user feature value the
vocabulary does not hold is the unknown id 0, as for a user the user table lacked.
Without ``timestamps`` every time gap is 0; without ``ratings`` every rating is unknown (0).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from freescale.runtime.errors import InputError
from freescale.training.config import ModelConfig, apply_table
from freescale.training.export.layout import (FORMAT, ITEM_TABLE, ITEMS_FILE, MODEL_FILE, USER_FEATURES_FILE, USER_TABLE,
                                              WEIGHTS_FILE)
from freescale.training.ops.jagged import last_positions
from freescale.training.model.recommender import SequentialRecommender

ITEMS, TIMESTAMPS, RATINGS = "items", "timestamps", "ratings"
"""The query columns; a user feature's column is its name."""
FALLBACK = "fallback"
"""The output column that marks a history answered with the most popular items."""
DEFAULT_K = 10
ARTIFACT = "freescale_model"
"""The folder's name in the MLflow model (``artifacts/freescale_model``)."""
QUERY_CHUNK = 256
"""Users scored at once, at most: larger chunks score no faster on a CPU (the encoder's work is per user),
and the same chunks keep the scores' bits (a matmul's rounding may depend on its row count)."""
SCORE_BUDGET = 64 << 20
"""Bytes one chunk's ``[users, N+1]`` fp32 score matrix may take: above 65,535 items, fewer users at once."""


def users_per_chunk(num_items: int) -> int:
    """How many users ``ExportedModel.top`` scores at once over ``num_items`` items."""
    return max(1, min(QUERY_CHUNK, SCORE_BUDGET // (4 * (num_items + 1))))


@dataclass
class Query:
    """One user's history, oldest first, as the caller gave it."""

    items: list[Any]
    timestamps: list[int] | None = None
    ratings: list[int] | None = None
    features: dict[str, Any] = field(default_factory=dict)


@dataclass
class Recommendation:
    items: list[str]
    """The top-k raw item ids, best first."""
    scores: list[float]
    unknown_items: int
    """Items of the history the vocabulary does not hold (skipped)."""
    fallback: bool = False
    """No item of the history was known: ``items`` are the most popular ones (``ExportedModel.popular``)."""


def raw_key(value: Any) -> str:
    """How a raw id is looked up: the vocabulary holds prepare's string form (integers as ``50``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    try:
        return str(int(value)) if int(value) == value else str(value)
    except (TypeError, ValueError):
        return str(value)


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"hstu.num_layers": 1}`` -> ``{"hstu": {"num_layers": 1}}`` (a config table)."""
    table: dict[str, Any] = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        cursor = table
        for part in path:
            cursor = cursor.setdefault(part, {})
        cursor[last] = value
    return table


def model_config(flat: dict[str, Any], source: str) -> ModelConfig:
    """The ModelConfig a flat ``model`` record describes, checked as a config file is."""
    config = ModelConfig()
    apply_table(config, nested(flat), source)
    return config


def dense_model(num_items: int, config: ModelConfig, user_features: list[tuple[str, int]],
                precision: str, device: torch.device | str = "cpu") -> SequentialRecommender:
    """The recommender without TorchRec tables: its rows come from plain tensors. With user features, the
    projection the trainer's model has (its tables are the folder's ``user_tables.<i>``)."""
    model = SequentialRecommender(num_items, config, device=device, precision=precision, tables=False)
    if user_features:
        model.user_feature_names = [name for name, _ in user_features]
        model.user_feature_sizes = [int(size) for _, size in user_features]
        model.user_projection = nn.Linear(len(user_features) * config.embedding_dim, config.embedding_dim,
                                          device=device)
    return model.eval()


def _listed(value: Any, row: int, column: str) -> list[Any] | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InputError(f"row {row}: {column} must be a list, got {type(value).__name__}")
    return list(value)


def queries_from(model_input: Any, feature_names: Sequence[str] = ()) -> list[Query]:
    """Queries from a DataFrame (column ``items``; optional ``timestamps``, ``ratings`` and one per user
    feature) or a list of item-id lists."""
    columns = getattr(model_input, "columns", None)
    if columns is None:
        if isinstance(model_input, (str, bytes)) or not hasattr(model_input, "__iter__"):
            raise InputError(f"expected a DataFrame with an {ITEMS!r} column or a list of item-id lists, got "
                             f"{type(model_input).__name__}")
        return [Query(_listed(items, row, ITEMS) or []) for row, items in enumerate(model_input)]
    if ITEMS not in columns:
        raise InputError(f"the input has no {ITEMS!r} column (columns: {', '.join(map(str, columns))})")
    queries = []
    for row, record in enumerate(model_input.to_dict("records")):
        query = Query(_listed(record[ITEMS], row, ITEMS) or [], _listed(record.get(TIMESTAMPS), row, TIMESTAMPS),
                      _listed(record.get(RATINGS), row, RATINGS),
                      {name: record[name] for name in feature_names if name in record})
        for name, values in ((TIMESTAMPS, query.timestamps), (RATINGS, query.ratings)):
            if values is not None and len(values) != len(query.items):
                raise InputError(f"row {row}: {len(values)} {name} for {len(query.items)} items")
        queries.append(query)
    return queries


class ExportedModel:
    """A `freescale export` folder, loaded on ``device`` (CPU by default, as the trainer's evaluation here)."""

    def __init__(self, folder: str | Path, device: torch.device | str = "cpu"):
        self.folder = Path(folder)
        meta = self._json(MODEL_FILE)
        if meta.get("format") != FORMAT:
            raise InputError(f"{self.folder / MODEL_FILE}: format {meta.get('format')!r}, expected {FORMAT!r}")
        self.meta = meta
        self.num_items = int(meta["num_items"])
        self.max_history = int(meta["max_history"])
        self.user_features = [(f["name"], int(f["num_ids"])) for f in meta.get("user_features", [])]
        vocabulary = self._json(ITEMS_FILE)
        self.raw_items: list[str | None] = vocabulary["raw_items"]
        self.popular, self.popular_shares = popularity(vocabulary.get("counts"), self.num_items)
        self.item_ids = {raw: index for index, raw in enumerate(self.raw_items) if index}
        self.feature_ids: dict[str, dict[str, int]] = self._json(USER_FEATURES_FILE) if self.user_features else {}
        weights = torch.load(self.folder / WEIGHTS_FILE, map_location=device, weights_only=True)
        config = model_config(meta["model"], str(self.folder / MODEL_FILE))
        self.model = dense_model(self.num_items, config, self.user_features, meta["precision"], device)
        table = weights.pop(ITEM_TABLE).float()
        table[0] = 0.0  # id 0 is padding: the trainer's all_item_embeddings gives it a zero row
        self.item_table, self.normalized_table = table, F.normalize(table, dim=-1)
        self.user_tables = [weights.pop(USER_TABLE.format(index=i)).float() for i in range(len(self.user_features))]
        self.model.load_state_dict(weights, strict=True)
        self.device = torch.device(device)
        self.chunk_users = users_per_chunk(self.num_items)

    def _json(self, name: str) -> Any:
        path = self.folder / name
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise InputError(f"{self.folder} is not a freescale export: no {name}") from None

    def predict(self, model_input: Any, k: int = DEFAULT_K, exclude_history: bool = True) -> Any:
        """A pandas DataFrame, one row per query in order: ``items`` (the top-k raw ids), ``scores``,
        ``unknown_items``, ``fallback`` (the most popular items: no item of the history was known)."""
        import pandas as pd

        found = self.recommend(queries_from(model_input, [name for name, _ in self.user_features]), k,
                               exclude_history)
        return pd.DataFrame({ITEMS: [r.items for r in found], "scores": [r.scores for r in found],
                             "unknown_items": [r.unknown_items for r in found],
                             FALLBACK: [r.fallback for r in found]})

    def recommend(self, queries: Sequence[Query], k: int = DEFAULT_K,
                  exclude_history: bool = True) -> list[Recommendation]:
        return self.rank([self.history(query) for query in queries], k, exclude_history)

    @torch.no_grad()
    def rank(self, histories: Sequence[History], k: int = DEFAULT_K,
             exclude_history: bool = True) -> list[Recommendation]:
        """Each history's top k (a history with no known item: the fallback)."""
        if int(k) < 1:
            raise InputError(f"k must be a positive integer, got {k}")
        scored = [i for i, history in enumerate(histories) if history.ids]
        results = [None if history.ids else self._fallback(int(k), history.unknown) for history in histories]
        top_scores, top_ids = self.top(HistoryBatch.of([histories[i] for i in scored], len(self.user_features)),
                                       int(k), exclude_history)
        for row, scores, ids in zip(scored, top_scores.tolist(), top_ids.tolist()):
            kept = [(s, i) for s, i in zip(scores, ids) if math.isfinite(s)]
            results[row] = Recommendation([self.raw_items[i] for _, i in kept], [s for s, _ in kept],
                                          histories[row].unknown)
        return results

    # Every caller scores through here (the pyfunc's predict and the recommend job's workers): no graph.
    @torch.no_grad()
    def top(self, batch: HistoryBatch, k: int, exclude_history: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """The top-k ``(scores, ids)``, ``[B, min(k, N)]`` float32 and int64 arrays, of every row of ``batch`` (none
        empty), ``chunk_users`` rows at a time; a row's score is -inf past the items left to rank."""
        width = min(int(k), self.num_items)
        scores, ids = np.empty((len(batch), width), np.float32), np.empty((len(batch), width), np.int64)
        for start in range(0, len(batch), self.chunk_users):
            stop = min(start + self.chunk_users, len(batch))
            found = torch.topk(self.scores(batch.rows(start, stop), exclude_history), width, dim=1)
            scores[start:stop], ids[start:stop] = found.values.cpu().numpy(), found.indices.cpu().numpy()
        return scores, ids

    def _fallback(self, k: int, unknown: int) -> Recommendation:
        """A history without a known item: the ``k`` most popular items, marked."""
        top = self.popular[:k]
        return Recommendation([self.raw_items[i] for i in top], self.popular_shares[:k], unknown, fallback=True)

    def history(self, query: Query) -> History:
        """A query's history as the model reads it: raw ids and feature values to dense ids."""
        ids = [self.item_ids.get(raw_key(raw)) for raw in query.items]
        timestamps = query.timestamps or [0] * len(ids)
        ratings = query.ratings or [0] * len(ids)
        kept = [(i, int(t), int(r)) for i, t, r in zip(ids, timestamps, ratings) if i is not None]
        features = [self._feature_id(name, query.features.get(name)) for name, _ in self.user_features]
        return History.of(kept, self.max_history, ids.count(None), features)

    def _feature_id(self, name: str, value: Any) -> int:
        ids = self.feature_ids[name]
        return next((ids[key] for key in _feature_keys(value) if key in ids), 0)

    def scores(self, batch: HistoryBatch, exclude_history: bool) -> torch.Tensor:
        """``[B, N+1]``: each row's query (``score_queries``' query: the encoder's output at its last position)
        against every item; -inf at the padding id 0 and, with ``exclude_history``, at the row's seen items."""
        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values).to(self.device)

        offsets = tensor(batch.offsets)
        user_ids = tensor(batch.features) if self.user_features else None
        users = self.model.user_vectors(self.model.lookup_users(user_ids, self.user_tables))
        hidden = self.model.encode_rows(self.item_table[tensor(batch.ids)], offsets, tensor(batch.timestamps),
                                        tensor(batch.ratings), users)
        scores = hidden[last_positions(offsets)] @ self.normalized_table.t()
        scores[:, 0] = float("-inf")
        if exclude_history:
            rows = torch.repeat_interleave(torch.arange(len(batch), device=self.device),
                                           tensor(np.diff(batch.seen_offsets)))
            scores[rows, tensor(batch.seen)] = -math.inf
        return scores


@dataclass
class History:
    """A history as dense ids: its known items, the most recent ``max_history`` with their times and ratings
    (the query), how many were unknown, every known one (what ``exclude_history`` leaves out) and the user's
    feature ids (0: unknown), in the model's feature order."""

    ids: list[int]
    timestamps: list[int]
    ratings: list[int]
    unknown: int
    seen: list[int]
    features: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, events: Sequence[tuple[int, int, int]], max_history: int, unknown: int = 0,
           features: Sequence[int] = ()) -> History:
        """From known ``(id, timestamp, rating)`` events, oldest first."""
        recent = events[-max_history:]
        return cls([i for i, _, _ in recent], [t for _, t, _ in recent], [r for _, _, r in recent], unknown,
                   [i for i, _, _ in events], list(features))


@dataclass(frozen=True)
class HistoryBatch:
    """Histories side by side as the model scores them: jagged int64 arrays. Row ``b`` (a user) reads
    ``ids[offsets[b]:offsets[b + 1]]`` (its most recent ``max_history`` known items) with their ``timestamps``
    and ``ratings``; ``seen[seen_offsets[b]:seen_offsets[b + 1]]`` are all its known items (what
    ``exclude_history`` leaves out) and ``features[b]`` its feature ids (``[B, F]``)."""

    ids: np.ndarray
    timestamps: np.ndarray
    ratings: np.ndarray
    offsets: np.ndarray
    seen: np.ndarray
    seen_offsets: np.ndarray
    features: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, start: int, stop: int) -> HistoryBatch:
        """Rows ``start`` to ``stop - 1``, their offsets from 0."""
        first, last = self.offsets[start], self.offsets[stop]
        seen_first, seen_last = self.seen_offsets[start], self.seen_offsets[stop]
        return HistoryBatch(self.ids[first:last], self.timestamps[first:last], self.ratings[first:last],
                            self.offsets[start:stop + 1] - first, self.seen[seen_first:seen_last],
                            self.seen_offsets[start:stop + 1] - seen_first, self.features[start:stop])

    @classmethod
    def of(cls, histories: Sequence[History], num_features: int) -> HistoryBatch:
        """``History`` objects side by side."""
        def flat(name: str) -> np.ndarray:
            return np.fromiter(chain.from_iterable(getattr(h, name) for h in histories), np.int64)

        def offsets(name: str) -> np.ndarray:
            return offsets_of(np.array([len(getattr(h, name)) for h in histories], np.int64))

        features = np.array([h.features for h in histories], np.int64).reshape(len(histories), num_features)
        return cls(flat("ids"), flat("timestamps"), flat("ratings"), offsets("ids"), flat("seen"), offsets("seen"),
                   features)


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    """``[B]`` lengths -> ``[B+1]`` int64 offsets from 0."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def popularity(counts: list[int | None] | None, num_items: int) -> tuple[list[int], list[float]]:
    """Every item's dense id, most popular first, and its share of the interactions: by ``counts`` (ties by
    id), or (none recorded) by id with shares 0 -- prepare numbers items by descending count."""
    if not counts:
        return list(range(1, num_items + 1)), [0.0] * num_items
    order = sorted(range(1, num_items + 1), key=lambda i: (-(counts[i] or 0), i))
    total = sum(c or 0 for c in counts[1:]) or 1
    return order, [(counts[i] or 0) / total for i in order]


def _feature_keys(value: Any) -> tuple[str, ...]:
    """The forms a user feature's raw value may have in the vocabulary (prepare compared Spark's string
    cast: integers as ``24``, booleans as ``true``, doubles as ``24.0``); none: unknown."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ()
    if type(value).__name__ in ("bool", "bool_"):
        return ("true" if value else "false",)
    if isinstance(value, float):  # a double column, or an integer one pandas widened for a missing value
        return (str(value), raw_key(value))
    return (raw_key(value),)
