"""How `freescale train` (freescale/jobs/launch.py) runs this node's ranks: torch's elastic launcher (torchrun)
started as a child process, the rendezvous with the other nodes told on stderr while it waits, the
ranks' output sorted between the terminal and the job's log, stop signals passed on, and the ranks'
exit statuses gathered into the launch's one last line and exit status.

No torch here: the launcher's own process never imports it (its ranks do, in their processes).
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from freescale.shards.schema import MANIFEST_NAME

# How long the nodes wait for each other by default: torchrun's own for its static rendezvous
# (LaunchConfig's rdzv_configs["timeout"]), kept for the c10d rendezvous, whose own is 600.
RDZV_TIMEOUT_S = 900


def rendezvous_options(nnodes: int, node_rank: int, endpoint: str | None, timeout_s: int | None) -> list[str]:
    """torchrun's options for how the nodes meet: one node stands alone; several meet at node 0's
    HOST:PORT in torchrun's c10d rendezvous, whose store node 0 hosts there. c10d, not static: a
    node whose ranks restart (--max-restarts) meets the others again in a new round. The rendezvous
    gives each node its ranks (by host name and launcher PID, not --node-rank), so which node runs
    rank 0 is its choice; each rank reads its own shard wherever it runs."""
    from freescale.runtime.errors import InputError

    if nnodes < 1:
        raise InputError(f"--nnodes must be a positive integer, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise InputError(f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}")
    if nnodes == 1:
        if endpoint:
            raise InputError("--rdzv-endpoint is for --nnodes > 1 (one node meets itself)")
        if timeout_s is not None:
            raise InputError("--rdzv-timeout is for --nnodes > 1 (one node waits for no other)")
        return ["--standalone"]
    host, _, port = (endpoint or "").rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address), "
                         f"got {endpoint or 'none'}")
    if timeout_s is not None and timeout_s < 1:
        raise InputError(f"--rdzv-timeout must be a positive number of seconds, got {timeout_s}")
    # Always given, so that the timeout the nodes' lines name is the one torchrun applies: to the
    # join, and to a node's wait for node 0's store (read_timeout; 60 s by default).
    timeout = timeout_s or RDZV_TIMEOUT_S
    return [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-conf=join_timeout={timeout},read_timeout={timeout},is_host={int(node_rank == 0)}"]


def ranks_per_node(shards: str, nproc_per_node: int | None, nnodes: int) -> int:
    """--nproc-per-node, or the manifest's world size over --nnodes."""
    from freescale.runtime.errors import InputError

    nproc = nproc_per_node
    if nproc is None:
        manifest = Path(shards) / MANIFEST_NAME
        try:
            world_size = int(json.loads(manifest.read_text())["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            world_size = nnodes  # no readable manifest: one rank per node starts and names the problem
        if world_size % nnodes:
            raise InputError(f"{manifest} is for {world_size} ranks, which --nnodes {nnodes} does not "
                             f"divide: pass --nproc-per-node")
        nproc = world_size // nnodes
    if nproc < 1:
        raise InputError(f"--nproc-per-node must be a positive integer, got {nproc}")
    return nproc


def rank_settings(shards: str, overrides: list[str], *, max_steps: int | None = None, tracking_uri: str | None = None,
                  run_name: str | None = None, comm_mode: str | None = None, init_from: str | None = None) -> list[str]:
    """The ranks' config overrides: the launcher's options as config keys, then the user's own."""
    settings = ["--data.shards", shards]
    if max_steps is not None:
        settings += ["--training.max_steps", str(max_steps)]
    if init_from is not None:
        settings += ["--training.init_from", init_from]
    if tracking_uri:
        settings += ["--tracking.uri", tracking_uri]
    if run_name:
        settings += ["--tracking.run_name", run_name]
    if comm_mode:
        settings += ["--comm.mode", comm_mode]
    return settings + overrides


def torchrun_command(rendezvous: list[str], nproc: int, config: str | None, summary_json: str | None,
                     settings: list[str], max_restarts: int = 0) -> list[str]:
    """torchrun's command line: this node's `nproc` ranks of `freescale/jobs/train.py`, with the ranks' settings,
    started again up to `max_restarts` times after a failure (each time from the newest checkpoint)."""
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}", *restarts,
           "-m", "freescale.jobs.train"]
    return cmd + (["--config", config] if config else []) + (
        ["--summary-json", summary_json] if summary_json else []) + settings


def run_ranks(cmd: list[str], nproc: int, nnodes: int, endpoint: str | None, timeout_s: int | None,
              max_restarts: int = 0) -> int:
    """Run torchrun's `cmd` (this node's `nproc` ranks of a job of `nnodes`, meeting at `endpoint`,
    restarted up to `max_restarts` times); the launch's exit status, after its one last line where it
    failed or was stopped."""
    rc, statuses, output, waiting, stopped = _run_torchrun(cmd, nnodes, endpoint, timeout_s, max_restarts)
    if waiting and waiting.failed(rc, statuses, output):
        return waiting.conclude(rc, output)
    if stopped is None:
        return conclude_ranks(rc, statuses, output, nproc * nnodes)
    code = conclude_stop(stopped, output)
    _pass_on_stop(stopped)
    return code


def conclude_stop(signum: int, output: RankOutput | None) -> int:
    """A stop signal reached the launcher (a scheduler's SIGTERM, Ctrl-C): the job was stopped, not
    failed, whatever the ranks said as they went (a rank whose peer the stop ended first fails in
    their collective); never restarted (torchrun stops at a signal of its own). 128 + the signal."""
    from freescale.runtime.job_errors import error_line

    error_line("train", f"stopped by {signal.Signals(signum).name}", details=output is not None)
    return 128 + signum


def _pass_on_stop(signum: int) -> None:
    """A SIGTERM the launcher took from its caller while torchrun ran goes on to the caller's own
    handler (`freescale pipeline`'s, freescale/runtime/stops.py), which ends the caller as stopped too. (Ctrl-C
    reached the caller's handler itself: the launcher never takes SIGINT.)"""
    handler = signal.getsignal(signum)
    if signum == signal.SIGTERM and callable(handler):
        handler(signum, None)


def _run_torchrun(cmd: list[str], nnodes: int, endpoint: str | None, timeout_s: int | None, max_restarts: int):
    """torchrun's status, the ranks' own statuses, its sorted output (None under --verbose: the
    terminal has it all), the wait for the other nodes (None for one node) and the stop signal the
    launcher received (None when none)."""
    from freescale.runtime.job_errors import STATUS_DIR_ENV
    from freescale.runtime import logs

    log = logs.log_file("train").absolute()
    with tempfile.TemporaryDirectory(prefix="freescale-ranks-") as status_dir:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONUNBUFFERED": "1", logs.LOG_FILE_ENV: str(log), STATUS_DIR_ENV: status_dir}
        if nnodes > 1:
            # Across nodes, a store of the ranks' own for each attempt: the agents' shared store keeps
            # the last attempt's keys (a restarted rank read a dead peer's address: "Gloo
            # connectFullMesh failed ... Connection refused"), and the nodes' agents count their
            # restarts apart, so no attempt number names the keys alike on every node. One node's
            # ranks share its agent's store, keys under the attempt (parallel/distributed.py):
            # their own store would bind a port torchrun picked seconds before, which another
            # job on the machine can take meanwhile (EADDRINUSE).
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if logs.verbose():
            env[logs.VERBOSE_ENV] = "1"
            output = None
            waiting = _waiting(nnodes, endpoint, timeout_s, _say)
            proc = subprocess.Popen(cmd, env=env)
            if waiting:
                waiting.start(proc)
            rc, stopped = _wait(proc, waiting.stop if waiting else None)
            if waiting:
                waiting.finish()
        else:
            output = RankOutput(log, status_dir, nnodes, max_restarts)
            waiting = _waiting(nnodes, endpoint, timeout_s, output.say)
            rc, stopped = output.run(cmd, env, waiting)
        statuses = {}
        for path in Path(status_dir).glob("rank-*"):
            try:
                statuses[int(path.name.split("-", 1)[1])] = int(path.read_text())
            except ValueError:
                continue
    return rc, statuses, output, waiting, stopped


def _waiting(nnodes: int, endpoint: str | None, timeout_s: int | None,
             say: Callable[[str], None]) -> RendezvousWait | None:
    """The wait for the other nodes, for a job of several."""
    if nnodes == 1:
        return None
    return RendezvousWait(endpoint, nnodes, timeout_s or RDZV_TIMEOUT_S, say)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# How long a SIGTERM the launcher received waits for torchrun to say it got one too (sent to the
# whole process group) before the launcher passes it on (sent to the launcher alone).
FORWARD_WAIT_S = 3.0


def _wait(proc: subprocess.Popen, on_stop: Callable[[int], None] | None = None,
          torchrun_stopping: threading.Event | None = None) -> tuple[int, int | None]:
    """torchrun's status, and the stop signal received meanwhile (None when none). A Ctrl-C reaches
    torchrun too (one process group); a SIGTERM sent to the launcher alone (a scheduler stopping
    the job) is passed on to torchrun. Either way torchrun stops its ranks, which end their runs
    KILLED, and the launcher keeps reading their output until they are gone rather than dying with
    the pipes. `on_stop(signum)` hears of either first: a node still waiting for the others stops
    torchrun itself.

    Passed on only where torchrun did not get the signal itself (`torchrun_stopping`, set when it
    says so, waited for FORWARD_WAIT_S): a second SIGTERM cuts torchrun's stopping of its ranks
    short (each signal raises in its main thread), leaving ranks that never heard of the stop to
    fail when their stopped peers are gone."""
    received: list[int] = []

    def forward() -> None:
        if torchrun_stopping is None or not torchrun_stopping.wait(FORWARD_WAIT_S):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def stop(signum: int) -> None:
        first = not received
        received.append(signum)
        if on_stop is not None:
            on_stop(signum)
        if signum == signal.SIGTERM and first:
            threading.Thread(target=forward, name="forward-sigterm", daemon=True).start()

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop(signum))
    try:
        while True:
            try:
                return proc.wait(), (received[0] if received else None)
            except KeyboardInterrupt:
                stop(signal.SIGINT)
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)


def _has_children(pid: int) -> bool | None:
    """Whether process `pid` has started a process; None where /proc cannot tell (not Linux)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            return True
    return False


class RendezvousWait:
    """This node's wait for the others at node 0's endpoint, told on stderr: one line when it
    starts, one when every node has joined.

    torchrun starts this node's ranks only once every node has joined (the rendezvous gives out
    ranks from all nodes' reports), so its first child process is the sign. Past the timeout
    torchrun gives up by itself (seconds late: its imports, the rendezvous's closing); should it
    not, past the timeout and GRACE_S this stops torchrun itself (before the join it has no ranks
    to leave behind)."""

    POLL_S = 0.5
    # Counted from torchrun's start, before its imports (seconds on a busy machine): torchrun's own
    # timeout, which counts from its rendezvous's start, must come first to say which it was.
    GRACE_S = 20
    # What torchrun says when it gives up: the rendezvous did not complete in time (it names no
    # count), or this node's store client failed to reach node 0's store.
    INCOMPLETE = re.compile(r"RendezvousTimeoutError")
    UNANSWERED = re.compile(r"failed to connect/validate to host|timed out after \d+ms while trying to connect to")
    # c10d's errors (a port in use, a host that does not resolve): the machine's or the network's.
    DIST_ERROR = re.compile(r"^torch\.distributed\.(Dist\w*Error): (.+)$", re.M)

    def __init__(self, endpoint: str, nnodes: int, timeout_s: int, say: Callable[[str], None]):
        self.endpoint = endpoint
        self.nnodes = nnodes
        self.timeout_s = timeout_s
        self.say = say
        self.joined = False
        self.gave_up = False  # this stopped torchrun at the timeout
        self.stopped_by: int | None = None  # the signal that stopped the wait
        self._done = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self, proc: subprocess.Popen) -> None:
        self._proc = proc
        self.say(f"freescale train: waiting for {self.nnodes} nodes at {self.endpoint}, up to {self.timeout_s} s")
        self._watch = threading.Thread(target=self._until_joined, daemon=True)
        self._watch.start()

    def _until_joined(self) -> None:
        started = time.monotonic()
        deadline = started + self.timeout_s + self.GRACE_S
        while not self._done.wait(self.POLL_S):
            children = _has_children(self._proc.pid)
            if children is None:  # no way to tell: no join line, and no deadline that could stop a running job
                return
            if children:
                self.joined = True
                self.say(f"freescale train: all {self.nnodes} nodes joined at {self.endpoint} after "
                         f"{time.monotonic() - started:.0f} s")
                return
            if time.monotonic() > deadline:
                self.gave_up = True
                self._proc.send_signal(signal.SIGTERM)
                return

    def stop(self, signum: int) -> None:
        """A Ctrl-C or SIGTERM during the wait. torchrun's store ignores Ctrl-C until its timeout;
        before the join a SIGTERM ends it at once."""
        if self.joined:
            return
        self.stopped_by = signum
        self._proc.send_signal(signal.SIGTERM)  # at once: no ranks yet whose stopping a second one could cut short

    def finish(self) -> None:
        """torchrun has exited: the watch ends, and has said what it had to before the last line."""
        self._done.set()
        if self._watch is not None:
            self._watch.join()

    def failed(self, rc: int, statuses: dict[int, int], output: RankOutput | None) -> bool:
        """torchrun ended before the nodes met: no rank started (none left a status, torchrun
        reported none), the join not seen."""
        ranks_ran = statuses or (output is not None and output.torchrun_failures())
        return rc != 0 and not self.joined and not ranks_ran

    def conclude(self, rc: int, output: RankOutput | None) -> int:
        """The job's last line and exit status for a rendezvous that did not complete."""
        from freescale.runtime.job_errors import error_line

        if self.stopped_by is not None:
            name = signal.Signals(self.stopped_by).name
            error_line("train", f"stopped by {name} while waiting for {self.nnodes} nodes at {self.endpoint}",
                       details=False)
            return 128 + self.stopped_by
        said = "".join(output.hidden) if output is not None else ""
        reason, code = self._reason(rc, said)
        error_line("train", f"rendezvous at {self.endpoint} {reason}", details=output is not None)
        return code

    def _reason(self, rc: int, said: str) -> tuple[str, int]:
        """Why the nodes did not meet, from what torchrun said (`said`), and the exit status: 3 where
        the network or another node is the cause."""
        from freescale.runtime.job_errors import EXIT_ENVIRONMENT, EXIT_FAILED

        timed_out = f"timed out after {self.timeout_s} s"
        if self.UNANSWERED.search(said):
            return f"{timed_out}: node 0 did not answer there", EXIT_ENVIRONMENT
        if self.INCOMPLETE.search(said) or self.gave_up:
            return f"{timed_out}: not all {self.nnodes} nodes joined", EXIT_ENVIRONMENT
        errors = self.DIST_ERROR.findall(said)
        if errors:
            return f"failed: {errors[-1][0]}: {errors[-1][1].strip()}", EXIT_ENVIRONMENT
        return f"failed: torchrun exited with status {rc} before the {self.nnodes} nodes met", EXIT_FAILED


class RankOutput:
    """torchrun's output, sorted line by line: all of it to the log; to the terminal, on the same
    stream, what is not a trace. Our lines (``freescale ...``) reach the terminal, except a rank's
    error line: the ranks' errors are gathered into the launch's one last line. torchrun's own
    logging and library warnings stay in the log, and so does everything after a traceback
    (Python's, faulthandler's, a C++ abort) on that stream."""

    TRACE = re.compile(r"(Traceback \(most recent call last\):|Fatal Python error|Current thread 0x|Thread 0x|"
                       r"terminate called|Exception in thread|\[rank\d+\]:)")
    # torch.distributed.elastic's glog-style lines, and c10d's (C++) in brackets
    TORCHRUN_LOG = re.compile(r"\[?[IWEF]\d{4} \d\d:\d\d:\d\d")
    # The stack c10d logs under a C++ warning or error (a store client's retry), up to a blank line.
    CPP_STACK = re.compile(r"Exception raised from ")
    CPP_FRAME = re.compile(r"(frame #\d+: |<omitting python frames>)")
    # Library warnings: Python's (`file:line: XWarning: ...` and the source line under it) and the
    # logging module's default format (`WARNING:torchrec...:...`).
    WARNING = re.compile(r"(\S+:\d+: \w*Warning: |(WARNING|INFO|DEBUG):[\w.]+:)")
    RANK_ERROR = re.compile(r"freescale train \(rank (\d+)\): error:")
    # torchrun's word that a stop signal reached it (it stops its ranks and ends).
    STOPPING = re.compile(r"Received \d+ death signal")
    # torchrun's report of an attempt that failed on this node: its first failed rank (local) and how.
    ATTEMPT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
    # An entry of torchrun's ChildFailedError report.
    FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")

    def __init__(self, log: Path, status_dir: str | None = None, nnodes: int = 1, max_restarts: int = 0):
        self.log_path = log
        self.status_dir, self.nnodes, self.restarts_left = status_dir, nnodes, max_restarts
        self.reported: dict[int, str] = {}  # rank -> the message of its error line
        self.torchrun_stopping = threading.Event()
        self.hidden: collections.deque[str] = collections.deque(maxlen=5000)
        self._lock = threading.Lock()

    def run(self, cmd: list[str], env: dict[str, str],
            waiting: RendezvousWait | None = None) -> tuple[int, int | None]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8", errors="replace") as self._log:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    errors="replace", bufsize=1)
            pumps = [threading.Thread(target=self._pump, args=(proc.stdout, sys.stdout), daemon=True),
                     threading.Thread(target=self._pump, args=(proc.stderr, sys.stderr), daemon=True)]
            for pump in pumps:
                pump.start()
            if waiting:
                waiting.start(proc)
            rc, stopped = _wait(proc, waiting.stop if waiting else None, self.torchrun_stopping)
            for pump in pumps:
                pump.join()
            if waiting:  # its last words reach the log too
                waiting.finish()
        return rc, stopped

    def say(self, line: str) -> None:
        """A line of the launcher's own, on stderr and in the log, whole between the ranks' lines."""
        with self._lock:
            self._log.write(line + "\n")
            self._log.flush()
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def _pump(self, stream, terminal) -> None:
        in_trace = in_warning = in_stack = False
        for line in stream:
            reported = self.RANK_ERROR.match(line)
            ours = line.startswith("freescale ")
            if not ours and not in_trace and self.TRACE.match(line):
                in_trace = True
            in_warning = bool(self.WARNING.match(line)) or (in_warning and line.startswith("  "))
            in_stack = bool(self.CPP_STACK.match(line) or (in_stack and (self.CPP_FRAME.match(line)
                                                                            or not line.strip())))
            # A rank's error line waits for the launch's last line, which gathers them.
            show = not reported and (ours or not (in_trace or in_warning or in_stack or self.TORCHRUN_LOG.match(line)))
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
                if not ours and self.STOPPING.search(line):
                    self.torchrun_stopping.set()
                failed = self.ATTEMPT_FAILED.search(line)
                if failed and not ours:
                    self._attempt_failed(int(failed.group(2)), int(failed.group(1)))

    def _attempt_failed(self, local_rank: int, code: int) -> None:
        """An attempt failed: what failed, noted for the next attempt's rank 0 (freescale/training/parallel/
        restarts.py). The ranks' error lines of an attempt torchrun restarts are not the job's last
        line's."""
        from freescale.launch.restarts import FAILURE_NOTE, write_note

        if self.status_dir is None:
            return
        if self.nnodes == 1:  # local ranks are the ranks
            said = self.reported.get(local_rank)
            what = f"rank {local_rank}: {said}" if said else f"rank {local_rank} {_describe_exit(code)}"
        else:  # the ranks' error lines name their global rank, torchrun the local one
            rank, said = next(iter(self.reported.items()), (None, None))
            what = f"rank {rank}: {said}" if said else f"local rank {local_rank} of this node {_describe_exit(code)}"
        write_note(FAILURE_NOTE, what, self.status_dir)
        if self.restarts_left > 0:
            self.restarts_left -= 1
            self.reported.clear()

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
    from freescale.runtime.job_errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_FAILED, EXIT_OK, error_line

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
