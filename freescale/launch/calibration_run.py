"""One `freescale calibrate` run inside its MLflow run: time and fit the cost model
(freescale/training/calibration/calibrate.py), write it, optionally measure the ranks' relative speeds
(freescale/training/calibration/rank_speed_ranks.py), print the report (freescale/training/calibration/report.py) and record
everything: params, metrics, both JSON files and the report. freescale/jobs/calibrate.py is the command
line around it and opens the run.

Torch-free to import: the timing loads torch when a run starts, after the arguments and the
config were checked.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from freescale.runtime.errors import InputError
from freescale.training.calibration.calibrate_spec import TIMED_KEYS, CalibrateSpec


def calibration_device(choice: str, model: Any) -> str:
    """The device ``--device`` means here, checked with the model's encoder before any run or output
    exists: a missing GPU, or what the encoder cannot run there (HSTU: a kernel that cannot run or
    cannot take the config, the ranks' check) is one line (``freescale.training.model.registry.check_encoder``)."""
    import torch

    from freescale.training.model.registry import check_encoder

    if choice == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available to this process")
    device = choice if choice != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    check_encoder(model, device)
    return device


def config_record(spec: CalibrateSpec, config: Any, overrides: list[str]) -> dict:
    """The timed model's config as the provenance of both files records it."""
    return {"model": dataclasses.asdict(config.model), "loss": dataclasses.asdict(config.loss),
            "training": {"precision": config.training.precision, "cuda_graphs": config.training.cuda_graphs},
            "config_file": spec.config, "overrides": overrides}


def calibrate_and_record(spec: CalibrateSpec, config: Any, overrides: list[str], device: str, run: Any,
                         log: Callable[[str], None]) -> str:
    """Time, fit, write and report the cost model, then (with ``rank_speeds_output``) the rank speeds,
    and record both in ``run`` (a ``freescale.tracking.runs.JobRun``); the chosen form's name. A failed
    rank-speed measurement raises ``RankSpeedsFailed`` after the cost model was written."""
    from freescale.costs.calibration import default_lengths
    from freescale.training.calibration.calibrate import FIT_CLOCK, CalibrationSettings, run_calibration
    from freescale.training.calibration.report import format_calibration_report
    from freescale.training.config import to_flat_dict

    lengths = spec.length_grid or default_lengths(config.model.max_seq_len)
    settings = CalibrationSettings(
        lengths=tuple(lengths), num_items=spec.num_items, repeats=spec.repeats, warmup=spec.warmup,
        replicates=spec.replicates, held_out_batches=spec.held_out_batches,
        num_negatives=config.loss.num_negatives, full_softmax=config.loss.full_softmax,
        loss_kind=config.loss.kind, seed=spec.seed, device=device, precision=config.training.precision,
        cuda_graphs=config.training.cuda_graphs)
    record = config_record(spec, config, overrides)
    result = run_calibration(config.model, settings, record, log=log)
    artifacts = {"cost_model.json": result.model.save(spec.output)}
    report = format_calibration_report(result, spec.output)
    print("\n" + report + "\n", flush=True)
    metrics = calibration_metrics(result)

    if spec.rank_speeds_output:
        speeds_report = record_rank_speeds(spec, overrides, result, record, artifacts, metrics, log)
        report += "\n\n" + speeds_report

    artifacts["calibration_report.txt"] = report + "\n"
    params = {**{k: v for k, v in to_flat_dict(config).items() if k.startswith(TIMED_KEYS)},
              "lengths": ",".join(map(str, result.grid)), "repeats": spec.repeats, "warmup": spec.warmup,
              "replicates": spec.replicates, "num_items": spec.num_items, "held_out_batches": spec.held_out_batches,
              "seed": spec.seed, "output": spec.output, "config": spec.config, "device": device,
              "rank_speeds_output": spec.rank_speeds_output,
              "nproc_per_node": spec.nproc_per_node if spec.rank_speeds_output else None}
    run.log_params(params)
    run.log_metrics(metrics)
    for name, text in artifacts.items():
        run.log_text(text, name)
    chosen = result.fits[FIT_CLOCK].choice.chosen
    run.set_tags({"freescale.cost_model_kind": chosen, "freescale.host": result.machine["host"]})
    return chosen


def calibration_metrics(result: Any) -> dict[str, float]:
    """The MLflow metrics of a ``CalibrationResult``: the quadratic's coefficients, the fits' R^2 and
    held-out errors, and the chosen form's quality on the held-out mixed batches."""
    from freescale.costs.cost_model import KINDS
    from freescale.training.calibration.calibrate import FIT_CLOCK

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
    return metrics


def record_rank_speeds(spec: CalibrateSpec, overrides: list[str], result: Any, record: dict,
                       artifacts: dict[str, str], metrics: dict[str, float], log: Callable[[str], None]) -> str:
    """Measure the ranks' speeds, write ``rank_speeds_output``, print its report; its file joins
    ``artifacts`` and its capacities ``metrics``. The report."""
    import numpy as np

    from freescale.costs.rank_speeds import estimate_rank_speeds, rank_speeds_document, write_rank_speeds
    from freescale.training.calibration.calibrate import machine_info
    from freescale.training.calibration.report import format_rank_speeds_report
    from freescale.launch.rank_speed_launch import measure_rank_speeds

    log(f"measuring rank speeds: {spec.nproc_per_node} gloo ranks x {spec.rank_speed_repeats} repeats")
    raw = measure_rank_speeds(spec, overrides)
    wall, cpu = np.asarray(raw["wall"]), np.asarray(raw["cpu"])
    speeds = estimate_rank_speeds(wall, seed=spec.seed)
    cpu_speeds = estimate_rank_speeds(cpu, seed=spec.seed)
    provenance = {**machine_info(), "torch_threads": raw["threads_per_rank"], "created": result.created,
                  "config": record, "repeats": int(wall.shape[0]), "world_size": int(wall.shape[1]),
                  "hosts": raw["hosts"], "batches": raw["batches"],
                  "mean_wall_s": wall.mean(axis=0).tolist(), "mean_cpu_s": cpu.mean(axis=0).tolist(),
                  "cpu_clock_capacities": list(cpu_speeds.capacities), "wall_s": raw["wall"], "cpu_s": raw["cpu"]}
    document = rank_speeds_document(speeds, provenance)
    artifacts["rank_speeds.json"] = write_rank_speeds(spec.rank_speeds_output, document)
    report = format_rank_speeds_report(document)
    print(report + "\n", flush=True)
    metrics["rank_speed_spread"] = speeds.spread
    metrics["rank_speeds_significant"] = float(speeds.significant)
    metrics.update({f"rank{r}_capacity": c for r, c in enumerate(speeds.capacities)})
    return report

