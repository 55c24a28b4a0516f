"""Training entry: one process per rank, started by torchrun (`freescale train` is jobs/launch.py).

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
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs.tracking import failure as tracking_failure  # noqa: E402  (no mlflow import until used)

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
                 resumed: dict | None = None, parent_run_id: str = ""):
        import mlflow
        from mlflow.tracking import MlflowClient

        # The client API only: mlflow's fluent one prints to stdout when a run ends, which
        # fails once a stopped launcher took the ranks' stdout with it.
        self.mlflow, self.uri = mlflow, uri
        self.client = MlflowClient(uri)
        resumed = resumed or {}
        self.run = self._reopen(resumed.get("run_id")) or self._start(experiment, run_name, parent_run_id)
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

    def _start(self, experiment: str, run_name: str, parent_run_id: str):
        from mlflow.tracking.context.registry import resolve_tags  # the user/source tags of mlflow.start_run

        from jobs.tracking import PARENT_TAG

        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        # Nested under `freescale compare`'s parent run when it names one (the UI groups them).
        tags = resolve_tags({PARENT_TAG: parent_run_id} if parent_run_id else {})
        return self.client.create_run(experiment_id, run_name=run_name, tags=tags)

    def _reopen(self, run_id: str | None):
        """The resumed job's run, RUNNING again; None (start a new one) when this server lacks it."""
        if not run_id:
            return None
        try:
            self.client.update_run(run_id, status="RUNNING")
            return self.client.get_run(run_id)
        except self.mlflow.exceptions.MlflowException as exc:
            _warn(f"MLflow run {run_id} of the resumed job is not at {self.uri} ({tracking_failure(exc)}); "
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
        _warn(f"MLflow at {self.uri} failed ({tracking_failure(exc)}); the run continues untracked")

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
            _warn(f"MLflow at {self.uri} failed ending the run ({tracking_failure(exc)})")


def _warn(message: str) -> None:
    try:
        sys.stderr.write(f"freescale train: warning: {message}\n")  # one write: ranks share stderr
        sys.stderr.flush()
    except OSError:
        pass  # the launcher is gone with our stderr: the run's ending still matters


def build_sink(config, trainer, uri: str) -> MLflowSink | None:
    """Rank 0's run (continuing the resumed job's), or None: other ranks, tracking off or failing."""
    from jobs.tracking import DISABLED, code_version, run_tags
    from training.config import to_flat_dict

    manifest = trainer.manifest
    if trainer.env.rank != 0 or uri == DISABLED:
        return None
    run_name = config.tracking.run_name or f"train-{manifest.control or manifest.strategy}-k{manifest.world_size}"
    tags = {"freescale.job": "train", **run_tags(manifest.strategy, manifest.control, config.tracking.comparison),
            "freescale.world_size": str(manifest.world_size),
            "freescale.data": str(Path(config.data.shards).resolve()),
            "freescale.code_version": code_version(), "freescale.comm_mode": config.comm.mode,
            "freescale.comm_path": trainer.describe_comm()}
    try:
        return MLflowSink(uri, config.tracking.experiment, run_name, to_flat_dict(config), tags,
                          trainer.resumed_sink_state, config.tracking.parent_run_id)
    except Exception as exc:  # noqa: BLE001 - it answered the check, then failed: run untracked
        _warn(f"MLflow at {uri} failed opening the run ({tracking_failure(exc)}); running untracked")
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
                    {"summary": summary, "mlflow_run_id": sink.run_id if sink is not None else None,
                     "losses": result.losses, "steps": result.steps,
                     "comm": trainer.describe_comm(), "comm_issue_order": result.comm_issue_order,
                     # The unit of the timings' cost column: freescale simulate checks it.
                     "cost_model": trainer.manifest.cost_model,
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


if __name__ == "__main__":
    from jobs.job_errors import record_rank_status
    from training.distributed import exit_without_finalization, wait_for_peers_to_report

    status = main()
    record_rank_status(status)
    if status != 0:
        wait_for_peers_to_report()
    exit_without_finalization(status)
