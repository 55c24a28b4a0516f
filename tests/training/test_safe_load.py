"""A checkpoint is read without running code from it: a file carrying a pickle payload is refused in one
line and the payload never runs; an older FreeScale's rank file is refused saying why; plain data loads."""
from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from freescale.runtime.errors import InputError
from freescale.training.checkpoint.checkpointer import Checkpointer
from freescale.training.checkpoint.safe_load import check_plain, read_own_state


class Payload:
    """What a replaced file could carry: unpickling it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


class Progress:
    """A ``Stateful`` standing in for the trainer."""

    def __init__(self, state=None):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


PLAIN = {"trainer": {"step": 3, "generator": torch.Generator().get_state(), "sink": {"run_id": "r", "unsent": [
    (2, 1700000000000, {"step/loss": 1.5})]}, "validation": {"best_value": float("-inf"), "stopped": False}},
    "loader": {"root": {"snapshot": {"it_state": {"source": {"rank": 0, "next_step": 3}}}}, "num_yielded": 3},
    "user_table_optimizer": {"state": {"embedding_bags.age.weight": {"age.momentum1": [torch.ones(4)]}}}}


def checkpoint(folder: Path, own: dict, shared: dict | None = None) -> Checkpointer:
    """A complete step_1 as ``Checkpointer.save`` leaves it (one rank, no process group)."""
    checkpointer = Checkpointer(str(folder), rank=0)
    dcp.save(shared or {"w": torch.ones(3), "lr": 0.5}, checkpoint_id=str(checkpointer.step_dir(1)))
    torch.save(own, checkpointer.step_dir(1) / "rank_0.pt")
    return checkpointer


def test_plain_state_round_trips(tmp_path):
    check_plain(PLAIN, "own")
    checkpointer = checkpoint(tmp_path, PLAIN)
    shared, own = {"w": torch.zeros(3), "lr": 0.0}, {"trainer": Progress()}
    checkpointer.load(1, shared, own)
    assert own["trainer"].state["step"] == 3 and own["trainer"].state["sink"] == PLAIN["trainer"]["sink"]
    assert torch.equal(shared["w"], torch.ones(3)) and shared["lr"] == 0.5


def test_state_that_is_not_plain_is_refused_when_saved():
    with pytest.raises(TypeError, match=r"own\.trainer\.when is a pathlib\.PosixPath"):
        check_plain({"trainer": {"when": Path("/x")}}, "own")


@pytest.mark.parametrize("write", [torch.save, lambda obj, path: pickle.dump(obj, open(path, "wb"))],
                         ids=["torch.save", "pickle.dump"])
def test_a_rank_file_carrying_a_payload_is_refused_and_the_payload_never_runs(tmp_path, write):
    marker = tmp_path / "payload-ran"
    checkpointer = checkpoint(tmp_path / "ckpt", PLAIN)
    write({"trainer": Payload(marker)}, checkpointer.step_dir(1) / "rank_0.pt")
    with pytest.raises(InputError) as refused:
        checkpointer.load(1, {"w": torch.zeros(3), "lr": 0.0}, {"trainer": Progress()})
    message = str(refused.value)
    assert "\n" not in message and str(checkpointer.step_dir(1) / "rank_0.pt") in message
    assert "open, which no FreeScale checkpoint holds" in message
    assert not marker.exists()


def test_dcp_files_carrying_a_payload_are_refused_and_the_payload_never_runs(tmp_path):
    """DCP's own reader would unpickle its metadata and its non-tensor entries with the full unpickler."""
    marker = tmp_path / "payload-ran"
    entry = checkpoint(tmp_path / "entry", PLAIN, shared={"w": torch.ones(3), "lr": Payload(marker)})
    with pytest.raises(InputError, match=r"step_1's entry lr names .*open, which no FreeScale checkpoint holds"):
        entry.load(1, {"w": torch.zeros(3), "lr": 0.0}, {"trainer": Progress()})
    metadata = checkpoint(tmp_path / "metadata", PLAIN)
    (metadata.step_dir(1) / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(InputError, match=r"\.metadata names .*open, which no FreeScale checkpoint holds"):
        metadata.load(1, {"w": torch.zeros(3), "lr": 0.0}, {"trainer": Progress()})
    assert not marker.exists()


def test_an_older_freescales_rank_file_is_refused_saying_why(tmp_path):
    """Written the old way: the user tables' optimizer state as a ShardedTensor, through torch.save."""
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    from torch.distributed._shard.metadata import ShardMetadata

    path = tmp_path / "step_1" / "rank_0.pt"
    path.parent.mkdir()
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(dir=tmp_path), 1), rank=0, world_size=1)
    try:
        shard = Shard(torch.ones(4, 2), ShardMetadata([0, 0], [4, 2], "rank:0/cpu"))
        momentum = init_from_local_shards([shard], 4, 2)
        torch.save({**PLAIN, "user_table_optimizer": {"state": {"age": {"momentum1": momentum}}}}, path)
    finally:
        dist.destroy_process_group()
    with pytest.raises(InputError) as refused:
        read_own_state(path)
    message = str(refused.value)
    assert message.startswith(f"checkpoint {path.parent} was written by an older FreeScale")
    assert "ShardedTensor" in message and "cannot be loaded safely" in message and "\n" not in message
    # Without user features an older FreeScale's rank file was plain data already: it loads.
    torch.save(PLAIN, path)
    assert read_own_state(path)["trainer"]["step"] == 3
