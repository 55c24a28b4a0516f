"""freescale.comm.cuda: the nccl and copy_engine backends, and benchmarks/sm_free_bench.py.

The CUDA tests (marked ``needs a CUDA GPU``) skip on a machine without one; they have not
run yet (UNMEASURED: freescale/comm/cuda.py was written without a GPU). The CPU tests check what a
CPU machine must see: one line naming what is missing, never a quiet fall back.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from freescale.comm import cuda
from freescale.comm.backend import BackendUnavailable, build_backend

REPO = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "benchmarks.sm_free_bench"]  # run from the repository root
NO_GPU_LINE = "sm_free_bench: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured"
CUDA_BACKENDS = ("nccl", "copy_engine")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA reports")


# ---- CPU: what a machine without CUDA sees ----------------------------------------------------

@pytest.mark.spawns
def test_import_makes_no_cuda_call():
    code = "import torch, freescale.comm.cuda; print(torch.cuda.is_initialized())"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@cpu_only
@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_build_backend_without_cuda_is_one_line_naming_cuda(name):
    with pytest.raises(BackendUnavailable) as raised:
        build_backend(name, timedelta(seconds=5))
    message = str(raised.value)
    assert "\n" not in message
    assert message == f"comm.backend {name} needs CUDA: torch.cuda.is_available() is False on this machine"


@pytest.mark.spawns
@cpu_only
@pytest.mark.parametrize("extra", [[], ["--multi"]])
def test_bench_without_cuda_exits_with_one_line(extra):
    done = subprocess.run([*BENCH, *extra], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert (done.stdout + done.stderr).strip() == NO_GPU_LINE


def test_copy_engine_across_nodes_is_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(BackendUnavailable) as raised:
        cuda._require_one_node()
    assert str(raised.value) == ("comm.backend copy_engine needs all ranks on one node (copy engines reach other "
                                 "GPUs only by peer access): world size 16, 8 ranks on this node")


def test_zero_cta_needs_nccl_2_28():
    assert cuda._zero_cta_missing((2, 21, 5), None) == "NCCL >= 2.28 (this torch has NCCL 2.21.5)"


@cpu_only
def test_copy_engine_with_neither_path_names_both(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(BackendUnavailable) as raised:
        cuda._build_copy_engine(timedelta(seconds=5), (2, 21, 5))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("comm.backend copy_engine needs NCCL >= 2.28 (this torch has NCCL 2.21.5), or "
                              "symmetric-memory peer copies (torch.distributed._symmetric_memory set_backend('CUDA') "
                              "failed: ")


def test_slot_sizes_are_powers_of_two_with_a_floor():
    assert cuda.slot_bytes_for(0) == cuda.MIN_SLOT_BYTES
    assert cuda.slot_bytes_for(cuda.MIN_SLOT_BYTES) == cuda.MIN_SLOT_BYTES
    assert cuda.slot_bytes_for(cuda.MIN_SLOT_BYTES + 1) == 2 * cuda.MIN_SLOT_BYTES
    assert cuda._offsets([3, 0, 2]) == [0, 3, 3]


class _FakeWork:
    """A torch.distributed work whose GPU part finishes when the test says so."""

    def __init__(self):
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_nccl_work_on_complete_waits_for_the_gpu_not_the_enqueue():
    fake = _FakeWork()
    fired = threading.Event()
    cuda.NcclWork(fake).on_complete(fired.set)
    time.sleep(0.05)
    assert not fired.is_set()  # a NCCL future would already be done here (done = enqueued)
    fake.done = True
    assert fired.wait(5)


def test_poller_survives_a_failing_callback():
    fired = threading.Event()
    cuda._POLLER.add(lambda: True, lambda: 1 / 0)
    cuda._POLLER.add(lambda: True, fired.set)
    assert fired.wait(5)


# ---- CUDA: the backends on the GPUs this machine has -------------------------------------------

def _rows(sender: int, receiver: int, count: int, dim: int) -> torch.Tensor:
    """Rows that say who sent them to whom, and which they were (exact in float32)."""
    base = sender * 1_000_000 + receiver * 10_000
    return (base + torch.arange(count, dtype=torch.float32)).unsqueeze(1).repeat(1, dim)


def _check_exchange(backend, group, rank: int, world: int, rows: int, dim: int) -> None:
    input_splits = [rows + rank + q for q in range(world)]  # uneven: each pair differs
    output_splits = [rows + p + rank for p in range(world)]
    inp = torch.cat([_rows(rank, q, n, dim) for q, n in enumerate(input_splits)]).cuda()
    out = torch.full((sum(output_splits), dim), -1.0, device="cuda")
    expected = torch.cat([_rows(p, rank, n, dim) for p, n in enumerate(output_splits)]).cuda()
    for _ in range(2):  # the second call reuses the slots of the first
        out.fill_(-1.0)
        work = backend.all_to_all(out, inp, output_splits, input_splits, group)
        fired = threading.Event()
        work.on_complete(fired.set)
        work.wait()
        assert torch.equal(out, expected)
        assert fired.wait(60)
        assert work.is_completed()


def _backend_worker(rank: int, world: int, name: str, init_file: str) -> None:
    os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(world)
    torch.cuda.set_device(rank)
    timeout = timedelta(seconds=60)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timeout)
    try:
        backend = build_backend(name, timeout)
        embedding = backend.new_group("embedding", high_priority=True)
        dense = backend.new_group("dense")
        _check_exchange(backend, embedding, rank, world, rows=5, dim=3)
        _check_exchange(backend, embedding, rank, world, rows=2048, dim=256)  # 2 MiB per peer: slots grow
        grads = torch.full((7,), float(rank + 1), device="cuda")
        backend.all_reduce(grads, dense).wait()
        assert torch.equal(grads, torch.full((7,), world * (world + 1) / 2, device="cuda"))
        path = backend.path
        assert "\n" not in path
        if name == "nccl":
            assert path.startswith("nccl SM kernels (NCCL ") and "embedding group" in path
        else:
            assert path.startswith("copy_engine: ")
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@needs_gpu
@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_backend_all_to_all_and_all_reduce_on_the_gpus(name, tmp_path):
    world = min(2, torch.cuda.device_count())  # one rank is enough on a one-GPU machine
    mp.spawn(_backend_worker, args=(world, name, str(tmp_path / "pg")), nprocs=world, join=True)


@needs_gpu
def test_bench_single_gpu_prints_its_table():
    done = subprocess.run([*BENCH, "--repeats", "5", "--gemm-n", "2048", "--gemms", "4",
                           "--copy-mib", "16"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "| nothing (baseline) |" in done.stdout and "| sm-kernel x" in done.stdout
