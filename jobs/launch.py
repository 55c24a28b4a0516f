"""`freescale train`: start this node's ranks with torch's elastic launcher (torchrun). One node
stands alone; a job of several nodes runs it on each with --nnodes, --node-rank and node 0's
--rdzv-endpoint.

The ranks' progress lines reach the terminal as they come; tracebacks, torchrun's own
logging and its failure report go to the job's log only (--verbose shows everything). A
failed run ends with one line gathering the failed ranks' reasons and naming the log, and
returns the ranks' exit status (2 bad input, 3 environment, 1 anything else), not
torchrun's 1. Each rank runs `jobs/train.py`.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import typing
from pathlib import Path

from jobs.tracking import add_tracking_arguments
from shards.schema import MANIFEST_NAME
from training.config import CommMode


def launch(argv: list[str] | None = None) -> int:
    """`freescale train`: start this node's ranks with torch's elastic launcher.

    The ranks' progress lines reach the terminal as they come; tracebacks and torchrun's
    failure report go to the job's log only. A failed run ends with one line per failing
    rank and a last line naming the log, and returns the ranks' exit status (2 bad input,
    3 environment, 1 anything else), not torchrun's 1.
    """
    from jobs.job_errors import run_job

    return run_job("train", lambda: _launch(argv))


def _launch(argv: list[str] | None) -> int:
    from jobs.job_errors import STATUS_DIR_ENV
    from pipeline import logs
    from pipeline.errors import InputError

    parser = argparse.ArgumentParser(prog="freescale train", description="train on balanced shards")
    parser.add_argument("--shards", required=True, help="shard directory written by `freescale balance`")
    parser.add_argument("--nproc-per-node", type=int,
                        help="ranks to start on this node (default: the manifest's world size over --nnodes)")
    parser.add_argument("--nnodes", type=int, default=1,
                        help="nodes of the job, each running `freescale train` with the same arguments but "
                             "--node-rank (default 1: this machine only)")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="this node's rank, 0 .. nnodes-1; node R runs global ranks R*nproc .. (R+1)*nproc-1")
    parser.add_argument("--rdzv-endpoint",
                        help="HOST:PORT of node 0, where the nodes meet (torchrun's static rendezvous); "
                             "needed with --nnodes > 1")
    parser.add_argument("--config", help="TOML config (configs/*.toml)")
    parser.add_argument("--max-steps", type=int,
                        help="stop after N >= 1 steps (default: the config's training.max_steps; 0 there = one pass "
                             "over the shards)")
    add_tracking_arguments(parser, experiment=False)
    parser.add_argument("--run-name", help="MLflow run name")
    parser.add_argument("--summary-json", help="write the run summary (and per-step losses) here")
    parser.add_argument("--comm-mode", choices=typing.get_args(CommMode),
                        help="how the step's collectives run (default: the config's comm.mode, prioritized)")
    args, overrides = parser.parse_known_args(argv)
    if args.max_steps is not None and args.max_steps < 1:
        raise InputError(f"--max-steps must be a positive integer (omit it for one pass over the shards), "
                         f"got {args.max_steps}")
    # Checked here, not by the ranks: starting torchrun and its ranks takes seconds. What is in
    # the folder is the ranks' check (each reads its own files).
    if not Path(args.shards).is_dir():
        raise InputError(f"--shards {args.shards}: no such directory")
    rendezvous = _rendezvous(args.nnodes, args.node_rank, args.rdzv_endpoint)
    nproc = args.nproc_per_node
    if nproc is None:
        manifest = Path(args.shards) / MANIFEST_NAME
        try:
            world_size = int(json.loads(manifest.read_text())["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            world_size = args.nnodes  # no readable manifest: one rank per node starts and names the problem
        if world_size % args.nnodes:
            raise InputError(f"{manifest} is for {world_size} ranks, which --nnodes {args.nnodes} does not "
                             f"divide: pass --nproc-per-node")
        nproc = world_size // args.nnodes
    if nproc < 1:
        raise InputError(f"--nproc-per-node must be a positive integer, got {nproc}")
    settings = ["--data.shards", args.shards]
    if args.max_steps is not None:
        settings += ["--training.max_steps", str(args.max_steps)]
    if args.tracking_uri:
        settings += ["--tracking.uri", args.tracking_uri]
    if args.run_name:
        settings += ["--tracking.run_name", args.run_name]
    if args.comm_mode:
        settings += ["--comm.mode", args.comm_mode]
    settings += overrides
    # The ranks' config, checked here first: a bad file, key or value is one line, before torchrun.
    from training.config import load_config

    load_config(args.config, settings)
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}",
           "-m", "jobs.train"]
    if args.config:
        cmd += ["--config", args.config]
    if args.summary_json:
        cmd += ["--summary-json", args.summary_json]
    cmd += settings
    log = logs.log_file("train").absolute()
    with tempfile.TemporaryDirectory(prefix="freescale-ranks-") as status_dir:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONUNBUFFERED": "1", logs.LOG_FILE_ENV: str(log), STATUS_DIR_ENV: status_dir}
        if logs.verbose():
            env[logs.VERBOSE_ENV] = "1"
            output = None
            rc = _wait(subprocess.Popen(cmd, env=env))
        else:
            output = RankOutput(log)
            rc = output.run(cmd, env)
        statuses = {}
        for path in Path(status_dir).glob("rank-*"):
            try:
                statuses[int(path.name.split("-", 1)[1])] = int(path.read_text())
            except ValueError:
                continue
    return conclude_ranks(rc, statuses, output, nproc * args.nnodes)


def _rendezvous(nnodes: int, node_rank: int, endpoint: str | None) -> list[str]:
    """torchrun's options for how the nodes meet: one node stands alone; several meet at node 0's
    HOST:PORT in a static rendezvous, where node R's ranks are R*nproc .. (R+1)*nproc-1 (the ranks,
    and so the shards each node reads, do not depend on which node starts first)."""
    from pipeline.errors import InputError

    if nnodes < 1:
        raise InputError(f"--nnodes must be a positive integer, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise InputError(f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}")
    if nnodes == 1:
        if endpoint:
            raise InputError("--rdzv-endpoint is for --nnodes > 1 (one node meets itself)")
        return ["--standalone"]
    host, _, port = (endpoint or "").rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address), "
                         f"got {endpoint or 'none'}")
    return [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=static", f"--rdzv-endpoint={endpoint}"]


def _wait(proc: subprocess.Popen) -> int:
    """torchrun's status. A Ctrl-C reaches torchrun too (one process group); a SIGTERM sent to the
    launcher alone (a scheduler stopping the job) is passed on to torchrun. Either way torchrun
    stops its ranks, which end their runs KILLED, and the launcher keeps reading their output
    until they are gone rather than dying with the pipes."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)


class RankOutput:
    """torchrun's output, sorted line by line: all of it to the log; to the terminal, on the same
    stream, what is not a trace. Our lines (``freescale ...``) reach the terminal, except a rank's
    error line: the ranks' errors are gathered into the launch's one last line. torchrun's own
    logging and library warnings stay in the log, and so does everything after a traceback
    (Python's, faulthandler's, a C++ abort) on that stream."""

    TRACE = re.compile(r"(Traceback \(most recent call last\):|Fatal Python error|Current thread 0x|Thread 0x|"
                       r"terminate called|Exception in thread|\[rank\d+\]:)")
    TORCHRUN_LOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d")  # torch.distributed.elastic's glog-style lines
    # Library warnings: Python's (`file:line: XWarning: ...` and the source line under it) and the
    # logging module's default format (`WARNING:torchrec...:...`).
    WARNING = re.compile(r"(\S+:\d+: \w*Warning: |(WARNING|INFO|DEBUG):[\w.]+:)")
    RANK_ERROR = re.compile(r"freescale train \(rank (\d+)\): error:")
    # An entry of torchrun's ChildFailedError report.
    FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")

    def __init__(self, log: Path):
        self.log_path = log
        self.reported: dict[int, str] = {}  # rank -> the message of its error line
        self.hidden: collections.deque[str] = collections.deque(maxlen=5000)
        self._lock = threading.Lock()

    def run(self, cmd: list[str], env: dict[str, str]) -> int:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8", errors="replace") as self._log:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    errors="replace", bufsize=1)
            pumps = [threading.Thread(target=self._pump, args=(proc.stdout, sys.stdout), daemon=True),
                     threading.Thread(target=self._pump, args=(proc.stderr, sys.stderr), daemon=True)]
            for pump in pumps:
                pump.start()
            rc = _wait(proc)
            for pump in pumps:
                pump.join()
        return rc

    def _pump(self, stream, terminal) -> None:
        in_trace = in_warning = False
        for line in stream:
            reported = self.RANK_ERROR.match(line)
            ours = line.startswith("freescale ")
            if not ours and not in_trace and self.TRACE.match(line):
                in_trace = True
            in_warning = bool(self.WARNING.match(line)) or (in_warning and line.startswith("  "))
            # A rank's error line waits for the launch's last line, which gathers them.
            show = not reported and (ours or not (in_trace or in_warning or self.TORCHRUN_LOG.match(line)))
            with self._lock:
                self._log.write(line)
                self._log.flush()
                if show:
                    terminal.write(line)
                    terminal.flush()
                else:
                    self.hidden.append(line)
                if reported:
                    self.reported[int(reported.group(1))] = line[reported.end():].strip()

    def torchrun_failures(self) -> dict[int, int]:
        """rank -> exit code of the ranks torchrun reported as failed."""
        return {int(rank): int(code) for rank, code in self.FAILURE.findall("".join(self.hidden))}


STOPPED_CODES = {-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT}


def _describe_exit(code: int) -> str:
    if code < 0 or code > 128:
        number = -code if code < 0 else code - 128
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"killed by {name}"
    return f"exited with status {code} before reporting an error"


def conclude_ranks(rc: int, statuses: dict[int, int], output: RankOutput | None, nproc: int) -> int:
    """The launch's exit status from the ranks' own (torchrun only says 1), and its one last line:
    the failed ranks' reasons (once when they agree), naming the log. Under --verbose the ranks
    printed their own lines already, and the last line only counts them."""
    from jobs.job_errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_FAILED, EXIT_OK, error_line

    if rc == 0:
        return EXIT_OK
    # Ranks that stopped on a signal (128 + n: torchrun stopping them after a peer failed, or
    # Ctrl-C) did not fail by themselves.
    failed = {rank: code for rank, code in statuses.items() if 0 < code < 128}
    if output is not None:
        reported = output.torchrun_failures()
        # A rank torchrun stopped (SIGTERM, or SIGINT from a terminal) while a peer had failed is
        # not a failure of its own; one that died of any other signal or status is.
        stopped = {rank for rank, code in reported.items()
                   if code in STOPPED_CODES or statuses.get(rank, 0) >= 128}
        reasons = dict(output.reported)
        for rank, code in sorted(reported.items()):
            if rank in failed or rank in reasons or (rank in stopped and (failed or set(reported) - stopped)):
                continue
            failed[rank] = EXIT_FAILED
            reasons[rank] = _describe_exit(code)
    kinds = set(failed.values())
    code = next((kind for kind in (EXIT_ENVIRONMENT, EXIT_BAD_INPUT) if kind in kinds), EXIT_FAILED)
    if failed:
        ranks = sorted(failed)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        message = f"{who} of {nproc} failed"
        if output is not None:
            said = {rank: reasons[rank] for rank in ranks if rank in reasons}
            if len(set(said.values())) == 1 and len(said) == len(ranks):
                message = f"{next(iter(said.values()))} ({message})"
            elif said:
                message = "; ".join(f"rank {rank}: {reason}" for rank, reason in said.items()) + f" ({message})"
    elif statuses and all(status >= 128 for status in statuses.values() if status):
        message, code = "stopped by a signal", max(statuses.values())
    else:
        message = f"torchrun exited with status {rc}"
    error_line("train", message, details=output is not None)
    return code
