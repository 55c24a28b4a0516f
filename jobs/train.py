"""Training entry: one process per rank, launched by torchrun (or by `freescale train`).

    torchrun --nproc-per-node 2 -m jobs.train --config configs/ml100k.toml --data.shards out/shards
    freescale train --shards out/shards --nproc-per-node 2 --max-steps 50

Rank 0 records the run in MLflow: the full config as params, tags (strategy, world
size, data, code version), per-step metrics, the summary under fixed names (loss,
step_time_s, samples_per_s, bubble_fraction, imbalance, hr_at_10, ndcg_at_10, mrr)
and a PNG of per-rank compute and wait over steps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shards.schema import MANIFEST_NAME  # noqa: E402  (stdlib + pyarrow)
from training.config import CommMode  # noqa: E402  (no torch)

SUMMARY_METRICS = ("loss", "step_time_s", "samples_per_s", "bubble_fraction", "idle_fraction", "comm_s",
                   "exposed_comm_s", "imbalance", "hr_at_10", "ndcg_at_10", "mrr")


class MLflowSink:
    """Rank 0's MLflow run; per-step metrics are buffered and sent in batches."""

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict, tags: dict):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.set_tags(tags)
        items = list(params.items())
        for start in range(0, len(items), 90):  # MLflow caps params per request
            mlflow.log_params({k: str(v) for k, v in items[start:start + 90]})
        self._buffer: list = []

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric
        import time as _time

        now = int(_time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
        if len(self._buffer) >= 500:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            self.mlflow.tracking.MlflowClient().log_batch(self.run.info.run_id, metrics=self._buffer)
            self._buffer = []

    def finish(self, summary: dict[str, float], artifacts: list[Path]) -> None:
        self.flush()
        self.mlflow.log_metrics({k: float(v) for k, v in summary.items() if v == v})
        for path in artifacts:
            self.mlflow.log_artifact(str(path))
        self.mlflow.end_run()


def build_sink(config, manifest, rank: int, comm: str):
    from jobs.tracking import DISABLED, code_version, resolve_tracking_uri
    from training.config import to_flat_dict

    uri = resolve_tracking_uri(config.tracking.uri or None)
    if rank != 0 or uri == DISABLED:
        return None
    strategy = manifest.control or manifest.strategy
    run_name = config.tracking.run_name or f"train-{strategy}-k{manifest.world_size}"
    tags = {"freescale.job": "train", "freescale.strategy": strategy,
            "freescale.world_size": str(manifest.world_size),
            "freescale.data": str(Path(config.data.shards).resolve()),
            "freescale.code_version": code_version(), "freescale.comm_mode": config.comm.mode,
            "freescale.comm_path": comm}
    return MLflowSink(uri, config.tracking.experiment, run_name, to_flat_dict(config), tags)


def train(argv: list[str]) -> int:
    import torch.distributed as dist

    from training.bubbles import TIMING_FIELDS
    from training.config import load_config
    from training.trainer import Trainer

    parser = argparse.ArgumentParser(prog="jobs.train", description="one training rank (run under torchrun)")
    parser.add_argument("--config", help="TOML config (configs/*.toml)")
    parser.add_argument("--summary-json", help="rank 0 writes the run summary here")
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    if not config.data.shards:
        from pipeline.errors import InputError
        raise InputError("no shard directory: set data.shards in the config or pass --data.shards DIR")
    trainer = Trainer(config)
    sink = build_sink(config, trainer.manifest, trainer.env.rank, trainer.describe_comm())
    if sink is not None:
        trainer.sink = sink
    result = trainer.train()
    if trainer.env.rank == 0:
        summary = dict(result.summary)
        summary["predicted_bubble"] = trainer.manifest.stats.get("bubble", float("nan"))
        print("summary " + json.dumps({k: round(v, 6) for k, v in summary.items()}), flush=True)
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps(
                {"summary": summary, "losses": result.losses, "steps": result.steps,
                 "comm": trainer.describe_comm(), "comm_issue_order": result.comm_issue_order,
                 "timings": {"fields": list(TIMING_FIELDS), "steps_ranks_fields": result.timings.tolist()}},
                indent=1))
        if sink is not None:
            from training.bubble_plot import plot_rank_timelines

            with tempfile.TemporaryDirectory() as tmp:
                png = plot_rank_timelines(result.timings, result.steps, Path(tmp) / "rank_timelines.png",
                                          title=f"{sink.run.info.run_name}")
                sink.finish(summary, [png])
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    import faulthandler

    from jobs.job_errors import run_job

    faulthandler.enable()  # a rank killed by a native abort still prints where every thread was

    argv = list(sys.argv[1:] if argv is None else argv)
    rank = os.environ.get("RANK", "0")
    return run_job(f"train (rank {rank})", lambda: train(argv))


def launch(argv: list[str] | None = None) -> int:
    """`freescale train`: start the ranks with torch's elastic launcher on this machine."""
    parser = argparse.ArgumentParser(prog="freescale train", description="train on balanced shards")
    parser.add_argument("--shards", required=True, help="shard directory written by `freescale balance`")
    parser.add_argument("--nproc-per-node", type=int, help="ranks to start (default: the manifest's world size)")
    parser.add_argument("--config", help="TOML config (configs/*.toml)")
    parser.add_argument("--max-steps", type=int, help="stop after N steps (default: one pass over the shards)")
    parser.add_argument("--tracking-uri", help="MLflow URI (default $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    parser.add_argument("--run-name", help="MLflow run name")
    parser.add_argument("--summary-json", help="write the run summary (and per-step losses) here")
    parser.add_argument("--comm-mode", choices=typing.get_args(CommMode),
                        help="how the step's collectives run (default: the config's comm.mode, prioritized)")
    args, overrides = parser.parse_known_args(argv)
    nproc = args.nproc_per_node
    if nproc is None:
        manifest = Path(args.shards) / MANIFEST_NAME
        nproc = json.loads(manifest.read_text())["world_size"] if manifest.exists() else 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "jobs.train", "--data.shards", args.shards]
    if args.config:
        cmd += ["--config", args.config]
    if args.max_steps is not None:
        cmd += ["--training.max_steps", str(args.max_steps)]
    if args.tracking_uri:
        cmd += ["--tracking.uri", args.tracking_uri]
    if args.run_name:
        cmd += ["--tracking.run_name", args.run_name]
    if args.summary_json:
        cmd += ["--summary-json", args.summary_json]
    if args.comm_mode:
        cmd += ["--comm.mode", args.comm_mode]
    cmd += overrides
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    from training.distributed import exit_without_finalization, wait_for_peers_to_report

    status = main()
    if status != 0:
        wait_for_peers_to_report()
    exit_without_finalization(status)
