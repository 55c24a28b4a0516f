"""Virtual ranks at realistic work on one device: contiguous, flops_kk and kk plans and a mirror
control, every rank's batch timed.

    python -m freescale.jobs.cli calibrate --device cpu --config benchmarks/configs/cpu_virtual_ranks.toml \
        --output out/vr/cost_model.json --tracking-uri none
    python -m benchmarks.virtual_ranks --device cpu --cost-model out/vr/cost_model.json --ranks 64 \
        --output out/vr/k64.md --json out/vr/k64.json

(``--device cuda`` with benchmarks/configs/gpu_virtual_ranks.toml is what benchmarks/gpu_check.sh
runs.) Both from the repository root (the project need not be installed there).

For K ranks x B samples and a window of steps, sample lengths are drawn (log-normal with a heavy
tail, capped; and MovieLens-100K's history lengths) and planned three ways: ``contiguous`` (what
data parallelism does), ``flops_kk`` (the online FLOP balancer of NVIDIA recsys-examples:
Karmarkar-Karp on L^2 + 2.5 d L per global batch, equal counts) and ``kk`` (FreeScale: the
calibrated cost model, the whole window, equal counts: B samples a rank, so whatever the cost
model misses per batch and per sample weighs alike on every rank; with free counts, on one CPU
core at K = 64, kk's log-normal bubble was 7 points above the control's and 8 above flops_kk's,
docs/results/virtual_ranks_cpu.md). A fourth plan, ``control`` (the mirror control), gives
every rank of a step the same batch (kk's batch of median predicted cost in that step): any
difference between its ranks is the device's noise, so its bubble is the floor no plan can be
expected to go below at this K, measured in the same run.

Each (step, rank) batch is timed, the model's dense forward+backward as ``freescale calibrate``
times it (freescale/training/calibration/calibrate.py: the model of ``--config``, at its
training.precision, a plain item table; on CPU one pinned intra-op thread and the thread CPU clock,
on CUDA events). Timing is round-robin: every repeat runs the cells in (step, rank) order and, for
each cell, every plan's batch, so drift in the machine's load hits all plans alike. Each batch's
time is its median over ``--repeats``; a step takes its slowest rank.

Beside each measurement: what ``freescale simulate`` predicts (freescale.balancing.simulate.simulate)
from the plan's loads in the same cost model, its per-step constant in every rank's compute, and the
per-rank noise the control measured (``--noise-from`` a mirror control, as `freescale simulate`
takes it; so the control's own prediction is a fit, the others' are not).

It needs only torch, triton and numpy (it refuses to report if torchrec, fbgemm, pyspark, mlflow,
ortools, pandas, pyarrow or torchdata got loaded). ``--smoke`` runs toy sizes on CPU: it checks the
script, not a measurement, and says so in its tables (tests/benchmarks/test_virtual_ranks.py runs it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO, Markdown, commit, loaded_gpu_machine_lacks  # standard library only

LENGTHS_FILE = REPO / "benchmarks" / "data" / "movielens100k_history_lengths.json"
CONFIGS = {"cpu": REPO / "benchmarks" / "configs" / "cpu_virtual_ranks.toml",
           "cuda": REPO / "benchmarks" / "configs" / "gpu_virtual_ranks.toml"}
PLANS = ("contiguous", "flops_kk", "kk", "control")
LENGTH_SETS = ("lognormal", "movielens")
BALANCED = ("contiguous", "flops_kk", "kk")
"""The plans of the samples as drawn; the control is built from kk's."""
REMOVED_TARGET, CONTROL_GAP, STEP_ERROR = 0.80, 0.03, 0.15
"""Issue 48's targets: kk removes 80% of the removable bubble (contiguous minus control), kk's bubble
within 3 points of the control's, simulate within 15% of every measured step time."""


@dataclass(frozen=True)
class Sizes:
    ranks: tuple[int, ...]
    batch_size: int
    steps: dict[int, int]
    lognormal_mean: float
    """Mean of the log-normal lengths before the cap: exp(mu + sigma^2 / 2)."""
    sigma: float
    max_length: int
    """Both length sets are capped here (MovieLens-100K's longest history is 735)."""
    repeats: int
    warmup: int
    overrides: tuple[str, ...] = ()
    """Config overrides (the smoke run's toy model)."""

    @property
    def mu(self) -> float:
        return math.log(self.lognormal_mean) - self.sigma * self.sigma / 2


GPU = Sizes(ranks=(64, 256), batch_size=32, steps={64: 2, 256: 1}, lognormal_mean=500.0, sigma=1.0,
            max_length=4096, repeats=2, warmup=1)
# One pinned core of a shared 2-core machine: K = 256 x 4 plans x 2 length sets x 3 repeats is ~6,000
# timed batches of ~20 ms of thread CPU time. Lengths are capped at the model's window (max_seq_len
# 256), as the trainer truncates histories, so that no single history outweighs a rank's mean batch.
CPU = Sizes(ranks=(64, 256), batch_size=8, steps={64: 2, 256: 1}, lognormal_mean=48.0, sigma=1.2,
            max_length=256, repeats=3, warmup=0)
SMOKE = Sizes(ranks=(2, 4), batch_size=2, steps={2: 2, 4: 2}, lognormal_mean=12.0, sigma=1.0, max_length=24,
              repeats=1, warmup=0,
              overrides=("--model.hstu.embedding_dim", "16", "--model.hstu.num_layers", "1",
                         "--model.hstu.num_heads", "1", "--model.hstu.attention_dim", "8",
                         "--model.hstu.linear_dim", "8", "--model.hstu.max_seq_len", "24",
                         "--model.hstu.num_position_buckets", "8", "--model.hstu.num_time_buckets", "8",
                         "--training.precision", "fp32", "--training.cuda_graphs", "off",
                         "--loss.num_negatives", "8"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                   help="where the batches are timed (default %(default)s, what benchmarks/gpu_check.sh runs)")
    p.add_argument("--cost-model", help="`freescale calibrate --device DEVICE`'s output, for the same --config "
                                        "(default: the analytic model, which is not this device's)")
    p.add_argument("--config", help="model, loss and precision (default: benchmarks/configs/DEVICE_virtual_ranks.toml)")
    p.add_argument("--output", help="also write the tables to this markdown file")
    p.add_argument("--json", help="write one row per (lengths, ranks, plan) to this JSON file")
    p.add_argument("--ranks", help="comma-separated K to run (default: 64,256)")
    p.add_argument("--lengths", choices=LENGTH_SETS, action="append",
                   help="length set to run, repeatable (default: both; one set per process lets two "
                        "processes on two pinned cores share a run)")
    p.add_argument("--core", type=int, help="on CPU, the core to pin to (default: the last one this process may use)")
    p.add_argument("--repeats", type=int, help="timed passes (default 2 on CUDA, 3 on CPU)")
    p.add_argument("--steps", type=int, help="steps per K, planned as one window (default: 2 at K = 64, 1 at "
                                             "K = 256): more steps, fewer single-draw maxima in each plan's bubble")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-items", type=int, default=2000, help="synthetic catalog, as calibrate's default")
    p.add_argument("--smoke", action="store_true", help="toy sizes on CPU: checks the script, measures nothing")
    # Anything else is a config override, as `freescale calibrate` takes them (--training.cuda_graphs off).
    args, args.overrides = p.parse_known_args(argv)
    bad = [word for word in args.overrides[::2] if not word.startswith("--") or "." not in word]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides are --section.key value)")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.smoke:
        args.device = "cpu"
    try:
        args.ranks = tuple(int(k) for k in args.ranks.split(",")) if args.ranks else None
    except ValueError:
        p.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if args.ranks and min(args.ranks) < 2:
        p.error("--ranks: the control needs at least 2 ranks")
    args.config = args.config or str(CONFIGS[args.device])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for path in (args.output, args.json):  # written as cases finish: a run cut short keeps them
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text("" if path == args.output else "[]\n")
    Bench(args).run()
    loaded = loaded_gpu_machine_lacks()
    if loaded:
        print(f"virtual_ranks: error: loaded {', '.join(loaded)}; the GPU machine has none of them",
              file=sys.stderr)
        return 1
    return 0


COLUMNS = ["lengths", "K", "steps", "mean L", "contiguous bubble", "flops_kk bubble", "kk bubble", "control bubble",
           "removable removed by kk", "contiguous step ms", "flops_kk step ms", "kk step ms", "control step ms",
           "kk speedup"]


def removed(case: dict) -> float:
    """Share of the removable bubble (contiguous's minus the control's noise floor) kk removed."""
    removable = case["contiguous"]["bubble"] - case["control"]["bubble"]
    return (case["contiguous"]["bubble"] - case["kk"]["bubble"]) / removable if removable > 0 else math.nan


def row_cells(r: dict) -> list[str]:
    """One measured case as a row of ``COLUMNS``: measured, simulate's prediction in brackets."""
    cells = [r["lengths"], str(r["K"]), str(r["steps"]), f"{r['mean_length']:.0f}"]
    cells += [f"{r[label]['bubble']:.1%} ({r[label]['predicted_bubble']:.1%})" for label in PLANS]
    cells.append(f"{removed(r):.0%}" if math.isfinite(removed(r)) else "- (none removable)")
    cells += [f"{r[label]['step_s'] * 1e3:.2f} ({r[label]['predicted_step_s'] * 1e3:.2f})" for label in PLANS]
    cells.append(f"{r['contiguous']['total_s'] / r['kk']['total_s']:.2f}x")
    return cells


def json_rows(r: dict) -> list[dict]:
    return [{"lengths": r["lengths"], "ranks": r["K"], "steps": r["steps"], "batch_size": r["B"], "plan": label,
             "bubble_measured": r[label]["bubble"], "bubble_predicted": r[label]["predicted_bubble"],
             "step_s_measured": r[label]["step_s"], "step_s_predicted": r[label]["predicted_step_s"],
             "rank_s_measured": r[label]["rank_s"]}
            for label in PLANS]


class Bench(Markdown):
    def __init__(self, args: argparse.Namespace) -> None:
        import numpy as np
        import torch

        from freescale.costs.cost_model import CostModel, default_cost_model
        from freescale.training.config import load_config

        self.np, self.torch, self.args = np, torch, args
        Markdown.__init__(self, args.output)
        self.smoke, self.device = args.smoke, args.device
        if self.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("virtual_ranks: no CUDA device (--device cpu times the CPU; --smoke rehearses the script)")
        self.sizes = SMOKE if self.smoke else CPU if self.device == "cpu" else GPU
        self.ranks = args.ranks or self.sizes.ranks
        self.repeats = args.repeats or self.sizes.repeats
        self.config = load_config(args.config, list(self.sizes.overrides) + args.overrides)
        self.cost_model = CostModel.load(args.cost_model) if args.cost_model else default_cost_model()
        self.step_constant = self.cost_model.step_constant_s
        self.in_seconds = self.cost_model.unit == "seconds"  # else simulate has nothing to predict times with
        self.started = time.perf_counter()
        self.rows: list[dict] = []
        self.core = self.pin()
        self._model = None

    def pin(self) -> int | None:
        """On CPU: one intra-op thread on one core, so a batch's time does not depend on where the
        scheduler put it (the thread CPU clock then sees its whole forward+backward)."""
        if self.device != "cpu":
            return None
        self.torch.set_num_threads(1)
        if not hasattr(os, "sched_setaffinity"):
            return None
        core = max(os.sched_getaffinity(0)) if self.args.core is None else self.args.core
        os.sched_setaffinity(0, {core})
        return core

    def run(self) -> None:
        self.header()
        for k in self.ranks:
            for name, sampler in self.samplers(k).items():
                self.rows.append(self.measure(name, sampler, k))
        self.report(self.rows)

    def header(self) -> None:
        import triton

        torch = self.torch
        where = torch.cuda.get_device_name(0) if self.device == "cuda" else \
            f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, pinned to core {self.core}, " \
            "1 thread, thread CPU clock"
        hstu, training = self.config.model.hstu, self.config.training
        self.emit("# Virtual ranks at realistic work: contiguous, flops_kk, kk and the mirror control, "
                  "each rank's batch timed")
        self.emit()
        if self.smoke:
            self.emit("**SMOKE RUN on CPU: toy sizes, nothing here is a measurement.**")
            self.emit()
        self.emit(f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}")
        self.emit(f"- commit: {commit()}")
        self.emit(f"- machine: {platform.node()}, {where}; load average at start "
                  f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        self.emit(f"- versions: torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}")
        self.emit(f"- command: python -m benchmarks.virtual_ranks {' '.join(sys.argv[1:])}".rstrip())
        self.emit(f"- model: {self.config.model.encoder}, D={self.config.model.embedding_dim}, "
                  f"{hstu.num_layers} layers, "
                  f"{hstu.num_heads} heads of {hstu.attention_dim}, {training.precision}, CUDA graphs "
                  f"{training.cuda_graphs}; dense forward+backward "
                  f"with {self.config.loss.kind} ({self.config.loss.num_negatives} negatives), as calibrate times it")
        model = self.cost_model
        shape = f"a={model.a:.3e}, b={model.b:.3e}, c={model.c:.3e}" if model.kind == "quadratic" else \
            f"{len(model.lengths)} knots, {model.costs[0] * 1e3:.3f} ms at L={model.lengths[0]:.0f} to " \
            f"{model.costs[-1] * 1e3:.3f} ms at L={model.lengths[-1]:.0f}"
        self.emit(f"- cost model: {model.provenance.get('source', 'analytic')} ({model.kind}; {shape}; "
                  f"per-step constant {self.step_constant:.3e} s)"
                  + ("" if self.args.cost_model else " -- NOT calibrated on this device"))
        self.emit(f"- B = {self.sizes.batch_size} per rank; every batch's median of {self.repeats} round-robin "
                  "passes; simulate's noise from the control")
        self.emit()

    def samplers(self, k: int) -> dict:
        """Each length set's sampler, its own seeded stream per K: a set run alone draws what it draws beside the other."""
        np, s = self.np, self.sizes
        lognormal_rng, movielens_rng = (np.random.default_rng([self.args.seed, k, i]) for i in range(2))
        document = json.loads(LENGTHS_FILE.read_text())
        population = np.repeat(np.asarray(document["lengths"]), np.asarray(document["counts"]))
        sets = {
            "lognormal": (f"log-normal(mu={s.mu:.3f}, sigma={s.sigma}) capped at {s.max_length}",
                          lambda n: np.clip(np.round(lognormal_rng.lognormal(s.mu, s.sigma, n)), 1,
                                            s.max_length).astype(np.int64)),
            "movielens": (f"MovieLens-100K ({document['users']} users) capped at {s.max_length}",
                          lambda n: np.clip(movielens_rng.choice(population, n), 1, s.max_length).astype(np.int64)),
        }
        return dict(sets[name] for name in (self.args.lengths or LENGTH_SETS))

    def plans(self, lengths, k: int, steps: int) -> dict:
        """Each plan's batches, ``[steps * K]`` arrays of lengths in (step, rank) order, and its loads."""
        from freescale.balancing import plan

        np, b = self.np, self.sizes.batch_size
        costs = self.cost_model.predict(lengths)
        width = self.config.model.embedding_dim
        plans = {"contiguous": plan(costs, k, b, strategy="contiguous"),
                 "flops_kk": plan(costs, k, b, strategy="flops_kk", lengths=lengths, flop_width=width),
                 "kk": plan(costs, k, b, strategy="kk", lengths=lengths, window_steps=steps, equal_counts=True)}
        out = {label: ([lengths[(p.step == s) & (p.rank == r)] for s in range(p.num_steps) for r in range(k)],
                       p.loads) for label, p in plans.items()}
        # The mirror control: every rank of step s computes kk's batch of median predicted cost there.
        kk_batches, kk_loads = out["kk"]
        typical = [int(np.argsort(kk_loads[s])[k // 2]) for s in range(steps)]
        out["control"] = ([kk_batches[s * k + typical[s]] for s in range(steps) for _ in range(k)],
                          np.repeat(kk_loads[np.arange(steps), typical][:, None], k, axis=1))
        return out

    def measure(self, name: str, sampler, k: int) -> dict:
        """Plan K x B x steps lengths; time every (step, rank) batch of every plan; measured and predicted."""
        from freescale.balancing import bubble

        b, steps = self.sizes.batch_size, self.args.steps or self.sizes.steps.get(k, 1)
        lengths = sampler(k * b * steps)
        plans = self.plans(lengths, k, steps)
        cells = steps * k
        # Interleaved: cell i of every plan, then cell i + 1, so drift hits all plans alike.
        seconds = self.time_batches([plans[label][0][i] for i in range(cells) for label in PLANS])
        measured = {label: seconds[j::len(PLANS)].reshape(steps, k) for j, label in enumerate(PLANS)}
        out = {"lengths": name, "K": k, "B": b, "steps": steps, "mean_length": float(lengths.mean())}
        noise = self.noise(measured["control"])
        for label in PLANS:
            times = measured[label]
            out[label] = {"bubble": bubble(times), "step_s": float(times.max(axis=1).mean()), "rank_s": times.tolist(),
                          "total_s": float(times.max(axis=1).sum()), **self.predict(plans[label][1], noise)}
        # Printed as soon as measured: a run cut short by its time budget still leaves every finished case.
        self.emit(f"- {name}, K={k}: done ({time.perf_counter() - self.started:.0f} s, load average "
                  f"{os.getloadavg()[0]:.1f})")
        self.emit()
        self.table(COLUMNS, [row_cells(out)])
        self.write_json(out)
        return out

    def noise(self, control):
        """The per-rank noise of the control's ranks (all computed the same batch), as
        `freescale simulate --noise-from` reads a mirror-control run."""
        from freescale.balancing.simulate import Noise, rank_noise

        return Noise.measured(rank_noise(control))

    def predict(self, loads, noise) -> dict:
        """simulate's bubble and mean step time for ``loads``; nan without a cost model in seconds."""
        from freescale.balancing.simulate import TimeModel, simulate

        if not self.in_seconds:
            return {"predicted_bubble": math.nan, "predicted_step_s": math.nan}
        # The cost model's seconds, its per-step constant in every rank's compute: simulate's definition.
        model = TimeModel(noise=noise, step_constant_s=self.step_constant)
        predicted = simulate(loads, model, self.sizes.batch_size, seed=self.args.seed)
        return {"predicted_bubble": predicted.bubble_fraction,
                "predicted_step_s": predicted.mean_step_time_s}  # as measured: a mean over steps

    def write_json(self, case: dict) -> None:
        if self.args.json:
            rows = [row for r in self.rows + [case] for row in json_rows(r)]
            Path(self.args.json).write_text(json.dumps(rows, indent=1) + "\n")

    def time_batches(self, batches: list) -> "object":
        """Median seconds of each batch's dense forward+backward over the repeats, timed round-robin
        (thread CPU clock on CPU, CUDA events on CUDA). A batch listed twice is prepared once."""
        np = self.np
        from freescale.training.calibration.calibrate import caching_malloc, synthetic_batch, time_dense_step
        from freescale.training.calibration.calibrate import time_round_robin

        model, table = self.model()
        loss = self.config.loss
        prepared: dict[int, object] = {}
        for lengths in batches:
            if id(lengths) not in prepared:
                prepared[id(lengths)] = synthetic_batch(lengths.tolist(), self.args.num_items,
                                                        seed=self.args.seed + len(prepared)).to(self.device)
        timed = [prepared[id(lengths)] for lengths in batches]
        steps = [lambda batch=batch: time_dense_step(model, table, batch, loss.num_negatives, loss.full_softmax,
                                                     seed=self.args.seed, loss_kind=loss.kind)
                 for batch in timed]
        with caching_malloc():
            measured = time_round_robin(steps, self.repeats, self.sizes.warmup)
        if model.graphed_encoder is not None:
            self.emit(f"- CUDA graphs so far: {model.graphed_encoder.stats.summary()}")
        return np.median(measured[:, :, 0], axis=1)  # the CPU clock; on CUDA both fields are the events

    def model(self):
        """The timed model and its plain item table, built once: no step changes the weights, and
        every case after the first replays the CUDA graphs already captured for its shapes."""
        if self._model is None:
            from freescale.training.model.recommender import build_dense_model

            self.torch.manual_seed(self.args.seed)
            model, table = build_dense_model(self.args.num_items, self.config.model, device=self.device,
                                             precision=self.config.training.precision,
                                             cuda_graphs=self.config.training.cuda_graphs)
            model.train()
            self._model = model, table
        return self._model

    def report(self, rows: list[dict]) -> None:
        self.emit()
        self.emit(f"## Measured (simulate's prediction in brackets; nan without a cost model in seconds) "
                  f"({time.perf_counter() - self.started:.0f} s)")
        self.emit()
        self.table(COLUMNS, [row_cells(r) for r in rows])
        self.targets(rows)

    def targets(self, rows: list[dict]) -> None:
        checks = []
        for r in rows:
            case = f"K={r['K']}, {r['lengths'].split(' ')[0]}"
            kk, flops, control = r["kk"]["bubble"], r["flops_kk"]["bubble"], r["control"]["bubble"]
            checks += [
                (f"{case}: kk removes of the removable bubble", f">= {REMOVED_TARGET:.0%}",
                 f"{removed(r):.0%}" if math.isfinite(removed(r)) else "none removable", removed(r) >= REMOVED_TARGET),
                (f"{case}: kk bubble vs the control's", f"within {CONTROL_GAP * 100:.0f} points",
                 f"{kk:.1%} vs {control:.1%}", kk - control <= CONTROL_GAP),
                (f"{case}: kk bubble vs flops_kk's", "no worse", f"{kk:.1%} vs {flops:.1%}", kk <= flops),
            ]
            for label in PLANS:
                m = r[label]
                error = m["predicted_step_s"] / m["step_s"] - 1.0
                checks.append((f"{case}, {label}: simulate's step time vs measured",
                               f"within {STEP_ERROR:.0%}" + (" (noise fitted here)" if label == "control" else ""),
                               f"{error:+.1%}", abs(error) <= STEP_ERROR))
        self.emit("## Targets (issue 48)")
        self.emit()
        self.table(["what", "target", "measured", "met"],
                   [[what, target, value, "n/a (smoke)" if self.smoke else ("yes" if ok else "**no**")]
                    for what, target, value, ok in checks])


if __name__ == "__main__":
    sys.exit(main())
