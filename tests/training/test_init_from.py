"""A warm start (`freescale train --init-from`, ``training.init_from``): a new run at step 0 with another
run's weights and optimizer state, its item table grown for new items. One rank in this process, on
hand-written shards: the source is a short training's checkpoint; the grown shards are its shards with a
manifest of more items (what `prepare --previous` makes: the old items keep their ids, new ones follow)."""
from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import helpers
from tests.helpers import copy_shards, in_process_args, reseal, train_in_process, write_shards

OLD_ITEMS, NEW_ITEMS = 40, 48
SMALL = ("--model.embedding_dim", "16", "--loss.num_negatives", "16", "--training.log_every", "1000")


class NoProcesses:
    """freescale.launch.launcher's `subprocess` for launches that must stop before starting torchrun."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the launcher used subprocess.{name}")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> SimpleNamespace:
    """Shards of 40 items, a 3-epoch training's checkpoint folder on them, the same shards with a manifest of
    48 items, and an exported model folder made from the checkpoint as `freescale export` writes one."""
    root = tmp_path_factory.mktemp("init-from")
    shards = write_shards(root / "shards", world_size=1, num_steps=6, num_items=OLD_ITEMS, max_len=8)
    grown = copy_shards(shards, root / "grown")
    reseal(grown, lambda manifest: manifest.update(num_items=NEW_ITEMS))
    folder = root / "ckpt"
    assert train_in_process(*in_process_args(shards, *SMALL, "--training.max_epochs", "3",
                                             "--checkpoint.folder", str(folder))) == 0
    return SimpleNamespace(shards=shards, grown=grown, folder=folder, step=folder / "step_18",
                           exported=_exported(folder / "step_18", root / "exported"))


def _exported(step: Path, folder: Path) -> Path:
    """The checkpoint's weights and model as an exported model folder holds them (no vocabulary: a warm
    start reads model.json and weights.pt only)."""
    from freescale.training.config import to_flat_dict
    from freescale.training.export.exporter import exported_state, load_weights, open_checkpoint
    from freescale.training.export.layout import FORMAT, MODEL_FILE, WEIGHTS_FILE

    checkpoint = open_checkpoint(str(step))
    state = exported_state(load_weights(checkpoint), 0)
    folder.mkdir()
    torch.save(state, folder / WEIGHTS_FILE)
    (folder / MODEL_FILE).write_text(json.dumps({"format": FORMAT, "num_items": OLD_ITEMS,
                                                 "model": to_flat_dict(checkpoint.config.model)}))
    return folder


@contextlib.contextmanager
def trainer_on(shards: Path, *extra: str):
    """A Trainer of one rank in this process (built: loaded, not trained), closed afterwards."""
    import torch.distributed as dist

    from freescale.training.config import load_config
    from freescale.training.data.shard_reader import stop_prefetch
    from freescale.training.loop.trainer import Trainer

    trainer = Trainer(load_config(None, in_process_args(shards, *SMALL, *extra)))
    try:
        yield trainer
    finally:
        stop_prefetch(trainer.loader)
        trainer.close()
        dist.destroy_process_group()


def item_rows(trainer) -> torch.Tensor:
    from freescale.training.export.exporter import ITEM_KEY

    [shard] = trainer.sharded_model.state_dict()[ITEM_KEY].local_shards()
    return shard.tensor.detach().clone()


def dense_state(trainer) -> dict[str, torch.Tensor]:
    from freescale.training.export.exporter import ITEM_KEY

    return {key: value.detach().clone() for key, value in trainer.sharded_model.state_dict().items()
            if key != ITEM_KEY}


def saved_tensors(step: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under ``prefix`` (DCP's keys), whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from freescale.training.checkpoint.safe_load import SafePlanner, SafeReader

    reader = SafeReader(step)
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in reader.metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, planner=SafePlanner(step), no_dist=True)
    return state


# ------------------------------------------------------------------ loading and growing


def test_a_warm_start_grows_the_item_table_and_carries_the_optimizers(source, capsys):
    from freescale.training.export.exporter import ITEM_KEY

    with trainer_on(source.grown) as cold:
        cold_rows = item_rows(cold)
    capsys.readouterr()
    with trainer_on(source.grown, "--training.init_from", str(source.folder)) as warm:
        assert warm.step == 0  # a new run, not a resume
        rows, dense = item_rows(warm), dense_state(warm)
        adam = warm.dense_optimizer.state_dict()["state"]
        [momentum] = [value for value in warm.model.fused_optimizers()[0].state_dict()["state"].values()]
        [momentum] = [m.local_shards()[0].tensor.detach().clone() for m in momentum.values()]
    line = capsys.readouterr().err
    saved = saved_tensors(source.step, "model.")
    assert rows.shape == (NEW_ITEMS + 1, 16)
    assert torch.equal(rows[:OLD_ITEMS + 1], saved[f"model.{ITEM_KEY}"])  # the source's items keep their rows
    assert torch.equal(rows[OLD_ITEMS + 1:], cold_rows[OLD_ITEMS + 1:])  # new items start as a cold start's
    assert not torch.equal(rows[:OLD_ITEMS + 1], cold_rows[:OLD_ITEMS + 1])
    for key, value in dense.items():
        assert torch.equal(value, saved[f"model.{key}"]), key
    optimizers = saved_tensors(source.step, "dense_optimizer.state.")
    assert optimizers and all(torch.equal(adam[int(key.split(".")[2])][key.split(".")[3]], value)
                              for key, value in optimizers.items())
    [saved_momentum] = saved_tensors(source.step, "sparse_optimizer.").values()
    assert torch.equal(momentum[:OLD_ITEMS + 1], saved_momentum)
    assert torch.count_nonzero(momentum[OLD_ITEMS + 1:]) == 0  # fresh rows: no accumulated gradient
    assert (f"freescale train: init-from {source.step} (checkpoint): model {len(saved)} tensors, item table "
            f"{OLD_ITEMS} -> {NEW_ITEMS} items ({NEW_ITEMS - OLD_ITEMS} new); optimizer state: dense yes, "
            f"embeddings item table rows 0..{OLD_ITEMS} (rows {OLD_ITEMS + 1}..{NEW_ITEMS} start fresh)") in line


def test_a_warm_start_from_an_exported_model_loads_its_weights_without_optimizer_state(source, capsys):
    with trainer_on(source.grown, "--training.init_from", str(source.exported)) as warm:
        rows = item_rows(warm)
        assert warm.dense_optimizer.state_dict()["state"] == {}
    from freescale.training.export.exporter import ITEM_KEY

    saved = saved_tensors(source.step, "model.")
    assert torch.equal(rows[:OLD_ITEMS + 1], saved[f"model.{ITEM_KEY}"])
    assert ("optimizer state: none (an exported model holds none: both optimizers start fresh)"
            in capsys.readouterr().err)


def test_the_warm_starts_first_loss_is_below_the_cold_starts(source, tmp_path, capsys):
    """The same seed and the same (grown) shards: only the starting weights differ."""
    def first_loss(name: str, *extra: str) -> float:
        out = tmp_path / f"{name}.json"
        assert train_in_process(*in_process_args(source.grown, *SMALL, "--training.max_steps", "3",
                                                 "--summary-json", str(out), *extra)) == 0
        return json.loads(out.read_text())["losses"][0]

    cold = first_loss("cold")
    warm = first_loss("warm", "--training.init_from", str(source.folder))
    print(f"first loss: cold {cold:.4f}, warm {warm:.4f}")
    assert warm < cold


def test_a_resume_wins_over_init_from(source, tmp_path, capsys):
    """A warm-started run that restarts continues its own checkpoint, not the source's weights."""
    own = tmp_path / "own"
    own.mkdir()
    shutil.copytree(source.step, own / "step_18")
    with trainer_on(source.shards, "--checkpoint.folder", str(own), "--training.max_epochs", "4",
                    "--training.init_from", str(source.exported)) as trainer:
        assert trainer.step == 18
    assert (f"freescale train: note: resuming {own / 'step_18'}: training.init_from {source.exported} is not "
            "loaded (the run continues its own weights)") in capsys.readouterr().err


# ------------------------------------------------------------------ refusals


def _refused(capsys, monkeypatch, shards: Path, *args: str) -> list[str]:
    from freescale.jobs import cli
    from freescale.launch import launcher

    monkeypatch.setattr(launcher, "subprocess", NoProcesses())
    assert cli.main(["train", "--shards", str(shards), "--tracking-uri", "none", *helpers.SMALL_RUN, *SMALL,
                     *args]) == 2
    return [helpers.without_details(line) for line in capsys.readouterr().err.splitlines()]


def test_another_model_shape_is_one_line_before_torchrun(source, capsys, monkeypatch):
    assert _refused(capsys, monkeypatch, source.grown, "--init-from", str(source.folder),
                    "--model.embedding_dim", "32") == [
        f"freescale train: error: init-from {source.step} holds another model shape (model.embedding_dim 16 "
        "there, 32 here): train with its values, or without --init-from"]
    assert _refused(capsys, monkeypatch, source.grown, "--init-from", str(source.exported),
                    "--model.encoder", "sasrec") == [
        f"freescale train: error: init-from {source.exported} holds a hstu model, this run's model.encoder is "
        "sasrec: warm-start from a sasrec model, or set model.encoder hstu"]
    assert _refused(capsys, monkeypatch, source.grown, "--init-from", str(source.exported),
                    "--model.hstu.num_layers", "2") == [
        f"freescale train: error: init-from {source.exported} holds another model shape (model.hstu.num_layers 1 "
        "there, 2 here): train with its values, or without --init-from"]


def test_a_missing_source_or_a_smaller_catalog_is_one_line(source, tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nowhere"
    assert _refused(capsys, monkeypatch, source.grown, "--init-from", str(missing)) == [
        f"freescale train: error: init-from {missing}: no such checkpoint or exported model (not a directory)"]
    fewer = copy_shards(source.shards, tmp_path / "fewer")
    reseal(fewer, lambda manifest: manifest.update(num_items=OLD_ITEMS - 1))
    assert _refused(capsys, monkeypatch, fewer, "--init-from", str(source.exported)) == [
        f"freescale train: error: init-from {source.exported} holds {OLD_ITEMS} items, these shards "
        f"{OLD_ITEMS - 1}: a warm start keeps each item's row under its id, so the new catalog must hold the "
        "source's items (prepare the new data with --previous) and may only add items after them"]


def test_the_source_is_found_as_its_newest_complete_step(source, tmp_path):
    from freescale.runtime.errors import InputError
    from freescale.training.checkpoint.init_source import CHECKPOINT, EXPORTED, find_init_source

    folder = tmp_path / "ckpt"
    shutil.copytree(source.step, folder / "step_18")
    shutil.copytree(source.step, folder / "step_20")
    (folder / "step_20" / "COMPLETE").unlink()  # a save cut short is never a source
    found = find_init_source(str(folder))
    assert (found.path, found.kind, found.model["model.embedding_dim"]) == ((folder / "step_18").resolve(),
                                                                             CHECKPOINT, 16)
    assert find_init_source(str(source.exported)).kind == EXPORTED
    with pytest.raises(InputError, match=re.escape("checkpoint is half-written")):
        find_init_source(str(folder / "step_20"))


def test_the_launcher_passes_the_step_it_found_and_mlflow_records_it(source, tmp_path):
    """The ranks (and a restart of them) load the step that was newest when the job started; the run's
    params are its flat config, which names it."""
    from freescale.training.checkpoint.init_source import init_settings
    from freescale.training.config import load_config, to_flat_dict

    config = load_config(None, in_process_args(source.grown, *SMALL, "--training.init_from", str(source.folder)))
    settings = init_settings(config)
    assert settings == ["--training.init_from", str(source.step)]
    resolved = load_config(None, in_process_args(source.grown, *SMALL, "--training.init_from", str(source.folder),
                                                 *settings))
    assert to_flat_dict(resolved)["training.init_from"] == str(source.step)
    own = tmp_path / "own"  # a run whose own folder has a checkpoint resumes: the source is not even read
    shutil.copytree(source.step, own / "step_18")
    gone = load_config(None, in_process_args(source.grown, "--training.init_from", str(tmp_path / "gone"),
                                             "--checkpoint.folder", str(own)))
    assert init_settings(gone) == []


def test_a_table_shard_takes_only_its_rows_of_a_grown_table():
    """Row-wise shards of a grown table: each takes the source rows it holds, new rows stay; a shape
    that does not fit is one line."""
    from freescale.runtime.errors import InputError
    from freescale.training.checkpoint.init_from import copy_rows

    class Shard:
        def __init__(self, tensor, offsets):
            self.tensor, self.metadata = tensor, SimpleNamespace(shard_offsets=offsets)

    class Sharded:  # a ShardedTensor's surface: its size and this rank's shards
        def __init__(self, shards, size):
            self.shards, self.shape = shards, size

        def local_shards(self):
            return self.shards

        def size(self):
            return self.shape

    saved = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    low, high = torch.full((4, 3), -1.0), torch.full((4, 3), -1.0)
    target = Sharded([Shard(low, [0, 0]), Shard(high, [4, 0])], torch.Size([8, 3]))
    source = SimpleNamespace(path=Path("src"))
    copy_rows("model.embedding_collection.embeddings.item_embedding.weight", target, saved, source)
    assert torch.equal(low, saved[:4])
    assert torch.equal(high[0], saved[4]) and torch.equal(high[1:], torch.full((3, 3), -1.0))
    with pytest.raises(InputError, match=re.escape("init-from src: model.encoder.weight is (5, 3) there, (8, 3) "
                                                   "here (another model or optimizer shape)")):
        copy_rows("model.encoder.weight", target, saved, source)


# ------------------------------------------------------------------ 2 ranks, through the launcher


@pytest.mark.extended
def test_a_warm_started_launch_starts_below_the_cold_starts_loss(warm_run, row_run):
    """2 ranks on the MovieLens shards, warm-started from the checkpoint folder of a run that trained one
    epoch (its last steps on 3 ranks): its first loss is below the same model's cold start's (row_run: the
    same shards, seed and model), it loaded the folder's newest step with both optimizers' state, and
    MLflow records which."""
    from freescale.training.checkpoint.layout import complete_steps

    newest = warm_run.source.resolve() / f"step_{max(complete_steps(warm_run.source))}"
    cold, warm = row_run.log["losses"][0], warm_run.log["losses"][0]
    print(f"MovieLens, 2 ranks: first loss cold {cold:.4f}, warm {warm:.4f}")
    assert warm < cold
    assert warm_run.params["training.init_from"] == str(newest)
    assert re.search(rf"freescale train: init-from {re.escape(str(newest))} \(checkpoint\): model \d+ tensors, item "
                     r"table \d+ items; optimizer state: dense yes, embeddings item table rows 0\.\.\d+; the user "
                     r"feature tables' optimizer state starts fresh\n", warm_run.run.stderr), warm_run.run.stderr[-3000:]
