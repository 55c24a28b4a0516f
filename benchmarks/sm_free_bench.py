"""How much does moving bytes slow down a GEMM: SM-kernel copies vs copy-engine copies.

Part (a) has run on one H200 (docs/results/sm_free_bench.md); part (b) needs several GPUs and
is unmeasured.

(a) One GPU (``python -m benchmarks.sm_free_bench``): bf16 GEMM throughput alone, and beside a
    copy of ``--copy-mib`` MiB running concurrently on another stream, one copy kind at a time:

    * ``sm-kernel``: ``dst.copy_(src)`` with ``src`` a strided view (every other row of a
      bigger tensor). ATen copies non-contiguous tensors with an elementwise kernel (only
      contiguous same-dtype copies become ``cudaMemcpyAsync``), so this copy occupies SMs.
    * ``ce-host``: device -> pinned host -> device with ``non_blocking=True``, i.e.
      ``cudaMemcpyAsync`` to/from page-locked memory; host<->device transfers are done by
      the GPU's copy (DMA) engines (CUDA C Programming Guide, "Asynchronous Concurrent
      Execution" / asyncEngineCount). This is the copy-engine reference.
    * ``d2d-memcpy``: contiguous same-device ``copy_`` = ``cudaMemcpyAsync`` device-to-device,
      the copy ``freescale.comm.cuda``'s copy_engine backend uses to pack/unpack its slots. Whether the
      driver runs it on a copy engine or a kernel is not documented; this row measures it.
    * ``ce-peer`` (only with two GPUs with peer access in this process): ``copy_`` from
      cuda:0 to cuda:1, ``cudaMemcpyAsync`` between peers (copy engines over NVLink/PCIe).

    A GEMM slows down beside a copy both because the copy takes SMs and because it takes HBM
    bandwidth. ``sm-kernel`` and ``d2d-memcpy`` move the same HBM bytes, so their difference
    is the SM part; ``ce-host`` is bounded by PCIe and moves far fewer HBM bytes per second.

(b) Several GPUs (``torchrun --nproc-per-node N -m benchmarks.sm_free_bench --multi``): the
    embedding all-to-all (rows of ``--dim`` floats, uneven splits around ``--rows-per-peer``)
    through ``freescale.comm.backend.build_backend("nccl" | "copy_engine")``, alone and beside the same
    GEMM on the caller's stream, reporting GEMM slowdown and all-to-all time.

Every number is the median of ``--repeats`` (>= 5) with [min, max]; conditions are
interleaved within each repeat so drift hits all alike, and every ratio is against the
GEMM-alone baseline measured in the same run. Tables are markdown. Budget: well under
5 minutes on one H100/H200-class GPU with the defaults.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
from datetime import timedelta
from typing import Callable

import torch

from benchmarks.common import spread

NO_GPU = "sm_free_bench: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--multi", action="store_true", help="(b): all-to-all beside GEMM, under torchrun")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--gemm-n", type=int, default=8192, help="square bf16 GEMM size")
    p.add_argument("--gemms", type=int, default=20, help="GEMMs per timed batch")
    p.add_argument("--copy-mib", type=int, default=256, help="(a) bytes per copy, MiB")
    p.add_argument("--rows-per-peer", type=int, default=16384, help="(b) mean rows sent to each peer")
    p.add_argument("--dim", type=int, default=128, help="(b) floats per row (embedding dim)")
    args = p.parse_args(argv)
    if args.repeats < 5:
        p.error("--repeats must be >= 5")
    return args


def slowdown(times: list[float], base: list[float]) -> str:
    """Median GEMM time vs the same run's GEMM-alone median, in percent (with min/max ratios)."""
    b = statistics.median(base)
    pct = [100 * (t / b - 1) for t in times]
    return f"{100 * (statistics.median(times) / b - 1):+.1f}% [{min(pct):+.1f}, {max(pct):+.1f}]"


class Gemm:
    """A batch of bf16 GEMMs on the current stream, timed with CUDA events."""

    def __init__(self, n: int, count: int, device: torch.device):
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        self.c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        self.flops = 2 * n ** 3 * count
        self.count = count

    def enqueue(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.count):
            torch.mm(self.a, self.b, out=self.c)
        end.record()
        return start, end


def copy_kinds(nbytes: int, device: torch.device) -> dict[str, tuple[Callable[[], object], int, str]]:
    """name -> (enqueue one copy on the current stream, bytes moved per copy, engine); ``device`` is cuda:0."""
    cols = 4096
    rows = max(1, nbytes // (cols * 4))
    kinds = {}
    wide = torch.randn(rows, 2 * cols, device=device)
    strided, dst = wide[:, :cols], torch.empty(rows, cols, device=device)  # row stride 2*cols: not contiguous
    kinds["sm-kernel"] = (lambda: dst.copy_(strided), dst.numel() * 4, "SM (elementwise copy kernel)")
    src = torch.randn(rows, cols, device=device)
    host = torch.empty(rows, cols, pin_memory=True)
    back = torch.empty_like(src)

    def host_round_trip():
        host.copy_(src, non_blocking=True)
        back.copy_(host, non_blocking=True)
    kinds["ce-host"] = (host_round_trip, 2 * src.numel() * 4, "copy engine (pinned D2H + H2D cudaMemcpyAsync)")
    d2d = torch.empty_like(src)
    kinds["d2d-memcpy"] = (lambda: d2d.copy_(src), src.numel() * 4, "cudaMemcpyAsync D2D (engine: measured here)")
    if torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1):
        other = torch.device("cuda", 1)
        peer = torch.empty(rows, cols, device=other)
        kinds["ce-peer"] = (lambda: peer.copy_(src, non_blocking=True), src.numel() * 4,
                            f"copy engine (peer cudaMemcpyAsync to {other})")
    return kinds


def single_gpu(args: argparse.Namespace) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    gemm = Gemm(args.gemm_n, args.gemms, device)
    kinds = copy_kinds(args.copy_mib << 20, device)
    side = torch.cuda.Stream()

    def timed_gemm() -> float:
        start, end = gemm.enqueue()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def timed_copies(enqueue, count: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            for _ in range(count):
                enqueue()
            end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    for _ in range(3):  # warm up cuBLAS, the copy paths and the clocks
        timed_gemm()
        for enqueue, _, _ in kinds.values():
            timed_copies(enqueue, 2)
    gemm_ms = statistics.median(timed_gemm() for _ in range(3))
    # Enough copies back to back to cover the whole GEMM batch, so the GEMM never runs alone.
    counts = {k: max(1, min(4096, math.ceil(1.2 * gemm_ms / timed_copies(e, 1)))) for k, (e, _, _) in kinds.items()}

    alone: list[float] = []
    beside: dict[str, list[float]] = {k: [] for k in kinds}
    copy_gbs: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        alone.append(timed_gemm())
        for k, (enqueue, nbytes, _) in kinds.items():
            # GEMMs first, copies issued from the side stream right after: they start while the
            # GEMMs run and (counts) outlast them, so no GEMM runs alone.
            g0, g1 = gemm.enqueue()
            c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                c0.record()
                for _ in range(counts[k]):
                    enqueue()
                c1.record()
            torch.cuda.synchronize()
            beside[k].append(g0.elapsed_time(g1))
            copy_gbs[k].append(nbytes * counts[k] / (c0.elapsed_time(c1) * 1e-3) / 1e9)

    def tflops(ms: list[float]) -> list[float]:
        return [gemm.flops / (t * 1e-3) / 1e12 for t in ms]

    print(f"## (a) one GPU: {torch.cuda.get_device_name(device)}, bf16 GEMM {args.gemm_n}^3 x {args.gemms}, "
          f"copies of {args.copy_mib} MiB, {args.repeats} repeats (median [min, max])\n")
    print("| beside the GEMM | copy engine | GEMM TFLOP/s | GEMM slowdown vs alone | copy GB/s |")
    print("|---|---|---|---|---|")
    print(f"| nothing (baseline) | - | {spread(tflops(alone), '.1f')} | +0.0% | - |")
    for k, (_, _, engine) in kinds.items():
        print(f"| {k} x{counts[k]} | {engine} | {spread(tflops(beside[k]), '.1f')} | {slowdown(beside[k], alone)} "
              f"| {spread(copy_gbs[k], '.1f')} |")
    print("\nce-host counts bytes both ways (D2H + H2D) and is bounded by PCIe, so it also moves far fewer "
          "HBM bytes per second than the others; sm-kernel vs d2d-memcpy compare SM use at equal HBM traffic. "
          "UNMEASURED until this table has been produced on a GPU machine and recorded.")


def split_matrix(world: int, mean: int, seed: int = 0) -> list[list[int]]:
    """rows[r][q] sent by rank r to rank q: uneven (+-25%), identical on every rank (same seed)."""
    rng = random.Random(seed)
    return [[int(mean * rng.uniform(0.75, 1.25)) for _ in range(world)] for _ in range(world)]


def multi_gpu(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from freescale.comm.backend import BackendUnavailable, build_backend

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    timeout = timedelta(seconds=120)
    dist.init_process_group("nccl", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    splits = split_matrix(world, args.rows_per_peer)
    input_splits = splits[rank]
    output_splits = [splits[p][rank] for p in range(world)]
    inp = torch.randn(sum(input_splits), args.dim, device=device)
    out = torch.empty(sum(output_splits), args.dim, device=device)
    gemm = Gemm(args.gemm_n, args.gemms, device)
    issuer, probe = torch.cuda.Stream(), torch.cuda.Stream()

    backends, groups, unavailable = {}, {}, {}
    for name in ("nccl", "copy_engine"):
        try:
            backends[name] = build_backend(name, timeout)
            groups[name] = backends[name].new_group("embedding", high_priority=True)
        except BackendUnavailable as error:
            unavailable[name] = str(error)
            backends.pop(name, None)

    def exchange(name: str, count: int):
        """Issue ``count`` back-to-back all-to-alls from the exchange stream (as the trainer's
        exchange would, beside compute on another stream); events around them, the end one on a
        probe stream so no working stream waits for the exchange."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(issuer):
            start.record()
            works = [backends[name].all_to_all(out, inp, output_splits, input_splits, groups[name])
                     for _ in range(count)]
        with torch.cuda.stream(probe):
            works[-1].wait()  # all-to-alls on one group run in order: the last one lands last
            end.record(probe)
        return start, end

    def settle() -> None:
        torch.cuda.synchronize()
        dist.barrier()  # ranks start each measurement together, so no rank times a peer's lateness

    def gemm_alone() -> float:
        g0, g1 = gemm.enqueue()
        settle()
        return g0.elapsed_time(g1)

    def a2a_alone(name: str) -> float:
        start, end = exchange(name, 1)
        settle()
        return start.elapsed_time(end)

    def a2a_beside_gemm(name: str, count: int) -> tuple[float, float]:
        """(GEMM batch ms, ms per all-to-all): GEMMs enqueued first, the all-to-alls issued right
        after so they start while the GEMMs run (counts make them outlast the GEMMs)."""
        g0, g1 = gemm.enqueue()
        start, end = exchange(name, count)
        settle()
        return g0.elapsed_time(g1), start.elapsed_time(end) / count

    for _ in range(3):  # warm up cuBLAS, the communicators and the symmetric buffers
        gemm_alone()
        for name in backends:
            a2a_alone(name)
    gemm_ms = statistics.median(gemm_alone() for _ in range(3))
    # Enough all-to-alls to cover the GEMM batch (capped: a slow backend must not blow the budget).
    counts = {n: max(1, min(64, math.ceil(1.2 * gemm_ms / statistics.median(a2a_alone(n) for _ in range(3)))))
              for n in backends}

    base: list[float] = []
    a2a_alone_ms = {n: [] for n in backends}
    gemm_beside = {n: [] for n in backends}
    a2a_beside_ms = {n: [] for n in backends}
    for _ in range(args.repeats):
        base.append(gemm_alone())
        for n in backends:
            a2a_alone_ms[n].append(a2a_alone(n))
            g, a = a2a_beside_gemm(n, counts[n])
            gemm_beside[n].append(g)
            a2a_beside_ms[n].append(a)

    # The slowest rank sets the step: report each backend's worst GEMM slowdown over ranks too.
    worst = {}
    for n in backends:
        mine = statistics.median(gemm_beside[n]) / statistics.median(base) - 1
        t = torch.tensor([mine], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst[n] = 100 * float(t.item())
    if rank == 0:
        mib = sum(input_splits) * args.dim * 4 / 2**20
        print(f"## (b) {world} GPUs ({torch.cuda.get_device_name(device)}): embedding all-to-all, rows of "
              f"{args.dim} float32, ~{args.rows_per_peer} rows per peer (uneven), {mib:.1f} MiB sent by rank 0; "
              f"bf16 GEMM {args.gemm_n}^3 x {args.gemms}; {args.repeats} repeats, rank 0 (median [min, max])\n")
        print("| backend | path | all-to-all alone, ms | all-to-all beside GEMM, ms | GEMM slowdown vs alone "
              "(rank 0) | worst rank |")
        print("|---|---|---|---|---|---|")
        print(f"| none (GEMM alone) | - | - | - | +0.0% (GEMM {spread(base, '.2f')} ms) | - |")
        for n in backends:
            print(f"| {n} x{counts[n]} | {backends[n].path} | {spread(a2a_alone_ms[n], '.3f')} | "
                  f"{spread(a2a_beside_ms[n], '.3f')} | {slowdown(gemm_beside[n], base)} | {worst[n]:+.1f}% |")
        for n, line in unavailable.items():
            print(f"| {n} | unavailable: {line} | - | - | - | - |")
        print("\nUNMEASURED until this table has been produced on a GPU machine and recorded.")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 1
    if args.multi:
        multi_gpu(args)
    else:
        single_gpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
