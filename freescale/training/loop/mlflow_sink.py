"""Rank 0's MLflow run of a training, recorded as it goes without ever holding up a step.

`freescale/jobs/train.py` opens it with :func:`build_sink`; the trainer hands it each step's metrics
(``log_step``) and its checkpoint holds its ``state_dict``, so a resumed training continues
the same run. Tracking never stops the training: a failing server is one warning line.
"""
from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path

from freescale.tracking.datasets import log_datasets  # no mlflow import until a run opens
from freescale.tracking.runs import failure as tracking_failure

BATCH_METRICS = 1000  # MLflow's log_batch limit per request
DRAIN_TIMEOUT_S = 15.0  # the most a run's end waits for unsent step metrics
SERIES = {"step/": "step/loss", "epoch/": "epoch/epoch"}
"""Each series (key prefix) and the metric every point of it has: how far a resumed run's record
holds that series. Apart, because a kill can fall after a step's loss was sent and before the
validation logged at that step was: the rerun must log that validation, not skip it."""


class MLflowSink:
    """Rank 0's MLflow run, recorded as it goes without ever holding up a step.

    ``log_step`` only queues; one background thread sends the queue in batches
    (``log_batch``). A tracking error becomes one warning line and the run continues
    untracked. ``state_dict`` (part of rank 0's checkpoint) names the run and holds the
    steps not yet sent, so a resumed training continues this run -- even after a
    ``kill -9`` -- with every step once: steps the run already has are skipped.
    """

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict, tags: dict,
                 resumed: dict | None = None, parent_run_id: str = "", inputs: dict | None = None):
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
        if inputs:
            log_datasets(self.client, self.run_id, inputs)
        self.resumed_through = {series: self._last_logged_step(key) for series, key in SERIES.items()}
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

        from freescale.tracking.runs import PARENT_TAG, inherited_parent
        from freescale.tracking.store import find_or_create_experiment

        experiment_id = find_or_create_experiment(self.client, experiment)
        # Nested under `freescale compare`'s parent run when it names one, or an incremental pipeline's
        # day run (the UI groups them).
        parent = inherited_parent(parent_run_id)
        tags = resolve_tags({PARENT_TAG: parent} if parent else {})
        return self.client.create_run(experiment_id, run_name=run_name, tags=tags)

    def _reopen(self, run_id: str | None):
        """The resumed job's run, RUNNING again; None (start a new one) when this server lacks it."""
        if not run_id:
            return None
        try:
            self.client.update_run(run_id, status="RUNNING")
            return self.client.get_run(run_id)
        except self.mlflow.exceptions.MlflowException as exc:
            warn(f"MLflow run {run_id} of the resumed job is not at {self.uri} ({tracking_failure(exc)}); "
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

    def _last_logged_step(self, key: str) -> int:
        history = self.client.get_metric_history(self.run_id, key)
        return max((m.step for m in history), default=-1)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        # A step may be logged more than once (a validation after its step's metrics); the points a
        # resumed run's record already has, series by series, are not logged again.
        new = {k: float(v) for k, v in metrics.items()
               if step > self.resumed_through.get(k.split("/", 1)[0] + "/", -1)}
        if not self.failed and new:
            self._queue(step, int(time.time() * 1000), new)

    def _queue(self, step: int, timestamp: int, metrics: dict[str, float]) -> None:
        with self._changed:
            if not self._unsent or step >= self._unsent[-1][0]:
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
                self._changed.notify_all()

    def _fail(self, exc: Exception) -> None:
        with self._changed:
            self.failed = True
            self._unsent.clear()
            self._changed.notify_all()
        warn(f"MLflow at {self.uri} failed ({tracking_failure(exc)}); the run continues untracked")

    def finish(self, status: str, summary: dict[str, float] | None = None,
               artifacts: list[Path | tuple[Path, str]] = ()) -> None:
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
            for artifact in artifacts:  # a path, or (path, the folder it goes under)
                path, folder = artifact if isinstance(artifact, tuple) else (artifact, None)
                self.client.log_artifact(self.run_id, str(path), folder)
            self.client.set_terminated(self.run_id, status)
        except Exception as exc:  # noqa: BLE001 - the training is done: tracking must not fail it
            self.failed = True
            warn(f"MLflow at {self.uri} failed ending the run ({tracking_failure(exc)})")

    def finish_again(self, status: str) -> None:
        """Change an ended run's status (a stop signal that came while it ended FINISHED)."""
        if self.failed:
            return
        try:
            self.client.set_terminated(self.run_id, status)
        except Exception as exc:  # noqa: BLE001 - tracking must not fail the job
            warn(f"MLflow at {self.uri} failed ending the run {status} ({tracking_failure(exc)})")


def warn(message: str) -> None:
    try:
        sys.stderr.write(f"freescale train: warning: {message}\n")  # one write: ranks share stderr
        sys.stderr.flush()
    except OSError:
        pass  # the launcher is gone with our stderr: the run's ending still matters


def build_sink(config, trainer, uri: str) -> MLflowSink | None:
    """Rank 0's run (continuing the resumed job's), or None: other ranks, tracking off or failing."""
    from freescale.shards.schema import MANIFEST_NAME
    from freescale.training.config import to_flat_dict
    from freescale.tracking.datasets import DataRef
    from freescale.tracking.runs import code_version, run_tags
    from freescale.tracking.store import DISABLED

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
                          trainer.resumed_sink_state, config.tracking.parent_run_id,
                          inputs={"training": DataRef.shards(str(manifest.root.resolve()),
                                                             (manifest.root / MANIFEST_NAME).read_text())})
    except Exception as exc:  # noqa: BLE001 - it answered the check, then failed: run untracked
        warn(f"MLflow at {uri} failed opening the run ({tracking_failure(exc)}); running untracked")
        return None
