"""`freescale pipeline --config FILE.toml`: prepare, calibrate, balance, train [, compare] from one
TOML, safe to rerun from cron, Airflow or any scheduler.

    freescale pipeline --config configs/demo_pipeline.toml [--fresh] [--section.key VALUE ...]

Each stage calls its job in-process (`jobs.prepare.main`, `jobs.calibrate.main`,
`jobs.balance.main`, `jobs.launch.launch`, `jobs.compare.main`), each still runnable by itself.
A stage that finishes leaves a record next to its output in the working directory,
`<workdir>/<stage>.fingerprint.json`: the fingerprint of everything the stage's arguments are
built from (its config section, the shared sizes, the identity of its input files: path,
size and modification time of each local file), of its upstream stages' fingerprints, and
those values themselves, so a rerun can say what changed. A rerun skips a stage whose
fingerprint matches and whose output is intact; it redoes a stage whose parameters or input
changed or whose output is damaged, and everything downstream of a stage that ran. The train
stage continues from its checkpoints when its last run stopped before finishing, and starts
over (its checkpoints removed) otherwise: never into shards that were rebuilt.

The engine (records, fingerprints, skip or run, stale downstream records) is pipeline/stages.py;
this module says which stages there are and how each calls its job. The config's sections and
keys are the dataclasses in jobs/workflow_config.py.
`<workdir>/LOCK` (host, PID) keeps a second run off the working directory. Exit status: 0
done (or nothing to do); 2 bad config (one line naming the key); 3 the working directory is
in use by another run (retry later: nothing is wrong with the config); 128 + N stopped by
signal N; otherwise the failed stage's own status.

A stop signal (SIGTERM from a scheduler, Ctrl-C) ends the running stage as its job ends on one:
its MLflow run KILLED, its staging folder removed; the stage's record says ``killed`` and the
lock is released. A run killed with no chance to clean up (kill -9) leaves its stage's MLflow
run RUNNING: every stage's run carries the working directory (``freescale.pipeline``), and the
next run of the pipeline, holding the lock, ends such runs FAILED before its stages start.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a file (python jobs/workflow.py): make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs.workflow_config import WorkflowConfig, load_workflow_config, override_argv, toml_text  # noqa: E402
from pipeline import locks  # noqa: E402
from pipeline.errors import InputError  # noqa: E402
from pipeline.json_files import write_json  # noqa: E402
from pipeline.stages import LOCK, Stage, file_identity, json_damage, read_record, record_path, run_stages  # noqa: E402

STAGES = ("prepare", "calibrate", "balance", "train", "compare")
UPSTREAM: dict[str, tuple[str, ...]] = {"prepare": (), "calibrate": (), "balance": ("prepare", "calibrate"),
                                        "train": ("balance",), "compare": ("prepare", "calibrate")}
"""The stages whose output a stage reads: when one of them runs, the stage runs too."""


# ------------------------------------------------------------------------------ stages


def _job(module: str, function: str = "main") -> Callable[[list[str]], int]:
    """The job's entry point, imported when the stage runs (a skipped stage loads nothing)."""
    def run(argv: list[str]) -> int:
        import importlib

        return getattr(importlib.import_module(module), function)(argv)
    return run


def build_stages(config: WorkflowConfig) -> list[Stage]:
    """The five stages in order, with their arguments, fingerprint content and output checks."""
    p, work = config.pipeline, Path(config.pipeline.workdir)
    prepared, shards, cost_model = work / "prepared", work / "shards", work / "cost_model.json"
    rank_speeds, summary = work / "rank_speeds.json", work / "train_summary.json"
    tracking = (["--tracking-uri", p.tracking_uri] if p.tracking_uri else []) + ["--experiment", p.experiment]
    sizes = {"world_size": p.world_size, "local_batch_size": p.local_batch_size}
    train_cfg = config.train.config
    train_inputs = {"train.config": file_identity(train_cfg)} if train_cfg else {}
    # What calibrate times is the trained model: its shape, its loss and the encoder's arithmetic.
    model_overrides = {k: v for k, v in config.train.overrides.items()
                       if k.startswith(("model.", "loss.", "training.precision"))}

    # prepare
    prep = asdict(config.prepare)
    prepare_argv = ["--output", str(prepared), "--overwrite", "--max-seq-len", str(prep["max_seq_len"])]
    prepare_params: dict[str, Any] = {"max_seq_len": prep["max_seq_len"], "keep_duplicates": prep["keep_duplicates"]}
    if config.prepare.input:
        prepare_argv += ["--input", config.prepare.input] + (["--format", prep["format"]] if prep["format"] else [])
        prepare_params.update(input=config.prepare.input, format=prep["format"],
                              **{"input identity": file_identity(config.prepare.input)})
    else:
        prepare_argv += ["--synthetic-users", str(prep["synthetic_users"]),
                         "--synthetic-items", str(prep["synthetic_items"]), "--seed", str(prep["seed"])]
        prepare_params.update({k: prep[k] for k in ("synthetic_users", "synthetic_items", "seed")})
    if config.prepare.user_features:
        prepare_argv += ["--user-features", config.prepare.user_features]
        prepare_params.update(user_features=config.prepare.user_features,
                              **{"user_features identity": file_identity(config.prepare.user_features)})
        if config.prepare.user_feature_cols:
            prepare_argv += ["--user-feature-cols", config.prepare.user_feature_cols]
            prepare_params["user_feature_cols"] = config.prepare.user_feature_cols
    if config.prepare.keep_duplicates:
        prepare_argv.append("--keep-duplicates")

    def prepare_damage() -> str | None:
        if not (prepared / "sequences").is_dir():
            return f"{prepared / 'sequences'} is missing"
        return json_damage(prepared / "prepare.json", "prepare summary")()

    # calibrate
    cal = config.calibrate
    calibrate_argv = ["--output", str(cost_model), "--repeats", str(cal.repeats),
                      "--held-out-batches", str(cal.held_out_batches), "--overwrite"]
    calibrate_argv += (["--config", train_cfg] if train_cfg else []) + override_argv(model_overrides)
    if cal.rank_speeds:
        calibrate_argv += ["--rank-speeds-output", str(rank_speeds), "--nproc-per-node", str(p.world_size)]
    calibrate_params = {"repeats": cal.repeats, "held_out_batches": cal.held_out_batches,
                        "rank_speeds": cal.rank_speeds, **train_inputs,
                        **{key: toml_text(value) for key, value in model_overrides.items()}}

    def calibrate_damage() -> str | None:
        from pipeline.cost_model import CostModel

        try:
            CostModel.load(cost_model)
        except InputError as exc:
            return str(exc)
        return json_damage(rank_speeds, "rank speeds file")() if cal.rank_speeds else None

    # balance
    bal = config.balance
    balance_argv = ["--input", str(prepared), "--output", str(shards), "--world-size", str(p.world_size),
                    "--local-batch-size", str(p.local_batch_size), "--strategy", bal.strategy,
                    "--window-steps", str(bal.window_steps), "--seed", str(bal.seed), "--leftover", bal.leftover,
                    "--overwrite"]
    balance_argv += ["--equal-counts"] if bal.equal_counts else []
    balance_argv += ["--token-cap", str(bal.token_cap)] if bal.token_cap else []
    balance_argv += ["--time-limit", str(bal.time_limit)] if bal.time_limit else []
    balance_params: dict[str, Any] = {**sizes, **asdict(bal)}
    used_cost_model = str(cost_model) if cal.enabled else cal.cost_model
    if used_cost_model:
        balance_argv += ["--cost-model", used_cost_model]
    if cal.cost_model:
        balance_params.update(cost_model=cal.cost_model, **{"cost_model identity": file_identity(cal.cost_model)})
    if cal.rank_speeds:
        balance_argv += ["--capacities", f"@{rank_speeds}"]

    def balance_damage() -> str | None:
        from shards.manifest import ShardError, load_manifest

        try:
            load_manifest(shards, p.world_size)
        except ShardError as exc:
            return str(exc)
        return None

    # train
    tr = config.train
    train_argv = ["--shards", str(shards), "--nproc-per-node", str(p.world_size), "--summary-json", str(summary),
                  "--checkpoint.folder", str(work / "checkpoints")]
    train_argv += (["--config", train_cfg] if train_cfg else []) + (["--run-name", tr.run_name] if tr.run_name else [])
    train_argv += (["--max-steps", str(tr.max_steps)] if tr.max_steps else []) + override_argv(tr.overrides)
    train_argv += (["--tracking-uri", p.tracking_uri] if p.tracking_uri else []) + ["--tracking.experiment", p.experiment]
    train_params = {"world_size": p.world_size, "max_steps": tr.max_steps, **train_inputs,
                    **{key: toml_text(value) for key, value in tr.overrides.items()}}

    # compare
    cmp_cfg = config.compare
    compare_summary = work / "compare_summary.json"
    compare_argv = ["--input", str(prepared), "--world-size", str(p.world_size),
                    "--local-batch-size", str(p.local_batch_size), "--repeats", str(cmp_cfg.repeats),
                    "--strategy", cmp_cfg.strategy, "--window-steps", str(bal.window_steps),
                    "--workdir", str(work / "compare"), "--summary-json", str(compare_summary), *tracking]
    compare_argv += ["--control"] if cmp_cfg.control else []
    compare_argv += ["--config", train_cfg] if train_cfg else []
    compare_argv += ["--cost-model", used_cost_model] if used_cost_model else []
    steps = cmp_cfg.max_steps or tr.max_steps
    compare_argv += (["--max-steps", str(steps)] if steps else []) + override_argv(tr.overrides)
    compare_params = {**sizes, **asdict(cmp_cfg), "window_steps": bal.window_steps, "max_steps": steps,
                      **train_inputs, **{key: toml_text(value) for key, value in tr.overrides.items()},
                      **({"cost_model identity": file_identity(cal.cost_model)} if cal.cost_model else {})}

    def checkpoints(continuable: bool) -> str:
        return _prepare_checkpoints(work / "checkpoints", continuable)

    stages = [
        Stage("prepare", _job("jobs.prepare"), prepare_argv + tracking, prepare_params, prepared, prepare_damage),
        Stage("calibrate", _job("jobs.calibrate"), calibrate_argv + tracking, calibrate_params, cost_model,
              calibrate_damage,
              off=None if cal.enabled else (f"[calibrate] enabled = false; balance uses {cal.cost_model}"
                                            if cal.cost_model else "[calibrate] enabled = false; balance uses "
                                            "the built-in cost model")),
        Stage("balance", _job("jobs.balance"), balance_argv + tracking, balance_params, shards, balance_damage),
        Stage("train", _job("jobs.launch", "launch"), train_argv, train_params, summary,
              json_damage(summary, "training summary"), before_run=checkpoints),
        Stage("compare", _job("jobs.compare"), compare_argv, compare_params, compare_summary,
              json_damage(compare_summary, "comparison summary"),
              off=None if cmp_cfg.enabled else "[compare] enabled = false"),
    ]
    for stage in stages:
        stage.upstream = UPSTREAM[stage.name]
    return stages


# ------------------------------------------------------------------------------ the run


class _ErrorLineTap:
    """sys.stderr, remembering the last ``freescale JOB: error: MESSAGE`` line a stage wrote (its
    message; ``details``: whether it named the log, which is the pipeline's own: stages run in-process)."""

    LINE = re.compile(r"^freescale [^:\n]+: error: ([^\n]*?)( \(details: [^\n]*\))?$", re.M)

    def __init__(self, stream):
        self.stream, self.last, self.details = stream, "", False

    def write(self, text: str) -> int:
        for match in self.LINE.finditer(text):
            self.last, self.details = match.group(1), bool(match.group(2))
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def run_stage(stage: Stage, work: Path) -> tuple[int, str, bool]:
    """The stage job's exit status, its error message (empty when it succeeded) and whether the log
    holds details. A stop signal ends the job as it would end it alone (its run KILLED, its staging
    removed), then the stage's record says so and the stop goes on to end the pipeline: whatever
    error the job's cleanup raised in its place, and however the job ended after it (stop_of)."""
    from jobs.job_errors import Stopped, report, stop_of, stop_signal

    tap, saved = _ErrorLineTap(sys.stderr), sys.stderr
    sys.stderr = tap
    try:
        rc = stage.run(stage.argv)
    except SystemExit as exc:  # argparse inside the job
        rc = exc.code if isinstance(exc.code, int) else 2
    except BaseException as exc:
        signum = stop_of(exc)
        if signum is None:
            if not isinstance(exc, Exception):
                raise
            rc = report(stage.name, exc)  # a job that does not end in run_job: one line, its status
        else:
            _record_killed(stage, work, signum)
            if isinstance(exc, (Stopped, KeyboardInterrupt)):
                exc.stage = stage.name  # for the pipeline's last line
                raise
            raise _stop_in(stage, signum) from exc
    finally:
        sys.stderr = saved
    signum = stop_signal()
    if signum is not None:  # the job returned after the stop (with its own line, or even done)
        _record_killed(stage, work, signum)
        raise _stop_in(stage, signum)
    return rc, (tap.last if rc else ""), bool(rc) and tap.details


def _record_killed(stage: Stage, work: Path, signum: int) -> None:
    record = read_record(work, stage.name) or {}
    write_json(record_path(work, stage.name), {**record, "status": "killed", "why": f"stopped by signal {signum}"})


def _stop_in(stage: Stage, signum: int) -> BaseException:
    """The stop, naming the stage for the pipeline's last line."""
    from jobs.job_errors import Stopped

    stopped = Stopped(signum)
    stopped.stage = stage.name
    return stopped


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale pipeline", description=__doc__.split("\n\n")[0],
                                epilog="Other --section.key VALUE arguments override the config file "
                                       "(e.g. --balance.window_steps 32, --train.overrides.training.max_steps 20).")
    p.add_argument("--config", required=True, help="pipeline TOML ([pipeline], [prepare], [calibrate], [balance], "
                                                    "[train], [compare])")
    p.add_argument("--fresh", action="store_true", help="rerun every stage, whatever the records say")
    return p


def main(argv: list[str]) -> int:
    from jobs.job_errors import EXIT_ENVIRONMENT, error_line, stop_of, stops_on_signals
    from jobs.tracking import PIPELINE_ENV

    args, overrides = build_parser().parse_known_args(argv)
    config = load_workflow_config(args.config, overrides)  # a bad key or value: one line, exit 2
    work = Path(config.pipeline.workdir)
    lock = work / LOCK
    refused = locks.acquire(lock, on_stale=lambda holder: print(
        f"freescale pipeline: note: {work}: taking over the stale lock of {holder} (that process is gone)",
        file=sys.stderr, flush=True))
    if refused is not None:
        holder = refused.holder or {}
        who = f"PID {holder.get('pid')} on {holder.get('host')}" if holder else "another run"
        error_line("pipeline", f"workdir {work} is in use by {who} (lock {lock}): wait for that run, or use "
                               "another [pipeline] workdir" + ("; if that run is gone, remove the lock"
                                                              if refused.reason == "other_host" else ""),
                   details=False)
        return EXIT_ENVIRONMENT
    saved_env = os.environ.get(PIPELINE_ENV)
    os.environ[PIPELINE_ENV] = str(work.resolve())  # every stage's run names this workdir
    try:
        # SIGTERM (a scheduler's stop) raises in the main thread, as Ctrl-C does, so the running stage,
        # the records and the lock are ended on the way out (jobs/job_errors.py: stops_on_signals).
        with stops_on_signals():
            try:
                _end_orphaned_runs(config, os.environ[PIPELINE_ENV])
                return run_pipeline(config, work, fresh=args.fresh)
            except BaseException as exc:
                if stop_of(exc) is None:
                    raise
                return _stopped_status(exc)
    finally:
        locks.release(lock)
        if saved_env is None:
            os.environ.pop(PIPELINE_ENV, None)
        else:
            os.environ[PIPELINE_ENV] = saved_env


def _end_orphaned_runs(config: WorkflowConfig, workdir: str) -> None:
    """End FAILED the MLflow runs a killed run of this workdir left RUNNING; one note line, or one
    warning when that fails (tracking never stops the pipeline)."""
    from jobs.tracking import fail_orphaned_runs, resolve_tracking_uri

    try:
        orphans = fail_orphaned_runs(resolve_tracking_uri(config.pipeline.tracking_uri or None), workdir)
    except Exception as exc:  # noqa: BLE001 - tracking never stops the pipeline
        from jobs.tracking import failure

        print(f"freescale pipeline: warning: could not end the MLflow runs a killed run left RUNNING "
              f"({failure(exc)})", file=sys.stderr, flush=True)
        return
    if orphans:
        print(f"freescale pipeline: note: {len(orphans)} MLflow run(s) of a killed run of this workdir "
              f"were still RUNNING: ended FAILED ({', '.join(orphans)})", file=sys.stderr, flush=True)


def _stopped_status(exc: BaseException) -> int:
    """The pipeline's last line and 128 + N for `exc`, which is (or surfaced after) stop signal N."""
    from jobs.job_errors import error_line, stop_of

    signum = stop_of(exc)
    stage = getattr(exc, "stage", None)
    error_line("pipeline", f"stopped by signal {signum}" + (
        f" in stage {stage}: its MLflow run ended KILLED, its output left as it was, its record says killed"
        if stage else ""), details=False)
    return 128 + signum


def run_pipeline(config: WorkflowConfig, work: Path, fresh: bool) -> int:
    from jobs.job_errors import error_line

    started = time.perf_counter()
    lines: list[str] = []

    def say(text: str) -> None:
        lines.append(text)
        print(text, flush=True)

    if not config.prepare.input:  # the default: say it, so nobody takes the results for their data's
        p = config.prepare
        say(f"freescale pipeline: prepare   uses synthetic data ([prepare] has no input: {p.synthetic_users} "
            f"users, {p.synthetic_items} items, seed {p.seed})")
    ran, failed = run_stages(build_stages(config), work, fresh, lambda stage: run_stage(stage, work), say)
    print(f"freescale pipeline: summary of {config.pipeline.workdir}:", flush=True)
    for text in lines:
        print(text, flush=True)
    if failed is not None:
        error_line("pipeline", f"stage {failed.stage} failed (exit {failed.code}"
                               + (f": {failed.error})" if failed.error else ")"), details=failed.details)
        return failed.code
    print(f"freescale pipeline: done in {time.perf_counter() - started:.0f} s: {len(ran)} stage(s) ran; "
          f"records in {work}", flush=True)
    return 0


def _prepare_checkpoints(folder: Path, resumable: bool) -> str:
    """Keep the checkpoints only to continue the same training; otherwise remove them: a
    checkpoint of other shards or settings must not be resumed."""
    if not folder.exists():
        return ""
    if resumable:
        return "; resuming from its checkpoints"
    shutil.rmtree(folder)
    return "; old checkpoints removed"


if __name__ == "__main__":
    from jobs.job_errors import run_job

    sys.exit(run_job("pipeline", lambda: main(sys.argv[1:])))
