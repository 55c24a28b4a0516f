"""Training entry: one process per rank, started by torchrun (`freescale train` is freescale/jobs/launch.py).

    torchrun --nproc-per-node 2 -m freescale.jobs.train --config configs/ml100k.toml --data.shards out/shards
    freescale train --shards out/shards --nproc-per-node 2 --max-steps 50

Rank 0 records the run in MLflow: the full config as params, tags (strategy, world
size, data, code version), per-step metrics as it goes, the summary under fixed names
(loss, step_time_s, samples_per_s, bubble_fraction, imbalance, hr_at_10, ndcg_at_10,
mrr), a PNG of per-rank compute and wait over steps, and the per-step, per-rank timing
table (``timings/timings.parquet``, also at a stop; ``freescale.costs.run_timings``). Tracking never stops the
training: an unreachable server means one warning line and an untracked run. The run
ends FINISHED, FAILED or KILLED; a resumed training continues its run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path


from freescale.runtime.stops import Stopped
from freescale.training.loop.mlflow_sink import MLflowSink, build_sink  # no mlflow import until used
from freescale.launch import restarts  # no torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # how torchrun (and a terminal) stop the ranks


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
        self.folder = tempfile.TemporaryDirectory(prefix="freescale-train-")
        """This rank's scratch: the timing file without --summary-json, the artifacts' names."""

    def end(self, status: str, summary: dict[str, float] | None = None, artifacts: list[Path] = ()) -> None:
        """FINISHED, FAILED or KILLED (a stop signal, even one received while the run ends, makes
        it KILLED); runs once."""
        self.ending = True
        sink, self.sink = self.sink, None
        trainer, self.trainer = self.trainer, None
        if sink is not None:
            ended = "KILLED" if self.stopped_by is not None else status
            sink.finish(ended, summary, [*artifacts, *self._timings_artifact(trainer)])
            if ended != "KILLED" and self.stopped_by is not None:  # the stop came while the run ended
                sink.finish_again("KILLED")
        if trainer is not None:
            trainer.close()
        self.folder.cleanup()

    def _timings_artifact(self, trainer) -> list[tuple[Path, str]]:
        """Rank 0's timing file as the run's ``timings/`` artifact: closed here (what was gathered so
        far, at a stop), under its artifact name."""
        from freescale.costs.run_timings import artifact_name

        timing_file = getattr(trainer, "timing_file", None)
        path = timing_file.close() if timing_file is not None else None
        if path is None:
            return []
        link = Path(self.folder.name) / "artifacts" / artifact_name(timing_file.first_step)
        link.parent.mkdir(exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(path.resolve())
        return [(link, "timings")]

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


def train(argv: list[str]) -> int:
    """One rank's job. Rank 0's run ends FINISHED, FAILED (an exception) or KILLED (a stop
    signal, exit status 128 + signal); the checkpoint folder is released in every case."""
    from freescale.training.config import load_config

    parser = argparse.ArgumentParser(prog="freescale.jobs.train", description="one training rank (run under torchrun)")
    parser.add_argument("--config", help="TOML config (configs/*.toml)")
    parser.add_argument("--summary-json", help="rank 0 writes the run summary here")
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    if not config.data.shards:
        from freescale.runtime.errors import InputError
        raise InputError("no shard directory: set data.shards in the config or pass --data.shards DIR")
    job = RankJob()
    job.stop_on_signals()
    status = "FAILED"
    try:
        code = _train_rank(config, args.summary_json, job)
        status = "FINISHED"
        return code if job.stopped_by is None else 128 + job.stopped_by
    except Stopped as stopped:
        return 128 + stopped.signum
    except Exception:
        if job.stopped_by is None:
            raise
        # A peer the same stop ended first fails this rank's collective (the run's last barrier
        # included): the job was stopped, not failed. The error goes to the log.
        from freescale.runtime.job_errors import write_details

        write_details(f"train (rank {os.environ.get('RANK', '0')})",
                      "after a stop signal: " + traceback.format_exc())
        return 128 + job.stopped_by
    finally:
        job.end(status)


def _train_rank(config, summary_json: str | None, job: RankJob) -> int:
    import torch.distributed as dist

    from freescale.tracking.store import DISABLED, Tracking
    from freescale.costs.run_summary import timings_beside, write_run_summary
    from freescale.training.timing.bubbles import TIMING_FIELDS
    from freescale.training.loop.trainer import NullSink, Trainer

    # Only rank 0 records the run: it checks the server before any work (RANK is what
    # the trainer's process group reads too), so an unreachable one costs seconds.
    rank0 = os.environ.get("RANK", "0") == "0"
    uri = Tracking(config.tracking.uri).reachable_uri("train") if rank0 else DISABLED
    timings_file = timings_beside(summary_json) if summary_json else Path(job.folder.name) / "timings.parquet"
    trainer = job.trainer = Trainer(config, timings_file=timings_file)
    if rank0:
        _continue_after_restart(trainer)
    sink = job.sink = build_sink(config, trainer, uri)
    if sink is not None:
        restarts.write_note(restarts.RUN_NOTE, sink.run_id)  # a restart before the first checkpoint continues it
    trainer.sink = sink if sink is not None else NullSink(trainer.resumed_sink_state)
    result = trainer.train()
    summary, artifacts = None, []
    with tempfile.TemporaryDirectory() as tmp:
        if trainer.env.rank == 0:
            summary = dict(result.summary)
            summary["predicted_bubble"] = (trainer.replan.bubble if trainer.replan is not None
                                           else trainer.manifest.stats.get("bubble", float("nan")))
            summary["restarts"] = float(restarts.restart_count())
            if summary_json:
                write_run_summary(summary_json, summary=summary, run_id=sink.run_id if sink is not None else None,
                                  losses=result.losses, steps=result.steps, comm=trainer.describe_comm(),
                                  comm_issue_order=result.comm_issue_order,
                                  # The unit of the timings' cost column: freescale simulate checks it.
                                  cost_model=trainer.manifest.cost_model, fields=TIMING_FIELDS,
                                  timings_file=result.timings)
            # After the file: whoever reads the line (a person, a scheduler) finds the file written.
            print("summary " + json.dumps({k: round(v, 6) for k, v in summary.items()}), flush=True)
        if sink is not None and result.timings is not None:
            from freescale.costs.run_timings import TimingColumns
            from freescale.training.timing.bubble_plot import plot_rank_timelines

            timings = TimingColumns(result.timings)
            artifacts = [plot_rank_timelines(timings, list(timings.steps()), Path(tmp) / "rank_timelines.png",
                                             title=f"{sink.run.info.run_name}")]
        # Every rank is done before the run ends FINISHED: a stop until then ends it KILLED.
        dist.barrier(group=trainer.env.host_group)
        job.end("FINISHED", summary, artifacts)
    dist.destroy_process_group()
    return 0


def _continue_after_restart(trainer) -> None:
    """Rank 0 of an attempt torchrun restarted after a failure: its line, and the MLflow run it
    continues when no checkpoint names one (the failure came before the first)."""
    resumed_from = str(trainer.checkpointer.step_dir(trainer.step)) if trainer.step else "step 0"
    line = restarts.restart_line(resumed_from)
    if line is None:
        return
    print(line, file=sys.stderr, flush=True)
    run_id = restarts.read_note(restarts.RUN_NOTE)
    if run_id and not trainer.resumed_sink_state.get("run_id"):
        trainer.resumed_sink_state = {"run_id": run_id}


_fault_log = None  # the log file faulthandler writes to (kept open for the process's life)


def main(argv: list[str] | None = None) -> int:
    """One rank: its failure is one line on stderr; the traceback goes to the job's log."""
    import faulthandler

    from freescale.runtime.job_errors import run_job
    from freescale.runtime import logs

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
    from freescale.runtime.job_errors import record_rank_status
    from freescale.training.parallel.distributed import exit_without_finalization, wait_for_peers_to_report

    status = main()
    record_rank_status(status)
    if status != 0:
        wait_for_peers_to_report()
    exit_without_finalization(status)
