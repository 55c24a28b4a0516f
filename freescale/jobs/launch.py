"""`freescale train`: start this node's ranks with torch's elastic launcher (torchrun). One node
stands alone; a job of several nodes runs it on each with --nnodes, --node-rank and node 0's
--rdzv-endpoint. Each node says on stderr when it starts waiting for the others and when all have
joined; one that waits past --rdzv-timeout ends with one line naming the endpoint, and exit 3.

The ranks' progress lines reach the terminal as they come; tracebacks, torchrun's own
logging and its failure report go to the job's log only (--verbose shows everything). A
failed run ends with one line gathering the failed ranks' reasons and naming the log, and
returns the ranks' exit status (2 bad input, 3 environment, 1 anything else), not
torchrun's 1. With --max-restarts N torchrun starts the ranks again after a failure, up to N
times, each time from the newest complete checkpoint; a stop signal (SIGTERM, Ctrl-C) ends the job
as stopped (128 + the signal), never restarted. With --init-from PATH the run is a warm start from
another run's checkpoint or exported model, found and checked here before torchrun starts
(freescale/training/checkpoint/init_source.py). Each rank runs `freescale/jobs/train.py`;
freescale/launch/launcher.py starts torchrun and does the above.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from freescale.runtime import options
from freescale.runtime.options import option
from freescale.training.config import CommMode  # the typed config, no torch
from freescale.launch.launcher import RDZV_TIMEOUT_S  # the launcher's logic, no torch either
from freescale.tracking.store import TRACKING_URI_HELP


CLI = ("cli",)


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """`freescale train` on this node: the shards, its ranks and nodes, and the ranks' run; the pipeline's
    [train] section offers config, max_steps and run_name."""

    SURFACES = ("cli", "pipeline")

    shards: str = option(help="shard directory written by `freescale balance`", surfaces=CLI)
    nproc_per_node: int | None = option(
        None, "ranks to start on this node (default: the manifest's world size over --nnodes)", surfaces=CLI)
    nnodes: int = option(1, "nodes of the job, each running `freescale train` with the same arguments but "
                            "--node-rank (default 1: this machine only)", surfaces=CLI)
    node_rank: int = option(0, "this node, 0 .. nnodes-1; node 0 hosts the rendezvous at --rdzv-endpoint (which "
                               "ranks each node runs is the rendezvous's choice)", surfaces=CLI, show_default=False)
    rdzv_endpoint: str | None = option(None, "HOST:PORT of node 0, where the nodes meet (torchrun's c10d "
                                             "rendezvous); needed with --nnodes > 1", surfaces=CLI)
    rdzv_timeout: int | None = option(None, f"how long the nodes wait for each other at --rdzv-endpoint before the "
                                            f"job ends with exit 3 (default {RDZV_TIMEOUT_S})",
                                      surfaces=CLI, metavar="SECONDS")
    config: str | None = option(None, "TOML config (configs/*.toml)")
    max_steps: int | None = option(None, "stop after N >= 1 steps (default: the config's training.max_steps; "
                                         "0 there = one pass over the shards)")
    tracking_uri: str | None = option(None, TRACKING_URI_HELP, surfaces=CLI)
    run_name: str | None = option(None, "MLflow run name")
    summary_json: str | None = option(None, "write the run summary (and per-step losses) here", surfaces=CLI)
    comm_mode: CommMode | None = option(None, "how the step's collectives run (default: the config's comm.mode, "
                                              "prioritized)", surfaces=CLI)
    init_from: str | None = option(
        None, "warm start: a new run from step 0 with the weights of a checkpoint (a step_<n> folder, or a checkpoint "
              "folder: its newest complete step) or of an exported model folder (`freescale export`), and the "
              "checkpoint's optimizer state; the item table may hold more items (new rows start as a cold start's), "
              "not fewer; ignored when the run resumes its own checkpoint (config: training.init_from)",
        surfaces=CLI, metavar="PATH")
    max_restarts: int = option(0, "start the ranks again up to N times after a failure, each time from the newest "
                                  "complete checkpoint (torchrun's --max-restarts); a stop signal is never restarted",
                               surfaces=CLI, metavar="N")

    def check(self) -> None:
        from freescale.runtime.errors import InputError

        if self.max_steps is not None and self.max_steps < 1:
            raise InputError(f"--max-steps must be a positive integer (omit it for one pass over the shards), "
                             f"got {self.max_steps}")
        if self.max_restarts < 0:
            raise InputError(f"--max-restarts must be 0 or more, got {self.max_restarts}")


def launch(argv: list[str] | None = None) -> int:
    """`freescale train`: start this node's ranks with torch's elastic launcher.

    The ranks' progress lines reach the terminal as they come; tracebacks and torchrun's
    failure report go to the job's log only. A failed run ends with one line per failing
    rank and a last line naming the log, and returns the ranks' exit status (2 bad input,
    3 environment, 1 anything else), not torchrun's 1.
    """
    args, overrides = build_parser().parse_known_args(argv)
    return run(lambda: options.from_values(LaunchSpec, vars(args)), overrides)


def run(spec_of: Callable[[], LaunchSpec], overrides: list[str]) -> int:
    """The training of ``spec_of()`` (built inside the job's error handling), ``overrides`` on its ranks'
    config (``--section.key VALUE``); its exit status. `freescale pipeline` calls it in-process."""
    from freescale.runtime.job_errors import run_job

    return run_job("train", lambda: _launch(spec_of(), overrides))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freescale train", description="train on balanced shards")
    options.add_arguments(parser, LaunchSpec, "cli")
    return parser


def _launch(args: LaunchSpec, overrides: list[str]) -> int:
    """This node's ranks (freescale/launch/launcher.py runs them), after the launch's own checks."""
    from freescale.runtime.errors import InputError
    from freescale.launch import launcher
    from freescale.training.parallel.rank_checks import check_ranks_can_run
    from freescale.launch.resize import replan_settings
    from freescale.training.config import load_config
    from freescale.training.checkpoint.init_source import init_settings

    # Checked here, not by the ranks: starting torchrun and its ranks takes seconds. What is in
    # the folder is the ranks' check (each reads its own files).
    if not Path(args.shards).is_dir():
        raise InputError(f"--shards {args.shards}: no such directory")
    rendezvous = launcher.rendezvous_options(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_timeout)
    nproc = launcher.ranks_per_node(args.shards, args.nproc_per_node, args.nnodes)
    settings = launcher.rank_settings(args.shards, overrides, max_steps=args.max_steps, tracking_uri=args.tracking_uri,
                                      run_name=args.run_name, comm_mode=args.comm_mode, init_from=args.init_from)
    # The ranks' config, checked here first: a bad file, key or value is one line, before torchrun;
    # so is what the ranks would refuse on this machine (their kernel, their tables' optimizer).
    config = load_config(args.config, settings)
    check_ranks_can_run(config)
    # A warm start's source, found and checked here (a missing one, another model): one line, before torchrun.
    settings += init_settings(config)
    # On another world size than the shards', the rest of the checkpoint's epoch is re-planned first.
    settings += replan_settings(args.shards, nproc * args.nnodes, config.checkpoint.folder, config.checkpoint.resume)
    cmd = launcher.torchrun_command(rendezvous, nproc, args.config, args.summary_json, settings, args.max_restarts)
    return launcher.run_ranks(cmd, nproc, args.nnodes, args.rdzv_endpoint, args.rdzv_timeout, args.max_restarts)
