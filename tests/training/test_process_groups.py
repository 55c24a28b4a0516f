"""The trainer on a default process group that refuses host tensors, as a GPU machine's bare
"nccl" group does ("No backend type associated with device type cpu"): two spawned CPU ranks
start such a group before the trainer (``init_distributed`` keeps a group already started), then
build, train, validate, checkpoint, evaluate and resume. Every collective must pass the group
that serves its tensors (``DistEnv.host_group`` / ``device_group``).

The refusing group is ``"cuda:gloo"``: torch maps it to CUDA tensors only, so a CPU tensor's
collective on it raises the same error a bare NCCL group raises. NCCL does serve barriers and
object collectives (it stages them on the GPU); here those go through a gloo group beside it
(``_serve_objects_beside``), so the first thing the test can refuse is what two GPUs would
refuse: a host tensor. The trainer's numbers must not change: the run on the refusing group
trains to the bit what the run on a plain gloo group trains."""
from __future__ import annotations

import json
import math
import shutil
import traceback
from datetime import timedelta
from pathlib import Path

import pytest

from tests.helpers import SMALL_RUN, write_shards

REFUSAL = "No backend type associated with device type cpu"
OBJECT_COLLECTIVES = ("barrier", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")


def _serve_objects_beside(side, rerouted: list[str]) -> None:
    """Barriers and object collectives given the default group run on ``side`` (a bare NCCL
    group serves them on the GPU); each one is named in ``rerouted``."""
    import torch.distributed as dist

    for name in OBJECT_COLLECTIVES:
        original = getattr(dist, name)

        def on_side(*args, _original=original, _name=name, group=None, **kwargs):
            if group is None or group is dist.GroupMember.WORLD:
                rerouted.append(_name)
                group = side
            return _original(*args, group=group, **kwargs)

        setattr(dist, name, on_side)


def _train(argv: list[str], out: Path) -> None:
    """The real trainer on this rank; its losses and scores (the summary less its timings) written to ``out``."""
    from freescale.training.config import load_config
    from freescale.training.loop.trainer import Trainer
    import numpy as np

    from freescale.training.timing.bubbles import TIMING_FIELDS
    from freescale.training.timing.step_report import run_summary

    trainer = Trainer(load_config(None, argv))
    try:
        result = trainer.train()
    finally:
        trainer.close()
    timings = set(run_summary(np.ones((3, 2, len(TIMING_FIELDS))))) - {"loss"}
    scores = {key: value for key, value in result.summary.items() if key not in timings}
    out.write_text(json.dumps({"steps": result.steps, "losses": result.losses, "scores": scores}))


def _rank(rank: int, folder: str, runs: dict[str, list[str]]) -> None:
    """One rank: a plain gloo run, then the refusing group's run and a resume of its checkpoint.
    Each run's outcome is a file: its result, or the traceback."""
    import os

    import torch
    import torch.distributed as dist

    from freescale.training.parallel.distributed import exit_without_finalization

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                       "OMP_NUM_THREADS": "1"})
    root = Path(folder)
    timeout = timedelta(seconds=120)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(str(root / "store-gloo"), 2), rank=rank,
                                world_size=2, timeout=timeout)
        _train(runs["gloo"], root / f"gloo-rank{rank}.json")
        dist.destroy_process_group()
        dist.init_process_group("cuda:gloo", store=dist.FileStore(str(root / "store-refusing"), 2), rank=rank,
                                world_size=2, timeout=timeout)
        try:
            dist.all_reduce(torch.zeros(1))
            raise AssertionError("the refusing group took a CPU tensor")
        except RuntimeError as refused:
            assert REFUSAL in str(refused), refused
        rerouted: list[str] = []
        side = dist.new_group(backend="gloo", timeout=timeout)
        _serve_objects_beside(side, rerouted)
        _train(runs["refusing"], root / f"refusing-rank{rank}.json")
        if rank == 0:
            shutil.copytree(root / "ckpt-refusing" / "step_2", root / "ckpt-resumed" / "step_2")
        dist.barrier(group=side)
        _train(runs["resumed"], root / f"resumed-rank{rank}.json")
        (root / f"rerouted-rank{rank}.json").write_text(json.dumps(rerouted))
        (root / f"outcome-rank{rank}.txt").write_text("ok")
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        (root / f"outcome-rank{rank}.txt").write_text(traceback.format_exc())
    exit_without_finalization(0)


@pytest.mark.spawns
def test_trains_on_a_default_group_that_refuses_host_tensors(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    shards = write_shards(tmp_path / "shards", world_size=2, num_steps=2, local_batch=3)

    def argv(name: str, *extra: str) -> list[str]:
        return ["--data.shards", str(shards), *SMALL_RUN, "--training.eval_max_samples", "4",
                "--loss.num_negatives", "8", "--model.embedding_dim", "16", "--training.max_epochs", "2",
                "--evaluation.every_epochs", "1", "--checkpoint.folder", str(tmp_path / f"ckpt-{name}"),
                "--checkpoint.every_steps", "2", *extra]

    # plain: TorchRec's lookups and the dense all-reduce on the device group; the resume runs the
    # comm layer's groups and loads the checkpoint (DCP) on the refusing default.
    runs = {"gloo": argv("gloo", "--comm.mode", "plain"), "refusing": argv("refusing", "--comm.mode", "plain"),
            "resumed": argv("resumed", "--comm.mode", "prioritized")}
    mp.spawn(_rank, args=(str(tmp_path), runs), nprocs=2, join=True)
    for rank in range(2):
        outcome = (tmp_path / f"outcome-rank{rank}.txt").read_text()
        assert outcome == "ok", f"rank {rank}:\n{outcome}"
    results = {name: [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in range(2)]
               for name in runs}
    for name, (first, second) in results.items():
        assert first["losses"] == second["losses"] and first["scores"] == second["scores"], name
        assert first["losses"] and all(math.isfinite(loss) for loss in first["losses"]), name
    gloo, refusing, resumed = (results[name][0] for name in runs)
    assert gloo["steps"] == refusing["steps"] == [0, 1, 2, 3] and resumed["steps"] == [2, 3]
    # Groups made beside the refusing default train what the default gloo group trains, to the bit.
    assert refusing["losses"] == gloo["losses"] and refusing["scores"] == gloo["scores"]
    assert resumed["losses"] == pytest.approx(refusing["losses"][2:], rel=1e-5)
    # Not one barrier or object collective was left to the default group.
    assert [json.loads((tmp_path / f"rerouted-rank{r}.json").read_text()) for r in range(2)] == [[], []]


def test_ranks_sharing_the_agents_store_keep_each_attempts_keys_apart(monkeypatch) -> None:
    """On one node the ranks meet in torchrun's agent store, which outlives a restart: each
    attempt's keys go under its number, so a restarted rank never reads its dead peers' keys. Apart
    from the agent (several nodes), torch's env:// store is used as it is."""
    import torch.distributed as dist

    from freescale.training.parallel.distributed import attempt_store

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store(timedelta(seconds=5)) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert attempt_store(timedelta(seconds=5)) is None

    agents = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agents.port), "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    stores = {}
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        stores[attempt] = attempt_store(timedelta(seconds=5))
        stores[attempt].set("default_pg/rank_1", f"address of attempt {attempt}")
    assert stores["1"].get("default_pg/rank_1") == b"address of attempt 1"
    assert agents.get("freescale/attempt-0/default_pg/rank_1") == b"address of attempt 0"
    assert not agents.check(["default_pg/rank_1"])


def _rank_bounds(rank: int, folder: str, port: int) -> None:
    """One rank: rank 1 is late for the first collective (set-up, under ``init_timeout_s``) and
    later for one after ``bound_collectives`` (under ``collective_timeout_s``); each collective's
    outcome and how long rank 0 waited go to a file."""
    import os
    import time

    import torch
    import torch.distributed as dist

    from freescale.training.config import ParallelConfig
    from freescale.training.parallel.distributed import bound_collectives, exit_without_finalization, init_distributed

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    parallel = ParallelConfig(backend="gloo", init_timeout_s=60, collective_timeout_s=1)
    outcomes = []
    try:
        env = init_distributed(parallel, threads=1)
        for late_s, bound in ((3, None), (4, timedelta(seconds=parallel.collective_timeout_s))):
            if bound is not None:
                bound_collectives(bound, env.host_group)
            if rank == 1:
                time.sleep(late_s)
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=env.host_group)
                outcomes.append(["ok", time.monotonic() - start])
            except RuntimeError as exc:
                outcomes.append([str(exc).splitlines()[0], time.monotonic() - start])
                break
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        outcomes.append([traceback.format_exc(), 0.0])
    (Path(folder) / f"bounds-rank{rank}.json").write_text(json.dumps(outcomes))
    exit_without_finalization(0)


@pytest.mark.spawns
def test_set_up_has_its_own_bound_and_the_steps_theirs(tmp_path: Path) -> None:
    """A rank 3 s late in set-up is waited for under ``init_timeout_s`` (60 s) though the steps' bound
    is 1 s: one rank's set-up (rank 0 starting its MLflow run, first-step compiles) is not a hang.
    After ``bound_collectives`` a rank 4 s late is a hang: its peer fails after about 1 s."""
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    mp.spawn(_rank_bounds, args=(str(tmp_path), free_port()), nprocs=2, join=True)
    set_up, steps = json.loads((tmp_path / "bounds-rank0.json").read_text())
    assert set_up[0] == "ok" and set_up[1] > 2, set_up
    assert "Timed out" in steps[0] and 0.5 < steps[1] < 3.5, steps
