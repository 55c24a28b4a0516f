"""`freescale recommend` (freescale/jobs/recommend.py, freescale/training/export/spark_recommend.py): an exported model and a prepare
output -> every user's top k as Parquet, on the suite's Spark session and on its standalone cluster.

The model is an export folder of a random one-layer HSTU with MovieLens-100K's vocabulary and user
features (no training: what is checked is that the job scores each user's whole sequence as the pyfunc
model's ``predict`` does, which tests/training/test_export.py checks against the trainer), logged as an
MLflow model in a sqlite store so that a models:/ URI can name it.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import helpers

K = 7
SAMPLE = 40  # users whose recommendations are compared with the pyfunc model's predict


def recommend(*argv: str) -> int:
    from freescale.jobs import cli

    return cli.main(["recommend", *argv])


def random_model(prepared: Path, out: Path) -> Path:
    """An export folder of a random one-layer HSTU over ``prepared``'s items and user features."""
    import torch

    from freescale.prepare.prepared import read_metadata
    from freescale.training.config import TrainConfig
    from freescale.training.export.exporter import Source, read_vocabulary, write_folder
    from freescale.training.export.exported_model import ITEM_TABLE, USER_TABLE, dense_model

    torch.manual_seed(0)
    config = TrainConfig()
    config.model.hstu.num_layers = 1
    meta = read_metadata(prepared)
    vocab = read_vocabulary(prepared, meta["num_items"], [f["num_ids"] for f in meta["user_features"]])
    model = dense_model(meta["num_items"], config.model, vocab.features, "fp32")
    dim = config.model.embedding_dim
    state = {ITEM_TABLE: torch.randn(meta["num_items"] + 1, dim),
             **{USER_TABLE.format(index=i): torch.randn(size, dim) for i, (_, size) in enumerate(vocab.features)},
             **model.state_dict()}
    source = Source(out.parent / "ckpt" / "step_1", 1, config, {}, SimpleNamespace(state_dict_metadata={}))
    write_folder(out, source, vocab, state, {})
    return out


@pytest.fixture(scope="module")
def model(movielens_prepared, tmp_path_factory):
    """The random model's folder, and the same logged as an MLflow model (registered: models:/recommend-test/1)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from freescale.training.export.exporter import log_model, pyfunc_arguments

    root = tmp_path_factory.mktemp("recommend-model")
    folder = random_model(movielens_prepared, root / "model")
    uri = helpers.sqlite_store(root / "mlflow.db")
    run = MlflowClient(uri).create_run(MlflowClient(uri).create_experiment("recommend-model"))
    logged = log_model(folder, uri, run.info.run_id, "recommend-test")
    mlflow.pyfunc.save_model(str(root / "pyfunc"), **pyfunc_arguments(folder))  # an MLflow model folder, too
    return SimpleNamespace(folder=folder, uri=uri, logged=logged)


@pytest.fixture(scope="module")
def recommended(spark, model, movielens_prepared, tmp_path_factory):
    """The job on every MovieLens user, from the registered model's URI, its run in the model's store."""
    out = tmp_path_factory.mktemp("recommend") / "top"
    assert recommend("--model", "models:/recommend-test/1", "--input", str(movielens_prepared), "--output", str(out),
                     "--k", str(K), "--tracking-uri", model.uri, "--experiment", "recommend") == 0
    return out


def pyfunc_predictions(model_uri: str, tracking_uri: str, prepared: Path, users_table: Path, users: list[str],
                       k: int = K, exclude_history: bool = True):
    """The MLflow pyfunc model's predict on these users' whole prepared sequences, as a client sends them: raw
    item ids, timestamps, ratings and raw user features."""
    import mlflow
    import pandas as pd
    import pyarrow.parquet as pq

    vocab = pq.read_table(prepared / "item_vocab").to_pydict()
    raw = dict(zip(vocab["item_id"], vocab["raw_item"]))
    table = pd.read_parquet(users_table).astype({"user_id": str}).set_index("user_id")
    rows = {r["user_id"]: r for r in pq.read_table(prepared / "sequences").to_pylist() if r["user_id"] in users}
    queries = [{"items": [raw[i] for i in [*r["items"], r["valid_item"], r["test_item"]]],
                "timestamps": [*r["timestamps"], r["valid_timestamp"], r["test_timestamp"]],
                "ratings": [int(x or 0) for x in [*r["ratings"], r["valid_rating"], None]],
                **table.loc[user].to_dict()} for user, r in ((u, rows[u]) for u in users)]
    mlflow.set_tracking_uri(tracking_uri)
    return mlflow.pyfunc.load_model(model_uri).predict(pd.DataFrame(queries),
                                                       params={"k": k, "exclude_history": exclude_history})


@pytest.mark.slow
def test_every_user_gets_k_items_equal_to_the_pyfunc_models_predict(recommended, model, movielens_prepared,
                                                                     movielens_dir):
    import pandas as pd

    top = pd.read_parquet(recommended).set_index("user_id")
    sequences = pd.read_parquet(movielens_prepared / "sequences")
    assert sorted(top.index) == sorted(sequences["user_id"]) and len(top) == 943  # one row per user
    assert all(len(items) == K and len(scores) == K for items, scores in zip(top["items"], top["scores"]))
    assert all(list(s) == sorted(s, reverse=True) for s in top["scores"])
    sample = sorted(top.index)[::len(top) // SAMPLE][:SAMPLE]
    predicted = pyfunc_predictions("models:/recommend-test/1", model.uri, movielens_prepared,
                                   movielens_dir / "users.parquet", sample)
    for user, items, scores in zip(sample, predicted["items"], predicted["scores"]):
        assert list(top.loc[user, "items"]) == items, user
        assert list(top.loc[user, "scores"]) == pytest.approx(scores, abs=1e-5), user
    # the history (its whole sequence, the test item too) is excluded by default, as the model's params say
    history = {r.user_id: {*r.items, r.valid_item, r.test_item} for r in sequences.itertuples()}
    vocab = pd.read_parquet(movielens_prepared / "item_vocab").set_index("raw_item")["item_id"]
    assert all(not {int(vocab[i]) for i in items} & history[user] for user, items in top["items"].items())


@pytest.mark.slow
def test_the_run_records_the_model_and_its_datasets(recommended, model):
    from mlflow.tracking import MlflowClient

    [run] = helpers.runs_of(model.uri, "recommend")
    assert run.info.status == "FINISHED" and run.data.tags["freescale.model_uri"] == "models:/recommend-test/1"
    assert run.data.metrics["users"] == 943 and run.data.params["k"] == str(K)
    inputs = {d.dataset.name.split(":")[0]: d.dataset for d in MlflowClient(model.uri).get_run(
        run.info.run_id).inputs.dataset_inputs}
    assert set(inputs) == {"prepared", "recommendations"} and len(inputs["prepared"].digest) == 32
    assert json.loads(inputs["recommendations"].profile)["users"] == 943


@pytest.mark.slow
def test_a_subset_of_users_and_the_history_kept(spark, model, movielens_prepared, movielens_dir, tmp_path, fresh_log,
                                                capsys):
    import pandas as pd

    out = tmp_path / "some"
    assert recommend("--model", str(model.folder.parent / "pyfunc"), "--input", str(movielens_prepared),
                     "--output", str(out), "--users", "1,2,no-such-user", "--exclude-history", "false", "--k", "3",
                     "--tracking-uri", "none") == 0
    assert "1 of the 3 users asked for are not in the input" in capsys.readouterr().out
    top = pd.read_parquet(out).set_index("user_id")
    assert sorted(top.index) == ["1", "2"]
    predicted = pyfunc_predictions(str(model.folder.parent / "pyfunc"), model.uri, movielens_prepared,
                                   movielens_dir / "users.parquet", ["1", "2"], k=3, exclude_history=False)
    assert [list(items) for items in top["items"]] == list(predicted["items"])


# ------------------------------------------------------------------ the workers' batch path, without Spark

MAX_HISTORY = 8


def reference_histories(rows: list[dict], max_history: int):
    """Each row's history one user at a time, as the job built them before it worked on whole batches."""
    from freescale.training.export.exported_model import History

    def rating(value) -> int:
        return 0 if value is None or value != value else int(value)

    found = []
    for r in rows:
        events = [(int(i), int(t), rating(x)) for i, t, x in zip([*r["items"], r["valid_item"], r["test_item"]],
                                                                 [*r["timestamps"], r["valid_timestamp"],
                                                                  r["test_timestamp"]],
                                                                 [*r["ratings"], r["valid_rating"], None])]
        found.append(History.of(events, max_history, 0, [int(f) for f in r.get("user_features") or []]))
    return found


def ragged_sequences(lengths: list[int], features: int = 2, seed: int = 0):
    """Prepared sequences (prepare's column types) of users with these training lengths: ratings null,
    NaN or fractional here and there, validation ratings null for some."""
    import random

    rng = random.Random(seed)

    def rating():
        return rng.choice([None, float("nan"), 1.0, 2.5, 3.7, 5.0])

    rows = [{"user_id": f"u{n}", "items": [rng.randint(1, 30) for _ in range(length)],
             "timestamps": sorted(rng.randint(0, 10**9) for _ in range(length)),
             "ratings": [rating() for _ in range(length)], "valid_item": rng.randint(1, 30),
             "valid_timestamp": 10**9 + n, "valid_rating": rating(), "test_item": rng.randint(1, 30),
             "test_timestamp": 2 * 10**9 + n, **({"user_features": [rng.randint(0, 9) for _ in range(features)]}
                                                 if features else {})}
            for n, length in enumerate(lengths)]
    return rows, sequences_batch(rows)


def sequences_batch(rows: list[dict]):
    import pyarrow as pa

    types = {"user_id": pa.string(), "items": pa.list_(pa.int32()), "timestamps": pa.list_(pa.int64()),
             "ratings": pa.list_(pa.float32()), "valid_item": pa.int32(), "valid_timestamp": pa.int64(),
             "valid_rating": pa.float32(), "test_item": pa.int32(), "test_timestamp": pa.int64(),
             "user_features": pa.list_(pa.int32())}
    schema = pa.schema([(name, types[name]) for name in rows[0]])
    return pa.RecordBatch.from_pylist(rows, schema=schema)


def assert_same_batch(ours, reference) -> None:
    import numpy as np

    for name in ("ids", "timestamps", "ratings", "offsets", "seen", "seen_offsets", "features"):
        mine, theirs = getattr(ours, name), getattr(reference, name)
        assert mine.dtype == theirs.dtype == np.int64, name
        assert mine.shape == theirs.shape and np.array_equal(mine, theirs), name


@pytest.mark.parametrize("features", [2, 0])
def test_history_batches_are_the_per_user_histories_on_ragged_data(features):
    """Empty training lists (a history of the two targets), shorter than, as long as, and longer than
    max_history (the query keeps the most recent, the exclusion every item), a sliced batch (Arrow offsets
    not from 0), no rows at all."""
    from freescale.training.export.exported_model import HistoryBatch
    from freescale.training.export.spark_recommend import history_batch

    lengths = [0, 1, 0, 5, 6, 7, 40, 3, 0, 13, 2]
    rows, batch = ragged_sequences(lengths, features)
    built = history_batch(batch, MAX_HISTORY)
    assert_same_batch(built, HistoryBatch.of(reference_histories(rows, MAX_HISTORY), features))
    assert built.offsets.tolist()[:3] == [0, 2, 5] and built.offsets[7] - built.offsets[6] == MAX_HISTORY
    assert built.seen_offsets[7] - built.seen_offsets[6] == 42 and set(built.ratings) - {0} <= {1, 2, 3, 5}
    assert_same_batch(history_batch(batch.slice(3, 5), MAX_HISTORY),
                      HistoryBatch.of(reference_histories(rows[3:8], MAX_HISTORY), features))
    assert len(history_batch(batch.slice(0, 0), MAX_HISTORY)) == 0


def test_batches_score_as_histories_one_by_one_and_trim_what_is_left(tmp_path):
    """``ExportedModel.top`` in chunks of any size ranks as each history scored alone (the same items; the
    scores to float rounding: a matmul's may depend on its row count), its chunks bound the score matrix,
    and the output rows are ``rank``'s, keeping only the items left to rank (30 items, up to 26 seen)."""
    import numpy as np
    import pyarrow as pa

    from freescale.training.export.exported_model import ExportedModel, HistoryBatch, users_per_chunk
    from freescale.training.export.spark_recommend import history_batch, recommendation_batch
    from tests.training.test_export import small_folder

    assert users_per_chunk(30) == users_per_chunk(65_535) == 256 and users_per_chunk(10**6) == 16
    assert users_per_chunk(10**9) == 1
    model = ExportedModel(small_folder(tmp_path)[0])
    rows, _ = ragged_sequences([0, 3, 24, 9, 1, 30, 2, 5], features=0, seed=1)
    rows[5]["items"] = [*range(1, 29), 1, 2]  # 28 of the 30 items seen
    batch = sequences_batch(rows)
    histories = history_batch(batch, model.max_history)
    alone = [model.top(HistoryBatch.of([h], 0), 10) for h in reference_histories(rows, model.max_history)]
    for chunk in (3, 1000):
        model.chunk_users = chunk
        scores, ids = model.top(histories, 10)
        assert np.array_equal(ids, np.concatenate([i for _, i in alone]))
        assert np.allclose(scores, np.concatenate([s for s, _ in alone]), rtol=0, atol=1e-6, equal_nan=False)
    table = pa.Table.from_batches([recommendation_batch(batch.column("user_id"), scores, ids,
                                                        pa.array(model.raw_items, pa.string()))])
    found = model.rank(reference_histories(rows, model.max_history), 10)
    assert table.column("user_id").to_pylist() == [r["user_id"] for r in rows]
    assert table.column("items").to_pylist() == [r.items for r in found]
    assert table.column("scores").to_pylist() == [r.scores for r in found]
    assert min(len(r.items) for r in found) < 10 <= max(len(r.items) for r in found)  # some had < 10 items left


def bad_inputs(root: Path, model, prepared: Path) -> dict[str, tuple[list[str], str]]:
    """Arguments the job must refuse (one line, exit 2, nothing written), with the words of its line."""
    other = root / "other"
    other.mkdir()
    (other / "prepare.json").write_text(json.dumps({"format": "freescale.prepared/1", "user_features": []}))
    (other / "sequences").mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    (other / "item_vocab").mkdir()
    pq.write_table(pa.table({"raw_item": ["a", "b"], "item_id": pa.array([1, 2], pa.int32()),
                             "count": pa.array([2, 1], pa.int64())}), other / "item_vocab" / "part-0.parquet")
    taken = root / "taken"
    taken.mkdir()
    (root / "users.txt").write_text("nobody\n\nnor-me\n")
    return {"no user of the input": (["--users", "nobody,nor-me"],
                                     f"--users nobody,nor-me: none of the 2 users it names is in --input {prepared}"),
            "no user of the file": (["--users", f"@{root / 'users.txt'}"],
                                    f"--users @{root / 'users.txt'}: none of the 2 users it names is in"),
            "no model": (["--model", str(root / "nothing")], "--model"),
            "not a model": (["--model", str(prepared)], "neither a `freescale export` folder"),
            "another vocabulary": (["--model", str(model.folder), "--input", str(other)],
                                   "another item vocabulary than --input"),
            "output exists": (["--output", str(taken)], "already exists (pass --overwrite"),
            "not prepared": (["--input", str(root)], "not a `freescale prepare` output")}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no model", "not a model", "another vocabulary", "output exists", "not prepared",
                                  "no user of the input", "no user of the file"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(spark, model, movielens_prepared, tmp_path, fresh_log,
                                                          capsys, case):
    argv, words = bad_inputs(tmp_path, model, movielens_prepared)[case]
    out = tmp_path / "out"
    defaults = {"--model": str(model.folder), "--input": str(movielens_prepared), "--output": str(out)}
    given = dict(zip(argv[::2], argv[1::2]))
    args = [arg for flag, value in {**defaults, **given}.items() for arg in (flag, value)]
    assert recommend(*args, "--tracking-uri", "none") == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("freescale recommend: error: ") and words in line, line
    written = given.get("--output", str(out))
    assert sorted(p.name for p in Path(written).parent.glob(f"{Path(written).name}*")) == (
        ["taken"] if case == "output exists" else [])
    if case == "output exists":
        assert list(Path(written).iterdir()) == []


# ------------------------------------------------------------------ on the suite's Spark standalone cluster

from tests.jobs.test_cluster import executor_python, finish, submit  # noqa: E402,F401  (a fixture, shared)


@pytest.mark.slow
@pytest.mark.extended
def test_on_the_standalone_cluster_it_writes_the_local_recommendations(
        spark_cluster, executor_python, dist, model, movielens_prepared, recommended, tmp_path):  # noqa: F811
    """spark-submit to the cluster as docs/cluster.md says, the executors' Python without the project but
    the zip: the model's folder reaches them through SparkFiles, and the rows are the local run's."""
    import pandas as pd

    out = tmp_path / "top"
    run = finish(submit(spark_cluster, executor_python, dist, "recommend.py", "--model", str(model.folder),
                        "--input", str(movielens_prepared), "--output", str(out), "--k", str(K)))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "the top 7 of 943 users" in run.stdout
    for work in spark_cluster.worker_dirs:
        assert list(work.glob("app-*/*/freescale.zip")), f"no executor of {work.name} fetched the zip"
    ours = pd.read_parquet(out).sort_values("user_id").reset_index(drop=True)
    local = pd.read_parquet(recommended).sort_values("user_id").reset_index(drop=True)
    assert ours["user_id"].tolist() == local["user_id"].tolist()
    assert ours["items"].map(list).tolist() == local["items"].map(list).tolist()
    assert all(a == pytest.approx(b, abs=1e-5) for a, b in zip(ours["scores"].map(list), local["scores"].map(list)))
