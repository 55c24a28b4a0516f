"""Training entry: one process per rank, launched by torchrun (or by `freescale train`).

    torchrun --nproc-per-node 2 -m jobs.train --config configs/ml100k.toml --data.shards out/shards
    freescale train --shards out/shards --nproc-per-node 2 --max-steps 50

Rank 0 records the run in MLflow: the full config as params, tags (strategy, world
size, data, code version), per-step metrics as it goes, the summary under fixed names
(loss, step_time_s, samples_per_s, bubble_fraction, imbalance, hr_at_10, ndcg_at_10,
mrr) and a PNG of per-rank compute and wait over steps. Tracking never stops the
training: an unreachable server means one warning line and an untracked run. The run
ends FINISHED, FAILED or KILLED; a resumed training continues its run.
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
import time
import typing
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shards.schema import MANIFEST_NAME  # noqa: E402  (stdlib + pyarrow)
from training.config import CommMode  # noqa: E402  (no torch)

SUMMARY_METRICS = ("loss", "step_time_s", "samples_per_s", "bubble_fraction", "idle_fraction", "comm_s",
                   "exposed_comm_s", "imbalance", "hr_at_10", "ndcg_at_10", "mrr")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # how torchrun (and a terminal) stop the ranks
BATCH_METRICS = 1000  # MLflow's log_batch limit per request
DRAIN_TIMEOUT_S = 15.0  # the most a run's end waits for unsent step metrics


class Stopped(BaseException):
    """A stop signal, raised in the main thread so the run ends KILLED (a BaseException:
    no `except Exception` on the way may take it for an error)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


class RankJob:
    """What must end with this rank, however it ends: rank 0's MLflow run and its checkpoint lock.

    A stop signal ends them from its handler, before interrupting the main thread: a
    peer stopped by the same signal makes this rank's collective fail at about the same
    moment, and an ending already under way for that error must not be cut short.
    """

    def __init__(self):
        self.sink: MLflowSink | None = None
        self.trainer = None
        self.stopped_by: int | None = None
        self.ending = False

    def end(self, status: str, summary: dict[str, float] | None = None, artifacts: list[Path] = ()) -> None:
        """FINISHED, FAILED or KILLED (a stop signal turns a failure into KILLED); runs once."""
        self.ending = True
        sink, self.sink = self.sink, None
        trainer, self.trainer = self.trainer, None
        if sink is not None:
            sink.finish("KILLED" if self.stopped_by is not None and status == "FAILED" else status,
                        summary, artifacts)
        if trainer is not None:
            trainer.close()

    def stop_on_signals(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._stop)

    def _stop(self, signum: int, frame: object) -> None:
        # One signal is enough: torchrun forwards what its process group already received.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        self.stopped_by = signum
        if not self.ending:
            self.end("KILLED")
            raise Stopped(signum)


class MLflowSink:
    """Rank 0's MLflow run, recorded as it goes without ever holding up a step.

    ``log_step`` only queues; one background thread sends the queue in batches
    (``log_batch``). A tracking error becomes one warning line and the run continues
    untracked. ``state_dict`` (part of rank 0's checkpoint) names the run and holds the
    steps not yet sent, so a resumed training continues this run -- even after a
    ``kill -9`` -- with every step once: steps the run already has are skipped.
    """

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict, tags: dict,
                 resumed: dict | None = None):
        import mlflow
        from mlflow.tracking import MlflowClient

        # The client API only: mlflow's fluent one prints to stdout when a run ends, which
        # fails once a stopped launcher took the ranks' stdout with it.
        self.mlflow, self.uri = mlflow, uri
        self.client = MlflowClient(uri)
        resumed = resumed or {}
        self.run = self._reopen(resumed.get("run_id")) or self._start(experiment, run_name)
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)
        self._log_new_params(params)
        self.sent_through = self._last_logged_step()
        self.failed = False
        self._unsent: collections.deque[tuple[int, int, dict[str, float]]] = collections.deque()
        self._stopping = False
        self._changed = threading.Condition()
        for step, timestamp, metrics in resumed.get("unsent", []):
            self._queue(step, timestamp, metrics)
        self._sender = threading.Thread(target=self._send_loop, name="mlflow-sink", daemon=True)
        self._sender.start()

    @property
    def run_id(self) -> str:
        return self.run.info.run_id

    def _start(self, experiment: str, run_name: str):
        from mlflow.tracking.context.registry import resolve_tags  # the user/source tags of mlflow.start_run

        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        return self.client.create_run(experiment_id, run_name=run_name, tags=resolve_tags({}))

    def _reopen(self, run_id: str | None):
        """The resumed job's run, RUNNING again; None (start a new one) when this server lacks it."""
        if not run_id:
            return None
        try:
            self.client.update_run(run_id, status="RUNNING")
            return self.client.get_run(run_id)
        except self.mlflow.exceptions.MlflowException as exc:
            _warn(f"MLflow run {run_id} of the resumed job is not at {self.uri} ({_reason(exc)}); "
                  "starting a new run")
            return None

    def _log_new_params(self, params: dict) -> None:
        """Params the run lacks (MLflow refuses to change one; a resume may change max_steps)."""
        from mlflow.entities import Param

        known = self.client.get_run(self.run_id).data.params
        items = [Param(k, str(v)) for k, v in params.items() if k not in known]
        for start in range(0, len(items), 90):  # MLflow caps params per request
            self.client.log_batch(self.run_id, params=items[start:start + 90])
        changed = [f"{k}={v}" for k, v in params.items() if k in known and known[k] != str(v)]
        if changed:
            self.client.set_tag(self.run_id, "freescale.resumed_with", ", ".join(changed)[:5000])

    def _last_logged_step(self) -> int:
        history = self.client.get_metric_history(self.run_id, "step/loss")
        return max((m.step for m in history), default=-1)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if not self.failed and step > self.sent_through:
            self._queue(step, int(time.time() * 1000), {k: float(v) for k, v in metrics.items()})

    def _queue(self, step: int, timestamp: int, metrics: dict[str, float]) -> None:
        with self._changed:
            if not self._unsent or step > self._unsent[-1][0]:
                self._unsent.append((step, timestamp, metrics))
                self._changed.notify_all()

    def state_dict(self) -> dict:
        with self._changed:
            return {"run_id": self.run_id, "unsent": list(self._unsent)}

    def _next_batch(self) -> list[tuple[int, int, dict[str, float]]]:
        """Whole steps from the queue's head, up to BATCH_METRICS metrics (at least one step)."""
        batch, size = [], 0
        for entry in self._unsent:
            if batch and size + len(entry[2]) > BATCH_METRICS:
                break
            batch.append(entry)
            size += len(entry[2])
        return batch

    def _send_loop(self) -> None:
        from mlflow.entities import Metric

        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._unsent or self._stopping)
                batch = self._next_batch()
            if not batch:
                return  # stopping, everything sent
            try:
                self.client.log_batch(self.run_id, metrics=[Metric(k, v, timestamp, step)
                                                            for step, timestamp, m in batch for k, v in m.items()])
            except Exception as exc:  # noqa: BLE001 - tracking must not stop the training
                self._fail(exc)
                return
            with self._changed:  # sent: off the queue (kept until now, so a checkpoint has them)
                for _ in batch:
                    self._unsent.popleft()
                self.sent_through = batch[-1][0]
                self._changed.notify_all()

    def _fail(self, exc: Exception) -> None:
        with self._changed:
            self.failed = True
            self._unsent.clear()
            self._changed.notify_all()
        _warn(f"MLflow at {self.uri} failed ({_reason(exc)}); the run continues untracked")

    def finish(self, status: str, summary: dict[str, float] | None = None, artifacts: list[Path] = ()) -> None:
        """Send what is queued (at most DRAIN_TIMEOUT_S), then end the run FINISHED, FAILED or KILLED."""
        from mlflow.entities import Metric

        if self._stopping:
            return  # ended already
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._sender.join(DRAIN_TIMEOUT_S)
        if self.failed:
            return
        try:
            if summary:
                now = int(time.time() * 1000)
                self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, 0)
                                                            for k, v in summary.items() if v == v])
            for path in artifacts:
                self.client.log_artifact(self.run_id, str(path))
            self.client.set_terminated(self.run_id, status)
        except Exception as exc:  # noqa: BLE001 - the training is done: tracking must not fail it
            self.failed = True
            _warn(f"MLflow at {self.uri} failed ending the run ({_reason(exc)})")


def _warn(message: str) -> None:
    try:
        sys.stderr.write(f"freescale train: warning: {message}\n")  # one write: ranks share stderr
        sys.stderr.flush()
    except OSError:
        pass  # the launcher is gone with our stderr: the run's ending still matters


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def build_sink(config, trainer, uri: str) -> MLflowSink | None:
    """Rank 0's run (continuing the resumed job's), or None: other ranks, tracking off or failing."""
    from jobs.tracking import DISABLED, code_version
    from training.config import to_flat_dict

    manifest = trainer.manifest
    if trainer.env.rank != 0 or uri == DISABLED:
        return None
    strategy = manifest.control or manifest.strategy
    run_name = config.tracking.run_name or f"train-{strategy}-k{manifest.world_size}"
    tags = {"freescale.job": "train", "freescale.strategy": strategy,
            "freescale.world_size": str(manifest.world_size),
            "freescale.data": str(Path(config.data.shards).resolve()),
            "freescale.code_version": code_version(), "freescale.comm_mode": config.comm.mode,
            "freescale.comm_path": trainer.describe_comm()}
    try:
        return MLflowSink(uri, config.tracking.experiment, run_name, to_flat_dict(config), tags,
                          trainer.resumed_sink_state)
    except Exception as exc:  # noqa: BLE001 - it answered the check, then failed: run untracked
        _warn(f"MLflow at {uri} failed opening the run ({_reason(exc)}); running untracked")
        return None


def train(argv: list[str]) -> int:
    """One rank's job. Rank 0's run ends FINISHED, FAILED (an exception) or KILLED (a stop
    signal, exit status 128 + signal); the checkpoint folder is released in every case."""
    from training.config import load_config

    parser = argparse.ArgumentParser(prog="jobs.train", description="one training rank (run under torchrun)")
    parser.add_argument("--config", help="TOML config (configs/*.toml)")
    parser.add_argument("--summary-json", help="rank 0 writes the run summary here")
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    if not config.data.shards:
        from pipeline.errors import InputError
        raise InputError("no shard directory: set data.shards in the config or pass --data.shards DIR")
    job = RankJob()
    job.stop_on_signals()
    status = "FAILED"
    try:
        code = _train_rank(config, args.summary_json, job)
        status = "FINISHED"
        return code
    except Stopped as stopped:
        return 128 + stopped.signum
    finally:
        job.end(status)


def _train_rank(config, summary_json: str | None, job: RankJob) -> int:
    import torch.distributed as dist

    from jobs.tracking import DISABLED, reachable_tracking_uri
    from training.bubbles import TIMING_FIELDS
    from training.trainer import NullSink, Trainer

    # Only rank 0 records the run: it checks the server before any work (RANK is what
    # the trainer's process group reads too), so an unreachable one costs seconds.
    rank0 = os.environ.get("RANK", "0") == "0"
    uri = reachable_tracking_uri("train", config.tracking.uri or None) if rank0 else DISABLED
    trainer = job.trainer = Trainer(config)
    sink = job.sink = build_sink(config, trainer, uri)
    trainer.sink = sink if sink is not None else NullSink(trainer.resumed_sink_state)
    result = trainer.train()
    summary, artifacts = None, []
    with tempfile.TemporaryDirectory() as tmp:
        if trainer.env.rank == 0:
            summary = dict(result.summary)
            summary["predicted_bubble"] = trainer.manifest.stats.get("bubble", float("nan"))
            print("summary " + json.dumps({k: round(v, 6) for k, v in summary.items()}), flush=True)
            if summary_json:
                Path(summary_json).write_text(json.dumps(
                    {"summary": summary, "losses": result.losses, "steps": result.steps,
                     "comm": trainer.describe_comm(), "comm_issue_order": result.comm_issue_order,
                     "timings": {"fields": list(TIMING_FIELDS), "steps_ranks_fields": result.timings.tolist()}},
                    indent=1))
        if sink is not None:
            from training.bubble_plot import plot_rank_timelines

            artifacts = [plot_rank_timelines(result.timings, result.steps, Path(tmp) / "rank_timelines.png",
                                             title=f"{sink.run.info.run_name}")]
        job.end("FINISHED", summary, artifacts)
    dist.barrier()
    dist.destroy_process_group()
    return 0


_fault_log = None  # the log file faulthandler writes to (kept open for the process's life)


def main(argv: list[str] | None = None) -> int:
    """One rank: its failure is one line on stderr; the traceback goes to the job's log."""
    import faulthandler

    from jobs.job_errors import run_job
    from pipeline import logs

    global _fault_log
    # A rank killed by a native abort still leaves where every thread was: in the log the
    # launcher names (FREESCALE_LOG_FILE), on the terminal under --verbose or a bare torchrun.
    if os.environ.get(logs.LOG_FILE_ENV) and not logs.verbose():
        try:
            _fault_log = logs.open_log()
        except OSError:
            _fault_log = None
    faulthandler.enable(file=_fault_log or sys.stderr)

    argv = list(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    return run_job(f"train (rank {rank})", lambda: train(argv))


def launch(argv: list[str] | None = None) -> int:
    """`freescale train`: start the ranks with torch's elastic launcher on this machine.

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
    parser.add_argument("--nproc-per-node", type=int, help="ranks to start (default: the manifest's world size)")
    parser.add_argument("--config", help="TOML config (configs/*.toml)")
    parser.add_argument("--max-steps", type=int,
                        help="stop after N >= 1 steps (default: the config's training.max_steps; 0 there = one pass "
                             "over the shards)")
    parser.add_argument("--tracking-uri", help="MLflow URI (default $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--run-name", help="MLflow run name")
    parser.add_argument("--summary-json", help="write the run summary (and per-step losses) here")
    parser.add_argument("--comm-mode", choices=typing.get_args(CommMode),
                        help="how the step's collectives run (default: the config's comm.mode, prioritized)")
    args, overrides = parser.parse_known_args(argv)
    if args.max_steps is not None and args.max_steps < 1:
        raise InputError(f"--max-steps must be a positive integer (omit it for one pass over the shards), "
                         f"got {args.max_steps}")
    nproc = args.nproc_per_node
    if nproc is None:
        manifest = Path(args.shards) / MANIFEST_NAME
        try:
            nproc = int(json.loads(manifest.read_text())["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            nproc = 1  # no readable manifest: one rank starts and names the problem
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
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
    return conclude_ranks(rc, statuses, output, nproc)


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


if __name__ == "__main__":
    from jobs.job_errors import record_rank_status
    from training.distributed import exit_without_finalization, wait_for_peers_to_report

    status = main()
    record_rank_status(status)
    if status != 0:
        wait_for_peers_to_report()
    exit_without_finalization(status)
