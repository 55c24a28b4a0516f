"""`freescale calibrate`: fit the balancer's cost model to this machine and measure relative rank speeds.

    freescale calibrate --output cost_model.json [--config FILE] [--lengths 16,32,64,...] [--repeats N]
                        [--num-items N] [--held-out-batches N] [--rank-speeds-output rank_speeds.json]
                        [--nproc-per-node 2] [--overwrite] [--tracking-uri URI] [--model.hstu.num_layers 1 ...]
    freescale balance ... --cost-model cost_model.json --capacities @rank_speeds.json

1. Times the configured model's dense forward+backward on synthetic batches, the encoder
   at the config's ``training.precision`` (training/calibrate.py explains the design), fits
   ``cost = a L^2 + b L + c`` and a table of costs at the profiled lengths
   (pipeline/calibration.py), and writes the form that predicts held-out lengths better
   as a cost-model JSON whose ``provenance`` records the machine, config, fits, errors and
   the choice.
2. Checks the written model against held-out mixed batches of heavy-tailed lengths.
3. With ``--rank-speeds-output``: starts ``--nproc-per-node`` gloo ranks (torch's
   launcher, as `freescale train` does) that time the same batches in lock-step;
   each rank's capacity (mean time over all ranks / its own) gets a bootstrap
   confidence interval, and capacities other than 1 are written only when the
   difference is real and larger than 2% (pipeline/rank_speeds.py: the
   statistics and the file, which `freescale balance` reads).
4. Prints the report and records it, with both JSON files, in MLflow.

Bad input (unparseable or non-positive --lengths, an existing output without
--overwrite, ...) ends the job with one line on stderr and exit status 2. The
arguments are checked before torch is loaded, so that takes a fraction of a second.

This module is the command line, its report, and the launcher and worker of the
rank-speed measurement; the timing is in training/calibrate.py.

Timing is on this machine's CPU with one intra-op thread (the trainer's setting
when ranks fill the cores, as on a 2-core machine with 2 ranks). CUDA ranks would
need CUDA-event timing, which this command does not do yet.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.tracking import add_tracking_arguments  # noqa: E402  (no mlflow import until a run opens)
from pipeline.calibration import check_lengths  # noqa: E402
from pipeline.errors import InputError  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER_FLAG = "--rank-speeds-worker"
RANK_SPEED_BATCHES = 4
"""Mixed batches each rank times per repeat (identical on every rank)."""


# ----------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale calibrate", description=__doc__.split("\n\n")[0],
                                epilog="Other --section.key VALUE arguments override the config, as for `freescale train`.")
    p.add_argument("--output", required=True, help="cost-model JSON to write (for `freescale balance --cost-model`)")
    p.add_argument("--config", help="TOML config whose [model], [loss] and training.precision are calibrated "
                                     "(default: built-in defaults)")
    p.add_argument("--lengths", help="comma-separated history lengths to profile "
                                     "(default: 10 log-spaced from 16 to model.hstu.max_seq_len)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds over all batches; medians are used (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--replicates", type=int, default=2, help="calibration batches per length (default 2)")
    p.add_argument("--num-items", type=int, default=2000, help="synthetic catalog size (default 2000)")
    p.add_argument("--held-out-batches", type=int, default=24,
                   help="mixed batches the written model is checked on; 0 skips the check (default 24)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic batches and the model (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model is timed: cpu (thread CPU clock) or cuda (CUDA events); "
                        "auto = cuda when available (default)")
    p.add_argument("--rank-speeds-output", help="also measure relative rank speeds and write them here "
                                                "(for `freescale balance --capacities @FILE`)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks for the rank-speed measurement (default 2)")
    p.add_argument("--rank-speed-repeats", type=int, default=30,
                   help="lock-step repeats of the rank-speed measurement (default 30)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    add_tracking_arguments(p)
    p.add_argument("--run-name", help="MLflow run name (default calibrate-<host>)")
    return p


def parse_lengths(text: str) -> list[int]:
    """``"16,32,64"`` -> sorted distinct lengths; anything else is an ``InputError``."""
    values = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise InputError(f"--lengths {text!r}: {part.strip()!r} is not an integer "
                             "(expected comma-separated lengths like 16,64,256)") from None
        if value <= 0:
            raise InputError(f"--lengths {text!r}: {value} is not a positive length")
        values.append(value)
    return sorted(set(values))


def check_args(args: argparse.Namespace) -> None:
    """Every problem with the arguments as one ``InputError``, before any work or heavy import."""
    minimums = (("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0), ("--replicates", args.replicates, 1),
                ("--num-items", args.num_items, 1), ("--held-out-batches", args.held_out_batches, 0),
                ("--nproc-per-node", args.nproc_per_node, 2), ("--rank-speed-repeats", args.rank_speed_repeats, 3))
    for flag, value, minimum in minimums:
        if value < minimum:
            raise InputError(f"{flag} must be at least {minimum}, got {value}")
    if 0 < args.held_out_batches < 3:
        raise InputError(f"--held-out-batches must be 0 or at least 3 (a correlation needs them), "
                         f"got {args.held_out_batches}")
    outputs = [Path(args.output)] + ([Path(args.rank_speeds_output)] if args.rank_speeds_output else [])
    if len(outputs) == 2 and outputs[0].resolve() == outputs[1].resolve():
        raise InputError(f"--output and --rank-speeds-output are the same file {outputs[0]}")
    for path in outputs:
        if path.exists() and not args.overwrite:
            raise InputError(f"output {path} already exists (pass --overwrite to replace it)")
        if path.is_dir():
            raise InputError(f"output {path} is a directory")
    if args.lengths:
        check_lengths(parse_lengths(args.lengths))


# ------------------------------------------------------------------------- reports


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:+.1%}"


def format_calibration_report(result: Any, output: str) -> str:
    """Readable tables of a ``CalibrationResult``: per-length costs, fits, choice, held-out check."""
    from pipeline.cost_model import KINDS
    from training.calibrate import CLOCKS, FIT_CLOCK, MIX_SAMPLES, PARETO_ALPHA, per_length_errors

    m, s = result.machine, result.settings
    fit = result.fits[FIT_CLOCK]
    held = [b for b in result.batches if b.probe_length not in result.grid]
    fit_err = {k: per_length_errors(result.batches, fit.final[k].fit_errors) for k in KINDS}
    cv_err = {k: per_length_errors(held, fit.choice.scores[k].cv_errors) for k in KINDS}
    table_form, quad_form = fit.final["table"].form, fit.final["quadratic"].form
    out = [(f"freescale calibrate: {m['host']} ({m['processor']}, {m['cpu_count']} cores), torch {m['torch']}, "
           f"1 thread; {len(result.batches)} calibration + {s.held_out_batches} held-out batches x "
           f"{s.repeats} rounds in {result.seconds:.0f} s; encoder in {s.precision}"),
           "",
           ("Per-sample cost, thread CPU ms (forms fitted to all calibration batches; errors are of the batch "
           "times, mean over the batches probing the length; held-out: fitted on grid-length batches only)")]
    rows = []
    for length in sorted(result.grid + result.held_out):
        rows.append([str(length), "grid" if length in result.grid else "held-out",
                     f"{table_form.per_sample([length])[0] * 1e3:.3f}", f"{quad_form.per_sample([length])[0] * 1e3:.3f}",
                     _pct(fit_err["table"][length]), _pct(fit_err["quadratic"][length]),
                     _pct(cv_err["table"].get(length)), _pct(cv_err["quadratic"].get(length))])
    out.append(_table(["L", "set", "table ms", "quadratic ms", "fit err table", "fit err quad",
                       "held-out err table", "held-out err quad"], rows))
    out += ["", "Fits of t(batch) = d + sum_i cost(L_i), non-negative least squares on relative error"]
    rows = []
    for clock in CLOCKS:
        for kind in KINDS:
            final, cv = result.fits[clock].final[kind], result.fits[clock].choice.scores[kind]
            model = final.form.model
            coef = ([f"{model.a:.3e}", f"{model.b:.3e}", f"{model.c:.3e}"] if kind == "quadratic"
                    else ["-", "-", "-"])
            rows.append([clock, kind, *coef, f"{final.form.step_constant:.3e}", f"{final.r2:.4f}",
                         f"{cv.cv_rms:.2%}"])
    out.append(_table(["clock", "form", "a s/L^2", "b s/L", "c s", "d s/step", "R^2", "held-out RMS err"], rows))
    out.append("(a coefficient of 0 sits on the non-negativity bound; d is the per-step constant, not in the cost "
               "model; R^2 over calibration batch times, held-out error over the held-out-length batches)")
    out += ["", f"chosen (thread CPU clock): {fit.choice.chosen} -- {fit.choice.reason}; written to {output}"]

    v = result.validation
    if v is not None:
        out += ["", (f"Held-out mixed batches: {len(v.batches)} batches of {MIX_SAMPLES[0]}-{MIX_SAMPLES[1]} samples, "
                    f"Pareto({PARETO_ALPHA}) lengths in [{result.grid[0]}, {result.grid[-1]}], thread CPU clock; "
                    "ratio error = |(predicted/mean) / (measured/mean) - 1|")]
        rows = []
        for name, q in v.quality.items():
            label = f"{name} (chosen)" if name == fit.choice.chosen else name
            rows.append([label, f"{q.correlation:.4f}", f"{q.median_abs_error:.1%}", f"{q.p90_abs_error:.1%}"])
        out.append(_table(["predictor", "correlation", "median ratio err", "p90 ratio err"], rows))
        chosen = v.predicted[fit.choice.chosen]
        errors = v.quality[fit.choice.chosen].ratio_errors
        rows = [[str(len(b)), str(sum(b)), str(max(b)), f"{v.measured[FIT_CLOCK][i] * 1e3:.2f}",
                 f"{chosen[i] * 1e3:.2f}", _pct(errors[i])] for i, b in enumerate(v.batches[:8])]
        out += ["", f"first {len(rows)} held-out batches ({fit.choice.chosen}):",
                _table(["samples", "tokens", "longest", "measured ms", "predicted ms", "ratio err"], rows)]
    return "\n".join(out)


def format_rank_speeds_report(document: dict) -> str:
    prov = document["provenance"]
    rows = []
    for rank, capacity in enumerate(prov["measured_capacities"]):
        low, high = document["ci"][rank]
        rows.append([str(rank), prov["hosts"][rank], f"{prov['mean_wall_s'][rank] * 1e3:.2f}",
                     f"{prov['mean_cpu_s'][rank] * 1e3:.2f}", f"{capacity:.4f}", f"[{low:.4f}, {high:.4f}]",
                     f"{prov['cpu_clock_capacities'][rank]:.4f}"])
    verdict = ("significant: yes -- " if document["significant"] else "significant: no -- ") + prov["reason"]
    return "\n".join([
        (f"Rank speeds: {len(rows)} ranks timing identical batches in lock-step, {prov['repeats']} repeats "
        f"(capacity = mean time of all ranks / the rank's, wall clock; {prov['confidence']:.0%} bootstrap CI)"),
        _table(["rank", "host", "mean wall ms", "mean cpu ms", "capacity", f"{prov['confidence']:.0%} CI",
                "capacity (cpu clock)"], rows),
        verdict + f"; wrote capacities {[round(c, 4) for c in document['capacities']]}"])


# -------------------------------------------------------------- rank-speed measurement


def rank_speeds_worker(argv: list[str]) -> int:
    """One rank (under torch's launcher): time the same batches as every other rank, in lock-step."""
    import torch
    import torch.distributed as dist

    from training.calibrate import (
        caching_malloc,
        heavy_tailed_batches,
        synthetic_batch,
        time_dense_step,
    )
    from training.config import ParallelConfig, load_config
    from training.distributed import init_distributed
    from training.model import build_dense_model

    parser = argparse.ArgumentParser(prog="jobs.calibrate " + WORKER_FLAG)
    parser.add_argument("--result", required=True)
    parser.add_argument("--config")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--num-items", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.config, overrides)
    parallel = ParallelConfig(backend="gloo", collective_timeout_s=config.parallel.collective_timeout_s)
    env = init_distributed(parallel, config.training.threads)

    # Same seed on every rank: identical parameters, batches and negatives, so any
    # difference in time is the rank's, not its work's.
    torch.manual_seed(args.seed)
    model, table = build_dense_model(args.num_items, config.model, precision=config.training.precision)
    model.train()
    max_length = config.model.max_seq_len
    mixes = heavy_tailed_batches(RANK_SPEED_BATCHES, min(16, max_length), max_length, args.seed + 7)
    batches = [synthetic_batch(m, args.num_items, seed=args.seed + i) for i, m in enumerate(mixes)]
    gathered = []
    with caching_malloc():
        for repeat in range(args.warmup + args.repeats):
            dist.barrier()  # lock-step: every rank starts the repeat together, under the same machine load
            times = [time_dense_step(model, table, b, config.loss.num_negatives, config.loss.full_softmax, seed=i,
                                     loss_kind=config.loss.kind)
                     for i, b in enumerate(batches)]
            local = torch.tensor([sum(t.wall_s for t in times), sum(t.cpu_s for t in times)], dtype=torch.float64)
            everyone = [torch.empty_like(local) for _ in range(env.world_size)]
            dist.all_gather(everyone, local)
            if repeat >= args.warmup:
                gathered.append(torch.stack(everyone).tolist())
    hosts: list[Any] = [None] * env.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    if env.rank == 0:
        Path(args.result).write_text(json.dumps({
            "wall": [[rank[0] for rank in row] for row in gathered],
            "cpu": [[rank[1] for rank in row] for row in gathered],
            "hosts": hosts, "threads_per_rank": torch.get_num_threads(),
            "batches": [list(m) for m in mixes]}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def measure_rank_speeds(args: argparse.Namespace, overrides: list[str]) -> dict:
    """Launch the ranks with torch's elastic launcher; the raw ``[repeats, ranks]`` times rank 0 gathered."""
    with tempfile.TemporaryDirectory(prefix="freescale-rank-speeds-") as tmp:
        result = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc_per_node}", "-m", "jobs.calibrate", WORKER_FLAG,
               "--result", str(result), "--repeats", str(args.rank_speed_repeats),
               "--num-items", str(args.num_items), "--seed", str(args.seed)]
        if args.config:
            cmd += ["--config", args.config]
        cmd += overrides
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0 or not result.exists():
            tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"rank-speed ranks failed (exit {run.returncode}):\n{tail}")
        return json.loads(result.read_text())


# ---------------------------------------------------------------------------- the job


def calibration_device(choice: str, model: Any) -> str:
    """The device ``--device`` means here, checked with the model's encoder before any run or output
    exists: a missing GPU, or what the encoder cannot run there (HSTU: a kernel that cannot run or
    cannot take the config, the ranks' check) is one line (``ModelConfig.check_device``)."""
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available to this process")
    device = choice if choice != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model.check_device(device)
    return device


def calibrate(args: argparse.Namespace, overrides: list[str]) -> int:
    # Arguments and the config (typed, torch-free) first: a bad one is reported before the
    # imports below, which load torch (seconds).
    check_args(args)
    from training.config import load_config, to_flat_dict

    config = load_config(args.config, overrides)
    device = calibration_device(args.device, config.model)

    import dataclasses
    import socket

    import numpy as np

    from training.tracking import job_run, reachable_tracking_uri
    from pipeline.calibration import default_lengths
    from pipeline.cost_model import KINDS
    from pipeline.rank_speeds import estimate_rank_speeds, rank_speeds_document, write_rank_speeds
    from training.calibrate import FIT_CLOCK, CalibrationSettings, machine_info, run_calibration
    args.tracking_uri = reachable_tracking_uri("calibrate", args.tracking_uri)  # unreachable: one warning, untracked

    # The run spans the job's work (profiling, rank speeds), FAILED if the job fails.
    with job_run("calibrate", tracking_uri=args.tracking_uri, experiment=args.experiment,
                 tags={"freescale.output": str(Path(args.output))},
                 run_name=args.run_name or f"calibrate-{socket.gethostname()}") as run:
        lengths = parse_lengths(args.lengths) if args.lengths else default_lengths(config.model.max_seq_len)
        settings = CalibrationSettings(
            lengths=tuple(lengths), num_items=args.num_items, repeats=args.repeats, warmup=args.warmup,
            replicates=args.replicates, held_out_batches=args.held_out_batches,
            num_negatives=config.loss.num_negatives, full_softmax=config.loss.full_softmax,
            loss_kind=config.loss.kind, seed=args.seed, device=device, precision=config.training.precision)
        config_record = {"model": dataclasses.asdict(config.model), "loss": dataclasses.asdict(config.loss),
                         "training": {"precision": config.training.precision},
                         "config_file": args.config, "overrides": overrides}
        def log(message: str) -> None:
            print(f"freescale calibrate: {message}", flush=True)

        result = run_calibration(config.model, settings, config_record, log=log)
        model_text = result.model.save(args.output)
        report = format_calibration_report(result, args.output)
        print("\n" + report + "\n", flush=True)

        artifacts = {"cost_model.json": model_text}
        fit = result.fits[FIT_CLOCK]
        quad = fit.final["quadratic"].form.model
        metrics: dict[str, float] = {
            "quadratic_a": quad.a, "quadratic_b": quad.b, "quadratic_c": quad.c,
            "step_constant_s": result.chosen.step_constant, "calibration_seconds": result.seconds,
            **{f"r2_{k}": fit.final[k].r2 for k in KINDS},
            **{f"cv_rms_relative_error_{k}": fit.choice.scores[k].cv_rms for k in KINDS},
        }
        if result.validation is not None:
            quality = result.validation.quality[fit.choice.chosen]
            metrics.update(heldout_correlation=quality.correlation, heldout_median_ratio_error=quality.median_abs_error,
                           heldout_p90_ratio_error=quality.p90_abs_error)

        if args.rank_speeds_output:
            log(f"measuring rank speeds: {args.nproc_per_node} gloo ranks x {args.rank_speed_repeats} repeats")
            try:
                raw = measure_rank_speeds(args, overrides)
            except RuntimeError as err:
                print(f"freescale calibrate: error: {err}\n(the cost model {args.output} was written; "
                      "no rank speeds were)", file=sys.stderr)
                run.end("FAILED")
                return 1
            wall, cpu = np.asarray(raw["wall"]), np.asarray(raw["cpu"])
            speeds = estimate_rank_speeds(wall, seed=args.seed)
            cpu_speeds = estimate_rank_speeds(cpu, seed=args.seed)
            provenance = {**machine_info(), "torch_threads": raw["threads_per_rank"], "created": result.created,
                          "config": config_record, "repeats": int(wall.shape[0]), "world_size": int(wall.shape[1]),
                          "hosts": raw["hosts"], "batches": raw["batches"],
                          "mean_wall_s": wall.mean(axis=0).tolist(), "mean_cpu_s": cpu.mean(axis=0).tolist(),
                          "cpu_clock_capacities": list(cpu_speeds.capacities), "wall_s": raw["wall"], "cpu_s": raw["cpu"]}
            document = rank_speeds_document(speeds, provenance)
            artifacts["rank_speeds.json"] = write_rank_speeds(args.rank_speeds_output, document)
            speeds_report = format_rank_speeds_report(document)
            print(speeds_report + "\n", flush=True)
            report += "\n\n" + speeds_report
            metrics["rank_speed_spread"] = speeds.spread
            metrics["rank_speeds_significant"] = float(speeds.significant)
            metrics.update({f"rank{r}_capacity": c for r, c in enumerate(speeds.capacities)})

        artifacts["calibration_report.txt"] = report + "\n"
        # What the timed model is: its shape, its loss and the encoder's arithmetic.
        timed = ("model.", "loss.", "training.precision")
        params = {**{k: v for k, v in to_flat_dict(config).items() if k.startswith(timed)},
                  "lengths": ",".join(map(str, result.grid)), "repeats": args.repeats, "warmup": args.warmup,
                  "replicates": args.replicates, "num_items": args.num_items, "held_out_batches": args.held_out_batches,
                  "seed": args.seed, "output": args.output, "config": args.config, "device": device,
                  "rank_speeds_output": args.rank_speeds_output,
                  "nproc_per_node": args.nproc_per_node if args.rank_speeds_output else None}
        run.log_params(params)
        run.log_metrics(metrics)
        for name, text in artifacts.items():
            run.log_text(text, name)
        run.set_tags({"freescale.cost_model_kind": fit.choice.chosen, "freescale.host": result.machine["host"]})
    log(f"wrote {args.output} ({fit.choice.chosen})"
        + (f" and {args.rank_speeds_output}" if args.rank_speeds_output else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    from jobs.job_errors import run_job

    args, overrides = build_parser().parse_known_args(argv)
    return run_job("calibrate", lambda: calibrate(args, overrides))


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] == [WORKER_FLAG]:
        from jobs.job_errors import run_job

        status = run_job(f"calibrate (rank {os.environ.get('RANK', '0')})",
                         lambda: rank_speeds_worker(arguments[1:]))
        from training.distributed import exit_without_finalization

        exit_without_finalization(status)
    sys.exit(main(arguments))
