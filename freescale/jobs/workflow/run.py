"""`freescale pipeline --config FILE.toml`: prepare, calibrate, balance, train [, compare, export, recommend] from one
TOML, safe to rerun from cron, Airflow or any scheduler.

    freescale pipeline --config configs/demo_pipeline.toml [--fresh] [--section.key VALUE ...]

Each stage calls its job in-process, each still runnable by itself, through its typed entry
(`freescale.jobs.prepare.run`, `freescale.jobs.calibrate.run`, `freescale.jobs.balance.run`, `freescale.jobs.launch.run`, `freescale.jobs.compare.run`,
`freescale.jobs.export.run`, `freescale.jobs.recommend.run`, each with the spec built from its section).
A stage that finishes leaves a record next to its output in the working directory,
`<workdir>/<stage>.fingerprint.json`: the fingerprint of everything the stage's arguments are
built from (its config section, the shared sizes, the identity of its input files: path,
size and modification time of each local file), of its upstream stages' fingerprints, and
those values themselves, so a rerun can say what changed. A rerun skips a stage whose
fingerprint matches and whose output is intact; it redoes a stage whose parameters or input
changed or whose output is damaged, and everything downstream of a stage that ran. The train
stage continues from its checkpoints when its last run stopped before finishing, and starts
over (its checkpoints removed) otherwise: never into shards that were rebuilt.

The engine (records, fingerprints, skip or run, stale downstream records) is freescale/jobs/workflow/stages.py;
this module says which stages there are and how each calls its job. The config's sections and
keys are the dataclasses in freescale/jobs/workflow/config.py.
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
from typing import Any

from freescale.jobs.workflow.config import WorkflowConfig, load_workflow_config, override_argv, toml_text
from freescale.runtime import locks
from freescale.runtime import options
from freescale.runtime.errors import InputError
from freescale.runtime.json_files import write_json
from freescale.jobs.workflow.stages import LOCK, Stage, file_identity, json_damage, read_record, record_path, run_stages
from freescale.shards.balance_spec import BalanceSpec  # the balancing registry's names only: numpy
from freescale.prepare.prepare_spec import synthetic_text  # standard library only

STAGES = ("prepare", "calibrate", "balance", "train", "compare", "export", "recommend")
UPSTREAM: dict[str, tuple[str, ...]] = {"prepare": (), "calibrate": (), "balance": ("prepare", "calibrate"),
                                        "train": ("balance",), "compare": ("prepare", "calibrate"),
                                        "export": ("train",), "recommend": ("prepare", "export")}
"""The stages whose output a stage reads: when one of them runs, the stage runs too."""


# ------------------------------------------------------------------------------ stages


class Workdir:
    """Where each stage writes, under [pipeline] workdir."""

    def __init__(self, root: Path):
        self.root = root
        self.prepared, self.shards, self.checkpoints, self.compare = (
            root / name for name in ("prepared", "shards", "checkpoints", "compare"))
        self.cost_model, self.rank_speeds = root / "cost_model.json", root / "rank_speeds.json"
        self.model, self.recommendations = root / "model", root / "recommendations"
        self.summary, self.compare_summary = root / "train_summary.json", root / "compare_summary.json"


def tracking_of(config: WorkflowConfig):
    """The tracking of a stage whose job takes a typed spec."""
    from freescale.tracking.store import Tracking

    return Tracking(config.pipeline.tracking_uri or None, config.pipeline.experiment)


def train_inputs(config: WorkflowConfig) -> dict[str, str]:
    """The training config's identity, for the stages that read it."""
    return {"train.config": file_identity(config.train.config)} if config.train.config else {}


def used_cost_model(config: WorkflowConfig, work: Workdir) -> str | None:
    """The cost model balance and compare plan with: calibrate's, the given one, or none (the built-in)."""
    return str(work.cost_model) if config.calibrate.enabled else (config.calibrate.cost_model or None)


def build_stages(config: WorkflowConfig) -> list[Stage]:
    """The stages in order (STAGES), with their jobs, fingerprint content and output checks."""
    work = Workdir(Path(config.pipeline.workdir))
    stages = [prepare_stage(config, work), calibrate_stage(config, work), balance_stage(config, work),
              train_stage(config, work), compare_stage(config, work), export_stage(config, work),
              recommend_stage(config, work)]
    for stage in stages:
        stage.upstream = UPSTREAM[stage.name]
    return stages


def prepare_values(config: WorkflowConfig, work: Workdir) -> dict[str, Any]:
    """The prepare stage's spec values: the [prepare] section, into the workdir."""
    return {**options.section_values(config.prepare), "output": str(work.prepared), "overwrite": True}


def prepare_params(config: WorkflowConfig) -> dict[str, Any]:
    """What prepare's fingerprint covers: the values its output depends on and its inputs' identities."""
    prep = config.prepare
    params: dict[str, Any] = {"max_seq_len": prep.max_seq_len, "keep_duplicates": prep.keep_duplicates}
    if prep.input:
        params.update(input=prep.input, format=prep.format, **{"input identity": file_identity(prep.input)})
    else:
        params.update(synthetic_users=prep.synthetic_users, synthetic_items=prep.synthetic_items, seed=prep.seed)
        if prep.synthetic_groups:  # only when on: a default workdir's fingerprint stays what it was
            params.update(synthetic_groups=prep.synthetic_groups, synthetic_group_share=prep.synthetic_group_share)
    if prep.user_features:
        params.update(user_features=prep.user_features,
                      **{"user_features identity": file_identity(prep.user_features)})
        if prep.user_feature_cols:
            params["user_feature_cols"] = prep.user_feature_cols
    return params


def prepare_stage(config: WorkflowConfig, work: Workdir) -> Stage:
    spec, values = type(config.prepare).spec, prepare_values(config, work)

    def run() -> int:
        from freescale.jobs import prepare

        return prepare.run(lambda: options.from_values(spec, values), tracking_of(config))

    def damage() -> str | None:
        if not (work.prepared / "sequences").is_dir():
            return f"{work.prepared / 'sequences'} is missing"
        return json_damage(work.prepared / "prepare.json", "prepare summary")()
    return Stage("prepare", run, prepare_params(config), work.prepared, damage)


def calibrate_values(config: WorkflowConfig, work: Workdir) -> tuple[dict[str, Any], list[str]]:
    """The calibrate stage's spec values ([calibrate], the training config, into the workdir) and the
    overrides on the timed config: calibrate times the trained model, so [train.overrides]' keys of its
    shape, its loss and the encoder's arithmetic (``TIMED_KEYS``)."""
    cal = config.calibrate
    values: dict[str, Any] = {"output": str(work.cost_model), "config": config.train.config or None,
                              "repeats": cal.repeats, "held_out_batches": cal.held_out_batches, "overwrite": True}
    if cal.rank_speeds:
        values.update(rank_speeds_output=str(work.rank_speeds), nproc_per_node=config.pipeline.world_size)
    return values, override_argv(timed_overrides(config))


def timed_overrides(config: WorkflowConfig) -> dict[str, Any]:
    from freescale.training.calibration.calibrate_spec import TIMED_KEYS  # standard library only

    return {k: v for k, v in config.train.overrides.items() if k.startswith(TIMED_KEYS)}


def calibrate_stage(config: WorkflowConfig, work: Workdir) -> Stage:
    cal = config.calibrate
    values, overrides = calibrate_values(config, work)
    params = {"repeats": cal.repeats, "held_out_batches": cal.held_out_batches, "rank_speeds": cal.rank_speeds,
              **train_inputs(config), **{key: toml_text(value) for key, value in timed_overrides(config).items()}}

    def run() -> int:
        from freescale.jobs import calibrate
        from freescale.training.calibration.calibrate_spec import CalibrateSpec

        return calibrate.run(lambda: options.from_values(CalibrateSpec, values), overrides, tracking_of(config))

    def damage() -> str | None:
        from freescale.costs.cost_model import CostModel

        try:
            CostModel.load(work.cost_model)
        except InputError as exc:
            return str(exc)
        return json_damage(work.rank_speeds, "rank speeds file")() if cal.rank_speeds else None
    off = None if cal.enabled else (f"[calibrate] enabled = false; balance uses {cal.cost_model}" if cal.cost_model
                                    else "[calibrate] enabled = false; balance uses the built-in cost model")
    return Stage("calibrate", run, params, work.cost_model, damage, off=off)


def balance_values(config: WorkflowConfig, work: Workdir) -> dict[str, Any]:
    """The balance stage's spec values: the [balance] section, the shared sizes, [calibrate]'s cost
    model and rank speeds (as ``@FILE``, read when the stage runs: calibrate writes it first)."""
    p = config.pipeline
    values = {**options.section_values(config.balance), "input": str(work.prepared), "output": str(work.shards),
              "world_size": p.world_size, "local_batch_size": p.local_batch_size,
              "cost_model": used_cost_model(config, work), "overwrite": True}
    if config.calibrate.rank_speeds:
        values["capacities"] = f"@{work.rank_speeds}"
    return values


def balance_stage(config: WorkflowConfig, work: Workdir) -> Stage:
    p, cal = config.pipeline, config.calibrate
    spec, values = type(config.balance).spec, balance_values(config, work)

    def run() -> int:
        from freescale.jobs import balance

        return balance.run(lambda: options.from_values(spec, values), tracking_of(config))

    params: dict[str, Any] = {"world_size": p.world_size, "local_batch_size": p.local_batch_size,
                              **asdict(config.balance)}
    if cal.cost_model:
        params.update(cost_model=cal.cost_model, **{"cost_model identity": file_identity(cal.cost_model)})

    def damage() -> str | None:
        from freescale.shards.manifest import ShardError, load_manifest

        try:
            load_manifest(work.shards, p.world_size)
        except ShardError as exc:
            return str(exc)
        return None
    return Stage("balance", run, params, work.shards, damage)


def train_values(config: WorkflowConfig, work: Workdir) -> tuple[dict[str, Any], list[str]]:
    """The train stage's spec values ([train], the shards, one rank per world_size) and the overrides
    on its ranks' config (the checkpoint folder, [train.overrides], the experiment)."""
    p, tr = config.pipeline, config.train
    values = {**options.section_values(tr), "shards": str(work.shards), "nproc_per_node": p.world_size,
              "summary_json": str(work.summary), "tracking_uri": p.tracking_uri or None}
    return values, ["--checkpoint.folder", str(work.checkpoints), *override_argv(tr.overrides),
                    "--tracking.experiment", p.experiment]


def train_stage(config: WorkflowConfig, work: Workdir) -> Stage:
    spec, (values, overrides) = type(config.train).spec, train_values(config, work)
    params = {"world_size": config.pipeline.world_size, "max_steps": config.train.max_steps, **train_inputs(config),
              **{key: toml_text(value) for key, value in config.train.overrides.items()}}

    def run() -> int:
        from freescale.jobs import launch

        return launch.run(lambda: options.from_values(spec, values), overrides)

    def checkpoints(continuable: bool) -> str:
        return _prepare_checkpoints(work.checkpoints, continuable)
    return Stage("train", run, params, work.summary, json_damage(work.summary, "training summary"),
                 before_run=checkpoints)


def compare_values(config: WorkflowConfig, work: Workdir) -> dict[str, Any]:
    """The compare stage's spec values: [compare], the shared sizes, the cost model, and the balanced
    variant's plan options: [balance]'s, with [compare]'s strategy."""
    p, tr, cmp_cfg = config.pipeline, config.train, config.compare
    from_balance = options.section_values(config.balance)
    balanced = {f.name: from_balance.get(f.name, f.default) for f in options.on_surface(BalanceSpec, "compare")}
    return {"input": str(work.prepared), "world_size": p.world_size, "local_batch_size": p.local_batch_size,
            "repeats": cmp_cfg.repeats, "control": cmp_cfg.control, "config": tr.config or None,
            "cost_model": used_cost_model(config, work), "max_steps": cmp_cfg.max_steps or tr.max_steps or None,
            "workdir": str(work.compare), "summary_json": str(work.compare_summary),
            "balanced": {**balanced, "strategy": cmp_cfg.strategy}}


def compare_stage(config: WorkflowConfig, work: Workdir) -> Stage:
    values, overrides = compare_values(config, work), override_argv(config.train.overrides)
    balanced = {k: v for k, v in values["balanced"].items() if k != "strategy"}  # [compare] has the strategy
    params = {"world_size": config.pipeline.world_size, "local_batch_size": config.pipeline.local_batch_size,
              **asdict(config.compare), **balanced, "max_steps": config.compare.max_steps or config.train.max_steps,
              **train_inputs(config),
              **{key: toml_text(value) for key, value in config.train.overrides.items()},
              **({"cost_model identity": file_identity(config.calibrate.cost_model)}
                 if config.calibrate.cost_model else {})}

    def run() -> int:
        from freescale.jobs import compare

        return compare.run(lambda: options.from_values(compare.CompareSpec, values), overrides,
                           tracking_of(config))
    return Stage("compare", run, params, work.compare_summary, json_damage(work.compare_summary, "comparison summary"),
                 off=None if config.compare.enabled else "[compare] enabled = false")


def export_values(config: WorkflowConfig, work: Workdir) -> dict[str, Any]:
    """The export stage's spec values: [export]'s, from the train stage's checkpoints into <workdir>/model."""
    return {**options.section_values(config.export), "checkpoint": str(work.checkpoints),
            "output": str(work.model), "prepared": str(work.prepared), "overwrite": True}


def export_stage(config: WorkflowConfig, work: Workdir) -> Stage:
    """The trained model out of the train stage's checkpoints, into <workdir>/model, logged on its run."""
    values = export_values(config, work)
    params = {"register": config.export.register or None}

    def run() -> int:
        from freescale.jobs import export

        return export.run(lambda: options.from_values(export.ExportSpec, values), tracking_of(config))
    return Stage("export", run, params, work.model, json_damage(work.model / "model.json", "exported model"),
                 off=None if config.export.enabled else "[export] enabled = false")


def recommend_stage(config: WorkflowConfig, work: Workdir) -> Stage:
    """Every prepared user's top k from the exported model, into <workdir>/recommendations."""
    from freescale.training.export.recommend_spec import RecommendSpec  # standard library only

    values = {**options.section_values(config.recommend), "model": str(work.model), "input": str(work.prepared),
              "output": str(work.recommendations), "overwrite": True}
    params = {"k": config.recommend.k, "exclude_history": config.recommend.exclude_history or None}

    def run() -> int:
        from freescale.jobs import recommend

        return recommend.run(lambda: options.from_values(RecommendSpec, values), tracking_of(config))

    def damage() -> str | None:
        done = work.recommendations / "_SUCCESS"
        return None if done.is_file() else f"{done} is missing"
    off = None if config.recommend.enabled else "[recommend] enabled = false"
    if config.recommend.enabled and not config.export.enabled:
        off = "[recommend] needs [export] enabled = true (it scores the exported model)"
    return Stage("recommend", run, params, work.recommendations, damage, off=off)


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
    from freescale.runtime.job_errors import report
    from freescale.runtime.stops import Stopped, stop_of, stop_signal

    tap, saved = _ErrorLineTap(sys.stderr), sys.stderr
    sys.stderr = tap
    try:
        rc = stage.run()
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
    from freescale.runtime.stops import Stopped

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
    args, overrides = build_parser().parse_known_args(argv)
    return run(load_workflow_config(args.config, overrides), fresh=args.fresh)  # a bad key or value: one line


def run(config: WorkflowConfig, fresh: bool = False) -> int:
    """The pipeline of ``config``, holding its workdir's lock (exit 3 when another run holds it); its
    exit status. `freescale demo` calls it with the shipped config."""
    from freescale.runtime.job_errors import EXIT_ENVIRONMENT, error_line
    from freescale.runtime.stops import stop_of, stops_on_signals
    from freescale.tracking.runs import PIPELINE_ENV

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
        # the records and the lock are ended on the way out (freescale/runtime/stops.py: stops_on_signals).
        with stops_on_signals():
            try:
                _end_orphaned_runs(config, os.environ[PIPELINE_ENV])
                return run_pipeline(config, work, fresh=fresh)
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
    from freescale.tracking.runs import fail_orphaned_runs
    from freescale.tracking.store import resolve_tracking_uri

    try:
        orphans = fail_orphaned_runs(resolve_tracking_uri(config.pipeline.tracking_uri or None), workdir)
    except Exception as exc:  # noqa: BLE001 - tracking never stops the pipeline
        from freescale.tracking.runs import failure

        print(f"freescale pipeline: warning: could not end the MLflow runs a killed run left RUNNING "
              f"({failure(exc)})", file=sys.stderr, flush=True)
        return
    if orphans:
        print(f"freescale pipeline: note: {len(orphans)} MLflow run(s) of a killed run of this workdir "
              f"were still RUNNING: ended FAILED ({', '.join(orphans)})", file=sys.stderr, flush=True)


def _stopped_status(exc: BaseException) -> int:
    """The pipeline's last line and 128 + N for `exc`, which is (or surfaced after) stop signal N."""
    from freescale.runtime.job_errors import error_line
    from freescale.runtime.stops import stop_of

    signum = stop_of(exc)
    stage = getattr(exc, "stage", None)
    error_line("pipeline", f"stopped by signal {signum}" + (
        f" in stage {stage}: its MLflow run ended KILLED, its output left as it was, its record says killed"
        if stage else ""), details=False)
    return 128 + signum


def run_pipeline(config: WorkflowConfig, work: Path, fresh: bool) -> int:
    from freescale.runtime.job_errors import error_line

    started = time.perf_counter()
    lines: list[str] = []

    def say(text: str) -> None:
        lines.append(text)
        print(text, flush=True)

    if not config.prepare.input:  # the default: say it, so nobody takes the results for their data's
        p = config.prepare
        say(f"freescale pipeline: prepare   uses synthetic data ([prepare] has no input: {synthetic_text(p)})")
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
