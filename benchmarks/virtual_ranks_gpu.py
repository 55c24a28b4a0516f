"""Virtual ranks at realistic work on one GPU: contiguous, flops_kk and kk plans, every rank's batch timed.

    python -m freescale.jobs.cli calibrate --device cuda --config benchmarks/configs/gpu_virtual_ranks.toml \
        --output $OUT/cost_model.json --tracking-uri none
    python -m benchmarks.virtual_ranks_gpu --cost-model $OUT/cost_model.json --output $OUT/virtual_ranks.md

Both from the repository root (the project need not be installed there).

For K ranks x B samples and a window of steps, sample lengths are drawn (log-normal with a mean of
about 500, capped at 4,096; and MovieLens-100K's history lengths) and planned three ways:
``contiguous`` (what data parallelism does), ``flops_kk`` (the online FLOP balancer of NVIDIA
recsys-examples: Karmarkar-Karp on L^2 + 2.5 d L per global batch, equal counts) and ``kk``
(FreeScale: the calibrated cost model, the whole window). Each (step, rank) batch is then timed on
this GPU in turn, the model's dense forward+backward as ``freescale calibrate`` times it
(freescale/training/calibration/calibrate.py: the model of ``--config``, at its training.precision, a plain item table);
a step takes its slowest rank. Medians of ``--repeats`` round-robin passes.

Beside each measurement: what ``freescale simulate`` predicts from the plan's loads and the same
cost model (freescale.balancing.simulate.simulate; the cost model's per-step constant in every rank's
compute, as simulate counts it; no noise: the measurement takes medians).

It needs only torch, triton and numpy (it refuses to report if torchrec, fbgemm, pyspark, mlflow,
ortools, pandas, pyarrow or torchdata got loaded). ``--smoke`` runs toy sizes on CPU: it checks the
script, not the GPU, and says so in its tables (tests/benchmarks/test_virtual_ranks_gpu.py runs it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO, Markdown, commit, loaded_gpu_machine_lacks  # standard library only

LENGTHS_FILE = REPO / "benchmarks" / "data" / "movielens100k_history_lengths.json"
DEFAULT_CONFIG = REPO / "benchmarks" / "configs" / "gpu_virtual_ranks.toml"
PLANS = ("contiguous", "flops_kk", "kk")
# Log-normal lengths with a mean of about 500 before the cap: exp(mu + sigma^2 / 2) = 500.
SIGMA = 1.0
MU = math.log(500.0) - SIGMA * SIGMA / 2


@dataclass(frozen=True)
class Sizes:
    ranks: tuple[int, ...]
    batch_size: int
    steps: dict[int, int]
    max_length: int
    repeats: int
    warmup: int
    overrides: tuple[str, ...] = ()
    """Config overrides (the smoke run's toy model)."""


GPU = Sizes(ranks=(64, 256), batch_size=32, steps={64: 4, 256: 2}, max_length=4096, repeats=2, warmup=1)
SMOKE = Sizes(ranks=(2, 4), batch_size=2, steps={2: 2, 4: 2}, max_length=24, repeats=1, warmup=0,
              overrides=("--model.hstu.embedding_dim", "16", "--model.hstu.num_layers", "1",
                         "--model.hstu.num_heads", "1", "--model.hstu.attention_dim", "8",
                         "--model.hstu.linear_dim", "8", "--model.hstu.max_seq_len", "24",
                         "--model.hstu.num_position_buckets", "8", "--model.hstu.num_time_buckets", "8",
                         "--training.precision", "fp32", "--training.cuda_graphs", "off",
                         "--loss.num_negatives", "8"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cost-model", help="`freescale calibrate --device cuda`'s output, for the same --config "
                                        "(default: the analytic model, which is not this GPU's)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="model, loss and precision (default %(default)s)")
    p.add_argument("--output", help="also write the tables to this markdown file")
    p.add_argument("--repeats", type=int, help="timed passes (default 2 on the GPU: the check has 200 s)")
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
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.output:  # written line by line: a run cut short still leaves its finished tables
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text("")
    Bench(args).run()
    loaded = loaded_gpu_machine_lacks()
    if loaded:
        print(f"virtual_ranks_gpu: error: loaded {', '.join(loaded)}; the GPU machine has none of them",
              file=sys.stderr)
        return 1
    return 0


COLUMNS = ["lengths", "K", "steps", "mean L", "contiguous bubble", "flops_kk bubble", "kk bubble",
           "contiguous step ms", "flops_kk step ms", "kk step ms", "kk speedup", "flops_kk speedup"]


def row_cells(r: dict) -> list[str]:
    """One measured case as a row of ``COLUMNS``: measured, simulate's prediction in brackets."""
    cells = [r["lengths"], str(r["K"]), str(r["steps"]), f"{r['mean_length']:.0f}"]
    cells += [f"{r[label]['bubble']:.1%} ({r[label]['predicted_bubble']:.1%})" for label in PLANS]
    cells += [f"{r[label]['step_s'] * 1e3:.2f} ({r[label]['predicted_step_s'] * 1e3:.2f})" for label in PLANS]
    cells.append(f"{r['contiguous']['total_s'] / r['kk']['total_s']:.2f}x")
    cells.append(f"{r['contiguous']['total_s'] / r['flops_kk']['total_s']:.2f}x")
    return cells


class Bench(Markdown):
    def __init__(self, args: argparse.Namespace) -> None:
        import numpy as np
        import torch

        from freescale.costs.cost_model import CostModel, default_cost_model
        from freescale.training.config import load_config

        self.np, self.torch, self.args = np, torch, args
        Markdown.__init__(self, args.output)
        self.smoke = args.smoke
        if not self.smoke and not torch.cuda.is_available():
            raise SystemExit("virtual_ranks_gpu: no CUDA device (use --smoke to rehearse the script on CPU)")
        self.device = "cpu" if self.smoke else "cuda"
        self.sizes = SMOKE if self.smoke else GPU
        self.repeats = args.repeats or self.sizes.repeats
        self.config = load_config(args.config, list(self.sizes.overrides) + args.overrides)
        self.cost_model = CostModel.load(args.cost_model) if args.cost_model else default_cost_model()
        self.step_constant = self.cost_model.step_constant_s
        self.in_seconds = self.cost_model.unit == "seconds"  # else simulate has nothing to predict times with
        self.rng = np.random.default_rng(args.seed)
        self.started = time.perf_counter()
        self._model = None

    def run(self) -> None:
        self.header()
        rows = []
        for name, sampler in self.samplers().items():
            for k in self.sizes.ranks:
                rows.append(self.measure(name, sampler, k))
        self.report(rows)

    def header(self) -> None:
        import triton

        torch = self.torch
        gpu = torch.cuda.get_device_name(0) if self.device == "cuda" else "none (CPU)"
        hstu, training = self.config.model.hstu, self.config.training
        self.emit("# Virtual ranks at realistic work: contiguous, flops_kk and kk, each rank's batch timed")
        self.emit()
        if self.smoke:
            self.emit("**SMOKE RUN on CPU: toy sizes, nothing here is a GPU measurement.**")
            self.emit()
        self.emit(f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}")
        self.emit(f"- commit: {commit()}")
        self.emit(f"- machine: {platform.node()}, GPU: {gpu}")
        self.emit(f"- versions: torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}")
        self.emit(f"- command: python -m benchmarks.virtual_ranks_gpu {' '.join(sys.argv[1:])}".rstrip())
        self.emit(f"- model: {self.config.model.encoder}, D={self.config.model.embedding_dim}, "
                  f"{hstu.num_layers} layers, "
                  f"{hstu.num_heads} heads of {hstu.attention_dim}, {training.precision}, CUDA graphs "
                  f"{training.cuda_graphs}; dense forward+backward "
                  f"with {self.config.loss.kind} ({self.config.loss.num_negatives} negatives), as calibrate times it")
        model = self.cost_model
        self.emit(f"- cost model: {model.provenance.get('source', 'analytic')} ({model.kind}; a={model.a:.3e}, "
                  f"b={model.b:.3e}, c={model.c:.3e}; per-step constant {self.step_constant:.3e} s)"
                  + ("" if self.args.cost_model else " -- NOT calibrated on this GPU"))
        self.emit(f"- B = {self.sizes.batch_size} per rank; medians of {self.repeats} round-robin passes")
        self.emit()

    def samplers(self) -> dict:
        np = self.np
        cap = self.sizes.max_length
        document = json.loads(LENGTHS_FILE.read_text())
        population = np.repeat(np.asarray(document["lengths"]), np.asarray(document["counts"]))
        return {
            f"log-normal(mu={MU:.3f}, sigma={SIGMA}) capped at {cap}":
                lambda n: np.clip(np.round(self.rng.lognormal(MU, SIGMA, n)), 1, cap).astype(np.int64),
            f"MovieLens-100K ({document['users']} users) capped at {cap}":
                lambda n: np.clip(self.rng.choice(population, n), 1, cap).astype(np.int64),
        }

    def measure(self, name: str, sampler, k: int) -> dict:
        """Plan K x B x steps lengths three ways; time every (step, rank) batch; measured and predicted."""
        from freescale.balancing import bubble, plan
        from freescale.balancing.simulate import Noise, TimeModel, simulate

        b, steps = self.sizes.batch_size, self.sizes.steps[k]
        lengths = sampler(k * b * steps)
        costs = self.cost_model.predict(lengths)
        width = self.config.model.embedding_dim
        plans = {"contiguous": plan(costs, k, b, strategy="contiguous"),
                 "flops_kk": plan(costs, k, b, strategy="flops_kk", lengths=lengths, flop_width=width),
                 "kk": plan(costs, k, b, strategy="kk", lengths=lengths, window_steps=steps)}
        cells = {label: [lengths[(p.step == s) & (p.rank == r)] for s in range(p.num_steps) for r in range(k)]
                 for label, p in plans.items()}
        seconds = self.time_batches([batch for label in PLANS for batch in cells[label]])
        # The cost model's seconds, its per-step constant in every rank's compute: simulate's definition.
        time_model = TimeModel(noise=Noise(), step_constant_s=self.step_constant)
        out = {"lengths": name, "K": k, "B": b, "steps": steps, "mean_length": float(lengths.mean())}
        for i, label in enumerate(PLANS):
            p = plans[label]
            times = seconds[i * p.num_steps * k:(i + 1) * p.num_steps * k].reshape(p.num_steps, k)
            out[label] = {"bubble": bubble(times), "step_s": float(times.max(axis=1).mean()),
                          "total_s": float(times.max(axis=1).sum()), "predicted_bubble": math.nan,
                          "predicted_step_s": math.nan}
            if self.in_seconds:
                predicted = simulate(p.loads, time_model, b, seed=self.args.seed)
                out[label]["predicted_bubble"] = predicted.bubble_fraction
                out[label]["predicted_step_s"] = predicted.mean_step_time_s  # as measured: a mean over steps
        # Printed as soon as measured: a run cut short by its time budget still leaves every finished case.
        self.emit(f"- {name}, K={k}: done ({time.perf_counter() - self.started:.0f} s)")
        self.emit()
        self.table(COLUMNS, [row_cells(out)])
        self.emit()
        return out

    def time_batches(self, batches: list) -> "object":
        """Median wall seconds of each batch's dense forward+backward, timed round-robin."""
        np = self.np
        from freescale.training.calibration.calibrate import synthetic_batch, time_dense_step, time_round_robin

        model, table = self.model()
        loss = self.config.loss
        prepared = [synthetic_batch(lengths.tolist(), self.args.num_items, seed=self.args.seed + i).to(self.device)
                    for i, lengths in enumerate(batches)]
        steps = [lambda batch=batch, i=i: time_dense_step(model, table, batch, loss.num_negatives, loss.full_softmax,
                                                          seed=i, loss_kind=loss.kind)
                 for i, batch in enumerate(prepared)]
        measured = time_round_robin(steps, self.repeats, self.sizes.warmup)
        if model.graphed_encoder is not None:
            self.emit(f"- CUDA graphs so far: {model.graphed_encoder.stats.summary()}")
        return np.median(measured[:, :, 1], axis=1)

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
        lognormal = [r for r in rows if r["lengths"].startswith("log-normal")]
        checks = []
        for r in lognormal:
            k, kk, flops, contiguous = r["K"], r["kk"], r["flops_kk"], r["contiguous"]
            speedup = contiguous["total_s"] / kk["total_s"]
            checks += [
                (f"K={k}: kk bubble", "<= 3%", f"{kk['bubble']:.1%}", kk["bubble"] <= 0.03),
                (f"K={k}: kk vs contiguous, sum of step times", ">= 1.3x", f"{speedup:.2f}x", speedup >= 1.3),
                (f"K={k}: kk bubble below flops_kk's", "<", f"{kk['bubble']:.1%} vs {flops['bubble']:.1%}",
                 kk["bubble"] < flops["bubble"]),
            ]
        for r in lognormal:
            if r["K"] != max(self.sizes.ranks):
                continue
            for label in PLANS:
                m = r[label]
                step_error = m["predicted_step_s"] / m["step_s"] - 1.0
                bubble_gap = m["predicted_bubble"] - m["bubble"]
                # 15% of the measured bubble, or one point when the bubble is small (kk's few per cent)
                bubble_ok = abs(bubble_gap) <= max(0.15 * m["bubble"], 0.01)
                checks += [
                    (f"K={r['K']}, {label}: simulate's step time vs measured", "within 15%", f"{step_error:+.1%}",
                     abs(step_error) <= 0.15),
                    (f"K={r['K']}, {label}: simulate's bubble vs measured", "within 15% (or 1 point)",
                     f"{m['predicted_bubble']:.1%} vs {m['bubble']:.1%}", bubble_ok),
                ]
        self.emit("## Targets (issue 24)")
        self.emit()
        self.table(["what", "target", "measured", "met"],
                   [[what, target, value, "n/a (smoke)" if self.smoke else ("yes" if ok else "**no**")]
                    for what, target, value, ok in checks])


if __name__ == "__main__":
    sys.exit(main())
