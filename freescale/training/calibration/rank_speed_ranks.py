"""One rank of the rank-speed measurement of `freescale calibrate --rank-speeds-output`
(freescale/launch/rank_speed_launch.py starts them): every rank times the same batches in lock-step;
rank 0 gathers the raw ``[repeats, ranks]`` times into the file the launching process reads.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any


WORKER_FLAG = "--rank-speeds-worker"
"""The flag that makes the calibrate job one rank-speed rank."""
RANK_SPEED_BATCHES = 4
"""Mixed batches each rank times per repeat (identical on every rank)."""


def rank_speeds_worker(argv: list[str], prog: str) -> int:
    """One rank (under torch's launcher): time the same batches as every other rank, in lock-step."""
    import torch
    import torch.distributed as dist

    from freescale.training.calibration.calibrate import (
        caching_malloc,
        heavy_tailed_batches,
        synthetic_batch,
        time_dense_step,
    )
    from freescale.training.config import load_config
    from freescale.training.parallel.distributed import bound_collectives, init_distributed
    from freescale.training.model.recommender import build_dense_model

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--result", required=True)
    parser.add_argument("--config")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--num-items", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    parallel = dataclasses.replace(config.parallel, backend="gloo")
    env = init_distributed(parallel, config.training.threads)

    # Same seed on every rank: identical parameters, batches and negatives, so any
    # difference in time is the rank's, not its work's.
    torch.manual_seed(args.seed)
    model, table = build_dense_model(args.num_items, config.model, precision=config.training.precision)
    model.train()
    max_length = config.model.max_seq_len
    mixes = heavy_tailed_batches(RANK_SPEED_BATCHES, min(16, max_length), max_length, args.seed + 7)
    batches = [synthetic_batch(m, args.num_items, seed=args.seed + i) for i, m in enumerate(mixes)]
    gathered = []
    with caching_malloc():
        for repeat in range(args.warmup + args.repeats):
            if repeat == args.warmup:  # the warm-up repeats' first-call work is done on every rank
                bound_collectives(timedelta(seconds=parallel.collective_timeout_s), env.host_group)
            dist.barrier(group=env.host_group)  # lock-step: every rank starts the repeat together, under the same machine load
            times = [time_dense_step(model, table, b, config.loss.num_negatives, config.loss.full_softmax, seed=i,
                                     loss_kind=config.loss.kind)
                     for i, b in enumerate(batches)]
            local = torch.tensor([sum(t.wall_s for t in times), sum(t.cpu_s for t in times)], dtype=torch.float64)
            everyone = [torch.empty_like(local) for _ in range(env.world_size)]
            dist.all_gather(everyone, local, group=env.host_group)
            if repeat >= args.warmup:
                gathered.append(torch.stack(everyone).tolist())
    hosts: list[Any] = [None] * env.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=env.host_group)
    if env.rank == 0:
        Path(args.result).write_text(json.dumps({
            "wall": [[rank[0] for rank in row] for row in gathered],
            "cpu": [[rank[1] for rank in row] for row in gathered],
            "hosts": hosts, "threads_per_rank": torch.get_num_threads(),
            "batches": [list(m) for m in mixes]}))
    dist.barrier(group=env.host_group)
    dist.destroy_process_group()
    return 0
