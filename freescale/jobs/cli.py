"""The `freescale` command: one entry point for every job.

    freescale prepare ...   raw logs -> sequences          (freescale/jobs/prepare.py)
    freescale balance ...   sequences -> balanced shards   (freescale/jobs/balance.py)
    freescale train ...     shards -> trained model, measured bubbles (freescale/jobs/train.py, torchrun)
    freescale calibrate ... fit the cost model and rank speeds to this machine (freescale/jobs/calibrate.py)
    freescale compare ...   contiguous vs balanced (vs mirror control) training, one MLflow parent run (freescale/jobs/compare.py)
    freescale pipeline ...  prepare, calibrate, balance, train [, compare, export] from one TOML, rerun-safe (freescale/jobs/workflow/run.py)
    freescale simulate ...  predicted step time and bubbles of a plan on K ranks (freescale/jobs/simulate.py)
    freescale export ...    a training checkpoint -> one model folder and an MLflow model (freescale/jobs/export.py)
    freescale recommend ... an exported model + sequences -> every user's top k, as Parquet (freescale/jobs/recommend.py)
    freescale demo          the pipeline on the embedded synthetic default, ending with a comparison and the model

A failing job prints one line last, `freescale JOB: error: MESSAGE (details: LOG)`, and exits
0 done, 2 bad input or arguments, 3 an environment problem (CUDA, Java/Spark, a comm backend,
tracking), 1 anything else. Stack traces go to LOG ($FREESCALE_LOG_DIR, default out/logs);
--verbose, accepted by every subcommand, leaves them on the terminal.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SUBCOMMANDS = ("prepare", "balance", "train", "calibrate", "compare", "pipeline", "simulate", "export", "recommend",
               "demo")


def shipped_configs() -> Path:
    """The project's configs/: the checkout's when run from one, else the installed wheel's copy
    (``<prefix>/share/freescale/configs``, pyproject.toml's data-files)."""
    import sysconfig

    checkout = Path(__file__).resolve().parents[2] / "configs"
    if checkout.is_dir():
        return checkout
    return Path(sysconfig.get_paths()["data"]) / "share" / "freescale" / "configs"


def demo(argv: list[str]) -> int:
    """Embedded default: `freescale pipeline` with configs/demo_pipeline.toml: calibrate, prepare synthetic
    data, balance (kk, windows of 32), train 40 steps, compare contiguous vs balanced (local Spark,
    sqlite MLflow, 2 gloo ranks).

    Stages whose fingerprint matches and whose output is intact are skipped, so a rerun resumes where it stopped.
    """
    from freescale.jobs.workflow import run as workflow
    from freescale.jobs.workflow.config import load_workflow_config

    p = argparse.ArgumentParser(prog="freescale demo", description=demo.__doc__)
    p.add_argument("--workdir", default="out/demo", help="where the stages write (default out/demo)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--local-batch-size", type=int, default=32)
    p.add_argument("--fresh", action="store_true", help="rerun every stage even if its output is current")
    args = p.parse_args(argv)
    configs = shipped_configs()
    # The built-in files wherever the demo runs from; the sizes and workdir from the command line.
    config = load_workflow_config(str(configs / "demo_pipeline.toml"), [
        "--train.config", str(configs / "demo.toml"), "--pipeline.workdir", args.workdir,
        "--pipeline.world_size", str(args.world_size), "--pipeline.local_batch_size", str(args.local_batch_size)])
    rc = workflow.run(config, fresh=args.fresh)
    if rc == 0:
        # The mlflow beside this interpreter (a checkout's .venv, or the venv the wheel went into).
        mlflow = Path(sys.executable).parent / "mlflow"
        shown = os.path.relpath(mlflow)
        shown = str(mlflow) if shown.startswith("..") else shown
        print(f"freescale demo: done; shards in {Path(args.workdir) / 'shards'}, comparison in "
              f"{Path(args.workdir) / 'compare_summary.json'}; browse the runs with: "
              f"{shown} ui --backend-store-uri sqlite:///mlflow.db")
        print(quality_line(Path(args.workdir) / "train_summary.json"))
    return rc


def quality_line(summary_json: Path) -> str:
    """The demo model's test HR@10 and NDCG@10 against the most-popular baseline on the same users and protocol
    (the training's summary: ``freescale.training.eval.evaluator``), and by how much it beats or trails it."""
    import json

    summary = json.loads(summary_json.read_text()).get("summary", {}) if summary_json.is_file() else {}
    names = ("hr_at_10", "ndcg_at_10")
    if not all(name in summary and f"popular_{name}" in summary for name in names):
        return f"freescale demo: model quality: not in {summary_json} (the training did not evaluate)"
    parts = []
    for name, shown in zip(names, ("HR@10", "NDCG@10")):
        model, popular = summary[name], summary[f"popular_{name}"]
        change = f"{(model - popular) / popular:+.0%}" if popular else "n/a"
        parts.append(f"{shown} {model:.3f} vs most-popular {popular:.3f} ({change})")
    verdict = "beats" if all(summary[n] > summary[f"popular_{n}"] for n in names) else "does not beat"
    return f"freescale demo: the trained model {verdict} most-popular on its test users: {'; '.join(parts)}"


def main(argv: list[str] | None = None) -> int:
    from freescale.runtime.job_errors import run_job
    from freescale.runtime import logs

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--verbose" in argv:  # every subcommand's flag, handled here so no job parser needs it
        argv = [arg for arg in argv if arg != "--verbose"]
        logs.set_verbose()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    # One log per invocation, named after the subcommand, shared with every process the job starts
    # (Spark's JVM and workers, torchrun's ranks); the variable is put back when the command ends.
    saved = os.environ.get(logs.LOG_FILE_ENV)
    os.environ[logs.LOG_FILE_ENV] = str(logs.log_file(command).absolute())
    try:
        return run_job(command, lambda: _dispatch(command, rest))
    finally:
        if saved is None:
            del os.environ[logs.LOG_FILE_ENV]
        else:
            os.environ[logs.LOG_FILE_ENV] = saved


def _dispatch(command: str, rest: list[str]) -> int:
    if command == "prepare":
        from freescale.jobs.prepare import main as run
    elif command == "balance":
        from freescale.jobs.balance import main as run
    elif command == "train":
        from freescale.jobs.launch import launch as run
    elif command == "calibrate":
        from freescale.jobs.calibrate import main as run
    elif command == "compare":
        from freescale.jobs.compare import main as run
    elif command == "pipeline":
        from freescale.jobs.workflow.run import main as run
    elif command == "simulate":
        from freescale.jobs.simulate import main as run
    elif command == "export":
        from freescale.jobs.export import main as run
    elif command == "recommend":
        from freescale.jobs.recommend import main as run
    else:
        run = demo
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
