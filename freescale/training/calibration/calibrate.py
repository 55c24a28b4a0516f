"""Calibrating the balancer's cost model on this machine: design batches, time them, fit, validate.

``freescale calibrate`` runs ``run_calibration`` (freescale/launch/calibration_run.py). This
module is the half that needs torch: the batches, their timing and the
provenance of the result. The fitting, the choice of form and the rank-speed
statistics are pure NumPy and live beside the cost model they produce
(freescale/costs/calibration.py, freescale/costs/rank_speeds.py), tested on exact synthetic data.

What is timed
    The dense forward+backward of the configured model on synthetic histories:
    from the return of the item-table lookup until the gradient reaches the
    lookup's outputs. That is the span the trainer records as
    ``dense_compute_s`` and the work the balancer equalises; the lookup itself
    is an all-to-all in the sharded trainer, not per-rank compute, so it is left
    out (the fitted model has ``per_id = 0``). The encoder computes at ``training.precision``
    (``CalibrationSettings.precision``), as the trainer's will: the costs depend on it.

Which clock
    Both the calling thread's CPU clock and the wall clock, with one intra-op
    thread. CPU autograd runs backward on the calling thread, so the thread
    clock sees the whole step, and unlike the wall clock it does not grow while
    other processes hold the core. The fits, the choice of form and the
    validation use the CPU clock; the wall-clock fit is reported beside it.
    Freed memory stays in the process (``caching_malloc``), as under the CUDA
    caching allocator the trainer runs on, so page faults do not depend on the
    allocator's history. Batches are timed round-robin, so a slow period on a
    shared machine hits all of them alike, and each is summarised by its median.

What the forms are fitted to: times of realistic batches
    Each profiled length L gets batches of a few *probe* samples around L
    (about 256 tokens, distinct lengths within +-25% of L, mean exactly L) on
    top of a random *background* of 8-16 heavy-tailed histories, i.e. batches
    like a rank's step (each length's first batch has no background, see below). Both forms are fitted to their times as
    ``t(batch) = d + sum_i cost(L_i)`` (freescale/costs/calibration.py), ``d`` being
    the step's constant. Why not time batches of equal lengths and divide
    (measured here):

    * The encoder runs attention per group of equal-length samples, and every
      group costs a fixed few dozen small ops per layer. Measured with the
      default model on this project's CPU machine: 16 histories of length 16
      take 4.0 ms together, 16 distinct lengths from 8 to 24 take 11.1 ms -- equal
      lengths make a short sample look ~4x cheaper than it is in a real batch,
      where diverse histories rarely share lengths. Probes have distinct
      lengths; backgrounds collide as often as real batches do.
    * A step has a constant cost whatever its samples (the loss's and the layers' fixed ops,
      whatever the lengths): measured with the CPU virtual-ranks model (benchmarks/configs/cpu_virtual_ranks.toml),
      one history of 40 takes 6.5 ms and 16 histories of 40-70 take 36 ms. Batches of 9-32 samples
      cannot tell that constant from a per-sample one, and the fit put it all on the samples
      (``d`` = 0), under-predicting a batch of 8 by 18% and one of 1 by 70%; so the first replicate
      of each length is its probes alone (1-16 samples), which separates the two.
    * The loss's in-batch negatives make a step cost ``~ T * (negatives + U)``
      for T tokens and U distinct targets: the one part of a step that is not a
      sum over samples (1024 tokens of 16-long histories: 22 ms with in-batch
      negatives, 14 ms without). No per-sample model captures it exactly;
      fitting on batches of realistic size and mix gives the additive model
      that is best where the balancer uses it. It is also why ``d`` and ``c``
      can fit to 0: batch time grows faster than its token count, which a
      non-negative intercept cannot express.

Choosing the form
    Both forms are fitted to the batches probing the grid lengths and scored
    on those probing the held-out lengths between them; the better predictor
    is refitted on all batches (freescale/costs/calibration.py says why).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import os
import platform
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from freescale.costs.calibration import (
    FittedForm,
    FormChoice,
    FormScore,
    PredictionQuality,
    check_lengths,
    compare_forms,
    held_out_lengths,
    prediction_quality,
    score_form,
)
from freescale.costs.cost_model import KINDS, STEP_CONSTANT_KEY, CostModel, default_cost_model
from freescale.training.data.batch import SequenceBatch
from freescale.training.timing.bubbles import DenseSpanProbe
from freescale.training.config import CudaGraphs, LossKind, ModelConfig, Precision
from freescale.training.model.recommender import LocalItemTable, SequentialRecommender, build_dense_model

CLOCKS = ("cpu", "wall")
FIT_CLOCK = "cpu"
PROBE_TOKENS = 256
"""Tokens of probe samples per calibration batch (fewer for short lengths: they must be distinct)."""
PROBE_SPREAD = 0.25
"""Probe lengths stay within +-25% of their nominal length."""
PARETO_ALPHA = 1.1
"""Tail index of background and held-out lengths: most histories short, a few near the longest."""
MIX_SAMPLES = (8, 16)
"""Samples per background and per held-out mixed batch."""

# glibc mallopt parameters (malloc.h) and their documented defaults.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_GLIBC_DEFAULT_THRESHOLD = 128 * 1024


# --------------------------------------------------------------------------- timing


@contextlib.contextmanager
def caching_malloc() -> Iterator[None]:
    """Keep freed memory in the process while timing, as a caching allocator would.

    glibc serves big blocks with mmap and returns them to the kernel on free, so
    every step would re-fault its attention buffers; that kernel time depends on
    the allocator's history, not on the model's compute. Not glibc: nothing to tune.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's maximum on 64-bit
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread: the thread CPU clock then sees all of a step's compute."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class StepTime:
    """One timed dense forward+backward, seconds."""

    cpu_s: float
    wall_s: float


def synthetic_batch(lengths: Sequence[int], num_items: int, seed: int) -> SequenceBatch:
    """A batch of histories with the given lengths: uniform item ids, increasing timestamps, ratings 1..5."""
    g = torch.Generator().manual_seed(seed)
    sample_lengths = torch.tensor(list(lengths), dtype=torch.int64)
    tokens, size = int(sample_lengths.sum()), len(lengths)
    targets = torch.randint(1, num_items + 1, (size,), generator=g)
    return SequenceBatch(
        lengths=sample_lengths,
        item_ids=torch.randint(1, num_items + 1, (tokens,), generator=g),
        timestamps=torch.cumsum(torch.randint(1, 100_000, (tokens,), generator=g), 0),
        ratings=torch.randint(1, 6, (tokens,), generator=g),
        valid_item=targets,
        test_item=targets,
        valid_timestamp=torch.zeros(size, dtype=torch.int64),
        test_timestamp=torch.zeros(size, dtype=torch.int64),
        user_ids=[f"synthetic-{i}" for i in range(size)],
    )


def time_dense_step(model: SequentialRecommender, table: LocalItemTable, batch: SequenceBatch, num_negatives: int,
                    full_softmax: bool = False, seed: int = 0,
                    loss_kind: LossKind = "sampled_softmax") -> StepTime:
    """Time one training forward+backward's dense span, the rows from ``table`` (``build_dense_model``:
    a plain table, so timing loads no TorchRec); the same ``seed`` gives the same negatives."""
    generator = torch.Generator().manual_seed(seed)
    if next(model.encoder.parameters()).device.type == "cuda":
        return _time_cuda_step(model, table, batch, num_negatives, full_softmax, generator, loss_kind)
    probe = DenseSpanProbe()
    loss, _ = model(batch, num_negatives, full_softmax=full_softmax, generator=generator,
                    source=probe.timed(table.source()), loss_kind=loss_kind)
    loss.backward()
    end_cpu, end_wall = probe.end_cpu, probe.end_wall
    if end_cpu is None or end_wall is None:  # no gradient reached the lookup (frozen table)
        end_cpu, end_wall = time.thread_time(), time.perf_counter()
    model.zero_grad(set_to_none=True)
    table.zero_grad(set_to_none=True)
    return StepTime(cpu_s=end_cpu - probe.start_cpu, wall_s=end_wall - probe.start_wall)


def _time_cuda_step(model: SequentialRecommender, table: LocalItemTable, batch: SequenceBatch, num_negatives: int,
                    full_softmax: bool, generator: torch.Generator, loss_kind: LossKind) -> StepTime:
    """The whole forward+backward between two CUDA events: GPU time, both fields.

    Host clocks would time kernel launches, not kernels. The item lookup is a local
    table here (sparse gradients) and costs microseconds next to the encoder, so the span includes it.
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    loss, _ = model(batch, num_negatives, full_softmax=full_softmax, generator=generator, loss_kind=loss_kind,
                    source=table.source())
    loss.backward()
    end.record()
    end.synchronize()
    model.zero_grad(set_to_none=True)
    table.zero_grad(set_to_none=True)
    seconds = start.elapsed_time(end) / 1000.0
    return StepTime(cpu_s=seconds, wall_s=seconds)


def time_round_robin(steps: Sequence[Callable[[], StepTime]], repeats: int, warmup: int,
                     progress: Callable[[int], None] | None = None) -> np.ndarray:
    """``[len(steps), repeats, 2]`` (cpu, wall) seconds; each round runs every step once, in order.

    Round-robin rather than step-by-step so that a slow period on a shared
    machine lands on all steps alike instead of on whichever was running.
    """
    for _ in range(warmup):
        for step in steps:
            step()
    out = np.zeros((len(steps), repeats, 2))
    for r in range(repeats):
        for i, step in enumerate(steps):
            t = step()
            out[i, r] = (t.cpu_s, t.wall_s)
        if progress is not None:
            progress(r + 1)
    return out


# ---------------------------------------------------------------------- batch design


@dataclass(frozen=True)
class CalibrationBatch:
    """Probe samples around ``probe_length`` on top of a random heavy-tailed background."""

    probe_length: int
    probes: tuple[int, ...]
    background: tuple[int, ...]

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.probes + self.background


def probe_lengths(length: int, count: int, max_spread: float = PROBE_SPREAD) -> tuple[int, ...]:
    """Up to ``count`` distinct lengths within ``+-max_spread * length`` of ``length``, mean exactly ``length``.

    Fewer than ``count`` when that many distinct lengths do not fit (short lengths).
    """
    reach = int(max_spread * length)
    count = max(1, min(count, 2 * reach + 1))
    half = count // 2
    offsets = range(-half, half + 1) if count % 2 else [*range(-half, 0), *range(1, half + 1)]
    return tuple(length + o for o in offsets)


def heavy_tailed_lengths(rng: np.random.Generator, size: int, min_length: int, max_length: int,
                         alpha: float = PARETO_ALPHA) -> tuple[int, ...]:
    """``size`` Pareto(alpha) lengths from ``min_length``, capped at ``max_length``."""
    lengths = min_length * (1.0 - rng.random(size)) ** (-1.0 / alpha)
    return tuple(int(x) for x in np.clip(np.floor(lengths), min_length, max_length))


def heavy_tailed_batches(num_batches: int, min_length: int, max_length: int, seed: int) -> list[tuple[int, ...]]:
    """Random mixes of heavy-tailed lengths, ``MIX_SAMPLES`` samples each: the held-out steps."""
    rng = np.random.default_rng(seed)
    low, high = MIX_SAMPLES
    return [heavy_tailed_lengths(rng, int(rng.integers(low, high + 1)), min_length, max_length)
            for _ in range(num_batches)]


def calibration_batches(lengths: Sequence[int], min_length: int, max_length: int, replicates: int,
                        seed: int, probe_tokens: int = PROBE_TOKENS) -> list[CalibrationBatch]:
    """``replicates`` batches per length, each with its own background (see the module docstring);
    with two or more, the first of each length is its probes alone."""
    rng = np.random.default_rng(seed)
    low, high = MIX_SAMPLES
    batches = []
    for length in lengths:
        probes = probe_lengths(length, max(1, round(probe_tokens / length)))
        for r in range(replicates):
            count = 0 if r == 0 and replicates > 1 else int(rng.integers(low, high + 1))
            background = heavy_tailed_lengths(rng, count, min_length, max_length)
            batches.append(CalibrationBatch(length, probes, background))
    return batches


# --------------------------------------------------------------------- orchestration


def machine_info(device: str = "cpu") -> dict:
    """Where the numbers were measured (goes into every calibration's provenance)."""
    gpu = {"gpu": torch.cuda.get_device_name(torch.device(device)), "cuda": torch.version.cuda} \
        if torch.device(device).type == "cuda" else {}
    return {**gpu,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": 1,
    }


@dataclass
class CalibrationSettings:
    lengths: tuple[int, ...]
    """Grid lengths: the table's knots (held-out midpoints are added automatically)."""
    num_items: int = 2000
    """Synthetic catalog size (bounds how many distinct in-batch negatives a batch has)."""
    repeats: int = 7
    warmup: int = 2
    replicates: int = 2
    """Calibration batches per length, each with its own random background."""
    held_out_batches: int = 24
    """Mixed heavy-tailed batches for the validation; 0 skips it."""
    num_negatives: int = 128
    full_softmax: bool = False
    loss_kind: LossKind = "sampled_softmax"
    """``loss.kind``: the loss the timed steps train with (bce draws one negative per position)."""
    seed: int = 0
    device: str = "cpu"
    """Where the model runs: ``cpu`` (thread CPU clock, one thread) or ``cuda`` (CUDA events)."""
    precision: Precision = "fp32"
    """``training.precision``: the encoder's arithmetic in the timed steps, as the trainer will run it."""
    cuda_graphs: CudaGraphs = "off"
    """``training.cuda_graphs``: the encoder's steps replayed as CUDA graphs, as the trainer will run them
    (the warm-up rounds capture each batch's bucket, so no timed step includes a capture)."""


@dataclass
class ClockFit:
    """Everything fitted on one clock."""

    seconds: np.ndarray
    """Median time of each calibration batch."""
    choice: FormChoice
    """Both forms fitted on the grid batches, scored on the held-out-length batches."""
    final: dict[str, FormScore]
    """Both forms refitted on all calibration batches (table knots: grid + held-out lengths)."""


@dataclass
class Validation:
    batches: list[tuple[int, ...]]
    measured: dict[str, np.ndarray]
    """clock -> [batches] median seconds."""
    predicted: dict[str, np.ndarray]
    """predictor -> [batches] predicted seconds (relative units for the baselines)."""
    quality: dict[str, PredictionQuality]
    """predictor -> quality against the CPU clock."""


@dataclass
class CalibrationResult:
    settings: CalibrationSettings
    machine: dict
    grid: tuple[int, ...]
    held_out: tuple[int, ...]
    batches: list[CalibrationBatch]
    fits: dict[str, ClockFit]
    validation: Validation | None
    seconds: float
    created: str = field(default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat())
    model: CostModel | None = None
    """The chosen form on the CPU clock, refitted on all batches, with provenance."""
    attention_kernel: str = ""
    """The encoder's attention kernel on the timed device (``encoder.kernel``: HSTU's by its config,
    SASRec's always grouped)."""

    @property
    def chosen(self) -> FittedForm:
        fit = self.fits[FIT_CLOCK]
        return fit.final[fit.choice.chosen].form


def run_calibration(model_config: ModelConfig, settings: CalibrationSettings, config_record: dict | None = None,
                    log: Callable[[str], None] = print) -> CalibrationResult:
    """Profile the model on this machine, fit both forms, choose one, validate on mixed batches.

    ``config_record`` (the model and loss config as a dict) goes into the provenance.
    """
    started = time.perf_counter()
    grid = tuple(sorted(set(settings.lengths)))
    check_lengths(grid)
    held_out = tuple(held_out_lengths(grid))
    lo, hi = grid[0], grid[-1]
    batches = calibration_batches(sorted(grid + held_out), lo, hi, settings.replicates, settings.seed)
    mixes = heavy_tailed_batches(settings.held_out_batches, lo, hi, settings.seed + 1)

    torch.manual_seed(settings.seed)
    model, table = build_dense_model(settings.num_items, model_config, device=settings.device,
                                     precision=settings.precision, cuda_graphs=settings.cuda_graphs)
    model.train()  # dropout on, as in training

    def step(lengths: Sequence[int], index: int) -> Callable[[], StepTime]:
        batch = synthetic_batch(lengths, settings.num_items, seed=settings.seed * 100_003 + index)
        batch = batch.to(settings.device)
        return lambda: time_dense_step(model, table, batch, settings.num_negatives, settings.full_softmax, seed=index,
                                       loss_kind=settings.loss_kind)

    all_batches = [b.lengths for b in batches] + list(mixes)
    log(f"timing {len(batches)} calibration batches ({len(grid)} grid + {len(held_out)} held-out lengths x "
        f"{settings.replicates}) and {len(mixes)} held-out mixed batches: {settings.warmup} warm-up + "
        f"{settings.repeats} rounds, {_clock_words(settings.device)}, attention kernel "
        f"{model.attention_kernel}, precision {settings.precision}, CUDA graphs {settings.cuda_graphs}")
    with single_thread(), caching_malloc():
        samples = time_round_robin([step(b, i) for i, b in enumerate(all_batches)], settings.repeats,
                                   settings.warmup, progress=lambda r: log(f"  round {r}/{settings.repeats}"))
    if model.graphed_encoder is not None:
        log(f"CUDA graphs: {model.graphed_encoder.stats.summary()}")
    medians = {clock: np.median(samples[:, :, c], axis=1) for c, clock in enumerate(CLOCKS)}

    on_grid = [b.probe_length in grid for b in batches]
    fits = {}
    for clock in CLOCKS:
        t = medians[clock][: len(batches)]
        grid_batches = [b.lengths for b, g in zip(batches, on_grid) if g]
        held_batches = [b.lengths for b, g in zip(batches, on_grid) if not g]
        choice = compare_forms(grid_batches, t[on_grid], grid, held_batches, t[~np.asarray(on_grid)])
        knots = sorted(grid + held_out)
        final = {kind: score_form(kind, [b.lengths for b in batches], t, knots) for kind in KINDS}
        fits[clock] = ClockFit(t, choice, final)

    validation = None
    if mixes:
        measured = {clock: medians[clock][len(batches):] for clock in CLOCKS}
        validation = validate(mixes, measured, fits[FIT_CLOCK].final)
    result = CalibrationResult(settings, machine_info(settings.device), grid, held_out, batches, fits, validation,
                               seconds=time.perf_counter() - started, attention_kernel=model.attention_kernel)
    result.model = dataclasses.replace(result.chosen.model, provenance=build_provenance(result, config_record or {}))
    return result


def _clock_words(device: str) -> str:
    return "CUDA events" if torch.device(device).type == "cuda" else "1 thread, thread CPU clock"


def validate(mixes: Sequence[Sequence[int]], measured: dict[str, np.ndarray],
             forms: dict[str, FormScore]) -> Validation:
    """Predict each mixed batch (step constant + its samples' costs) with each form and two baselines."""
    predicted = {kind: score.form.batch_times(mixes) for kind, score in forms.items()}
    # Baselines: what balancing by token count, or by the uncalibrated analytic model, would assume.
    predicted["tokens"] = np.array([float(sum(m)) for m in mixes])
    analytic = default_cost_model()
    predicted["analytic default"] = np.array([float(analytic.predict(np.asarray(m)).sum()) for m in mixes])
    quality = {name: prediction_quality(p, measured[FIT_CLOCK]) for name, p in predicted.items()}
    return Validation([tuple(m) for m in mixes], measured, predicted, quality)


def per_length_errors(batches: Sequence[CalibrationBatch], errors: Sequence[float]) -> dict[int, float]:
    """Mean relative error of the batches probing each length."""
    by_length: dict[int, list[float]] = {}
    for batch, error in zip(batches, errors):
        by_length.setdefault(batch.probe_length, []).append(error)
    return {length: float(np.mean(v)) for length, v in sorted(by_length.items())}


def build_provenance(result: CalibrationResult, config_record: dict) -> dict:
    """Everything needed to judge (and reproduce) the written model, JSON-ready."""
    s = result.settings
    held_batches = [b for b in result.batches if b.probe_length not in result.grid]
    provenance = {
        "source": "freescale calibrate",
        "created": result.created,
        **result.machine,
        "config": config_record,
        "settings": _settings_record(result),
        "timed": "dense forward+backward (lookup returned -> gradient at the lookup), like the trainer's "
                 "dense_compute_s; per_id = 0 because the lookup is an all-to-all in the sharded trainer",
        "method": ("t(batch) = d + sum cost(L_i), non-negative least squares on relative error, over batches of "
                   f"probe samples at each length, alone and on random Pareto({PARETO_ALPHA}) backgrounds of "
                   f"{MIX_SAMPLES[0]}-{MIX_SAMPLES[1]} samples"),
        "clock": (f"{FIT_CLOCK}: thread CPU time, 1 intra-op thread (the wall-clock fit is under fits.wall)"
                  if torch.device(s.device).type == "cpu" else "CUDA events around forward+backward (both fits)"),
        "device": s.device,
        "attention_kernel": result.attention_kernel,
        "precision": s.precision,
        "cuda_graphs": s.cuda_graphs,
        "cv": "both forms fitted on the grid-length batches, scored on the held-out-length batches",
        "chosen": result.fits[FIT_CLOCK].choice.chosen,
        "reason": result.fits[FIT_CLOCK].choice.reason,
        STEP_CONSTANT_KEY: result.chosen.step_constant,  # what CostModel.step_constant_s reads
        "fits": {clock: _clock_record(result, clock, held_batches) for clock in CLOCKS},
        "calibration_seconds": result.seconds,
    }
    if result.validation is not None:
        provenance["validation"] = _validation_record(result.validation, result.grid)
    return provenance


def _settings_record(result: CalibrationResult) -> dict:
    """The provenance's ``settings``: the lengths probed and how each was timed."""
    s = result.settings
    grid_batches = [b for b in result.batches if b.probe_length in result.grid]
    return {"grid_lengths": list(result.grid), "held_out_lengths": list(result.held_out),
            "num_items": s.num_items, "repeats": s.repeats, "warmup": s.warmup,
            "replicates": s.replicates, "held_out_batches": s.held_out_batches, "seed": s.seed,
            "calibration_batches": len(result.batches), "grid_batches": len(grid_batches)}


def _clock_record(result: CalibrationResult, clock: str, held_batches: list[CalibrationBatch]) -> dict:
    """One clock's fits in the provenance: the choice, then each form's coefficients, fit and
    cross-validation errors (``held_batches``: the batches probing held-out lengths)."""
    fit = result.fits[clock]
    record: dict = {"chosen": fit.choice.chosen, "reason": fit.choice.reason}
    for kind in KINDS:
        final, cv = fit.final[kind], fit.choice.scores[kind]
        record[kind] = {
            **{k: v for k, v in final.form.model.to_json().items() if k in ("a", "b", "c", "lengths", "costs")},
            "step_constant_s": final.form.step_constant,
            "r2": final.r2,
            "relative_error_by_length": {str(k): v for k, v in
                                         per_length_errors(result.batches, final.fit_errors).items()},
            "cv_rms_relative_error": cv.cv_rms,
            "cv_relative_error_by_length": {str(k): v for k, v in
                                            per_length_errors(held_batches, cv.cv_errors).items()},
        }
    return record


def _validation_record(v: Validation, grid: tuple[int, ...]) -> dict:
    """The provenance's ``validation``: how well each form (and baseline) predicted the mixed batches."""
    return {
        "batches": len(v.batches),
        "samples_per_batch": f"{MIX_SAMPLES[0]}-{MIX_SAMPLES[1]}",
        "length_distribution": f"Pareto(alpha={PARETO_ALPHA}) in [{grid[0]}, {grid[-1]}]",
        "clock": FIT_CLOCK,
        **{name: {"correlation": q.correlation, "median_abs_ratio_error": q.median_abs_error,
                  "p90_abs_ratio_error": q.p90_abs_error} for name, q in v.quality.items()},
    }
