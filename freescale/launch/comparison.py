"""A comparison of training runs (`freescale compare`): its spec, its names, the trainings (each a
`freescale train` child process, variants alternating), per-variant medians over repeats, what
balancing removed against the noise floor, and the table and timelines that show it. No torch:
a training is its summary (`freescale train --summary-json`'s ``summary``)."""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from freescale.runtime import options
from freescale.runtime.errors import InputError
from freescale.runtime.options import option
from freescale.prepare.prepared import dataset_name
from freescale.costs.run_summary import read_run_summary, timing_table
from freescale.shards.balance_spec import BalanceSpec  # the balancing registry's names only: numpy
from freescale.shards.shard_sets import VARIANTS, parse_shard_sets, prepared_of
from freescale.training.config import CommMode  # typed config, no torch
from freescale.tracking.store import Tracking  # no mlflow import until a run opens

TABLE = (("bubble_fraction", "bubble", "{:.4f}", 1), ("idle_fraction", "idle", "{:.3f}", 1),
         ("step_time_s", "step time (ms)", "{:.1f}", 1e3), ("samples_per_s", "samples/s", "{:.0f}", 1),
         ("hr_at_10", "HR@10", "{:.4f}", 1), ("ndcg_at_10", "NDCG@10", "{:.4f}", 1))
PLOT_NAME = "comparison_timelines.png"
QUALITY = ("hr_at_10", "ndcg_at_10", "mrr")  # plus the sampled_* metrics when the runs have them


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per variant, the median over repeats of every summary number all its runs have."""
    out = {}
    for variant, rows in runs.items():
        keys = set.intersection(*(set(r["summary"]) for r in rows))
        out[variant] = {k: statistics.median(float(r["summary"][k]) for r in rows) for k in sorted(keys)}
    return out


def removed_share(contiguous: float, balanced: float, floor: float) -> float | None:
    """The share of the removable amount (contiguous - floor) that balancing removed; None when
    there was nothing to remove."""
    removable = contiguous - floor
    return (contiguous - balanced) / removable if removable > 0 else None


def comparison_metrics(med: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """The parent run's numbers, from the medians: reductions against the control's floor (0
    without a control), speedup, and balanced - contiguous quality."""
    con, bal = med["contiguous"], med["balanced"]
    floor = med.get("control", {})
    metrics: dict[str, float | None] = {
        "bubble_reduction": removed_share(con["bubble_fraction"], bal["bubble_fraction"],
                                          floor.get("bubble_fraction", 0.0)),
        "idle_reduction": removed_share(con["idle_fraction"], bal["idle_fraction"], floor.get("idle_fraction", 0.0)),
        "speedup": bal["samples_per_s"] / con["samples_per_s"] if con["samples_per_s"] > 0 else None,
    }
    sampled = sorted(k for k in con if k.startswith("sampled_") and k in bal)
    for key in (*QUALITY, *sampled):
        if key in con and key in bal:
            metrics[f"delta_{key}"] = bal[key] - con[key]
    for variant, values in med.items():
        metrics.update({f"{variant}/{k}": v for k, v in values.items()})
    return metrics


SOURCE = "what to compare (one of)"
HEAD = ("input", "shards", "world_size", "local_batch_size")
"""The options listed before the balanced variant's (BalanceSpec's "compare" surface) on the command line."""


@dataclass(frozen=True, kw_only=True)
class CompareSpec:
    """What to compare, how often and how long, and the balanced variant's plan options."""

    SURFACES = ("cli",)

    input: str | None = option(None, "a prepared dataset (`freescale prepare`'s output): the shard sets are built",
                               group=SOURCE)
    shards: str | None = option(None, "existing shard sets: contiguous=DIR,balanced=DIR[,control=DIR]", group=SOURCE)
    world_size: int | None = option(None, "ranks K (with --input; with --shards: the manifests')", positive=True)
    local_batch_size: int | None = option(None, "samples per rank per step B (with --input)", positive=True)
    balanced: dict[str, Any] = field(default_factory=dict)
    """BalanceSpec's "compare" options (strategy, window_steps, ...), for the balanced shard set."""
    cost_model: str | None = option(None, "cost-model JSON for every variant (default: the built-in analytic model)")
    control: bool = option(False, "also train on the mirror control (the noise floor)")
    repeats: int = option(3, "runs per variant (default 3); medians are reported", positive=True)
    max_steps: int | None = option(None, "steps per run", positive=True, exclusive="steps")
    epochs: int | None = option(None, "passes over the balanced shards per run (default 1)", positive=True,
                                exclusive="steps")
    seed: int = option(options.default_of(BalanceSpec, "seed"), "balance seed, and training seed of repeat "
                                                                 "r = seed + r", show_default=False)
    config: str | None = option(None, "training TOML config, for every run")
    comm_mode: CommMode | None = option(None, "comm mode of every run (default: the config's)")
    workdir: str | None = option(None, "shards, run logs and summaries (default out/compare/<comparison>)")
    summary_json: str | None = option(None, "write the comparison's numbers here")

    def check(self) -> None:
        if (self.input is None) == (self.shards is None):
            raise InputError("give --input PREPARED (build the shard sets) or --shards contiguous=DIR,balanced=DIR")
        if self.input is not None and (self.world_size is None or self.local_batch_size is None):
            raise InputError("--input needs --world-size and --local-batch-size")


class StageFailed(Exception):
    """A stage (balance, train) failed; its own line was printed, or ``message`` says why."""

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message or f"a stage failed with exit status {code}")
        self.code, self.message = code, message


def train_once(shards: Path, out: Path, settings: list[str]) -> dict:
    """One `freescale train` in a child process, its output in ``out``.log; its summary JSON."""
    cmd = [sys.executable, "-m", "freescale.jobs.cli", "train", "--shards", str(shards), "--summary-json", str(out), *settings]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
    log = out.with_suffix(".log")
    with open(log, "w") as handle:
        child = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT)
        try:
            code = child.wait()
        except BaseException:
            child.send_signal(signal.SIGTERM)  # the launcher passes it on; the runs end KILLED
            child.wait()
            raise
    if code:
        lines = [line for line in log.read_text(errors="replace").splitlines() if ": error: " in line]
        reason = lines[-1].split(": error: ", 1)[1] if lines else f"exit status {code}"
        raise StageFailed(code, f"training {out.stem} failed: {reason} (output: {log})")
    return read_run_summary(out)


def run_trainings(args: CompareSpec, overrides: list[str], sets: dict[str, Path], steps: int | None,
                  work: Path, uri: str, experiment: str, name: str, comparison: str,
                  parent_run_id: str | None,
                  on_run: Callable[[str, dict], None] = lambda variant, row: None) -> dict[str, list[dict]]:
    """Every repeat, variants alternating, the same seed per repeat; the summaries per variant.
    ``on_run(variant, row)`` as each training ends (the parent tags its run)."""
    runs: dict[str, list[dict]] = {v: [] for v in sets}
    (work / "runs").mkdir(parents=True, exist_ok=True)
    from freescale.shards.manifest import load_manifest

    world_size = load_manifest(sets["balanced"]).world_size
    for rep in range(args.repeats):
        for variant in sets:
            settings = ["--nproc-per-node", str(world_size), "--tracking-uri", uri,
                        "--run-name", f"{name}-{variant}-r{rep}", "--training.seed", str(args.seed + rep),
                        "--tracking.experiment", experiment, "--tracking.comparison", comparison]
            settings += ["--tracking.parent_run_id", parent_run_id] if parent_run_id else []
            settings += ["--max-steps", str(steps)] if steps else []
            settings += ["--config", args.config] if args.config else []
            settings += ["--comm-mode", args.comm_mode] if args.comm_mode else []
            result = train_once(sets[variant], work / "runs" / f"{variant}-{rep}.json", [*settings, *overrides])
            summary = result["summary"]
            runs[variant].append({"repeat": rep, "seed": args.seed + rep, "run_id": result.get("mlflow_run_id"),
                                  "summary_json": str(work / "runs" / f"{variant}-{rep}.json"), "summary": summary})
            on_run(variant, runs[variant][-1])
            print(f"freescale compare: repeat {rep} {variant:10s} bubble {summary['bubble_fraction']:.4f}  "
                  f"idle {summary['idle_fraction']:.3f}  step {summary['step_time_s'] * 1e3:.1f} ms  "
                  f"hr@10 {summary['hr_at_10']:.4f}", flush=True)
    return runs


def format_table(runs: dict[str, list[dict]], metrics: dict[str, float | None]) -> str:
    """What the terminal shows: per variant the median [min, max] of each number, then the reductions."""
    def cell(rows: list[dict], key: str, fmt: str, scale: float) -> str:
        values = [float(r["summary"][key]) * scale for r in rows]
        return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"

    lines = ["| shards | " + " | ".join(label for _, label, _, _ in TABLE) + " |",
             "| --- " * (len(TABLE) + 1) + "|"]
    for variant, rows in runs.items():
        lines.append(f"| {variant} | " + " | ".join(cell(rows, key, fmt, scale) for key, _, fmt, scale in TABLE) + " |")

    def pct(value: float | None) -> str:
        if value is None:
            return "n/a (nothing to remove)"
        return f"{value:.1%}" + (" (balanced below the floor: the floor is noise)" if value > 1 else "")

    floor = "control" if "control" in runs else "0 (no control)"
    con, bal = (f"{metrics[f'{v}/bubble_fraction']:.4f}" for v in ("contiguous", "balanced"))
    lines += ["",
              f"bubble_reduction: {pct(metrics['bubble_reduction'])} of the removable bubble removed "
              f"(contiguous {con} -> balanced {bal}; floor: {floor})",
              f"idle_reduction:   {pct(metrics['idle_reduction'])} of the removable idle time removed "
              f"({metrics['contiguous/idle_fraction']:.3f} -> {metrics['balanced/idle_fraction']:.3f})",
              "speedup:          " + ("n/a" if metrics["speedup"] is None else
                                      f"{metrics['speedup']:.3f}x samples/s "
                                      f"({metrics['contiguous/samples_per_s']:.0f} -> "
                                      f"{metrics['balanced/samples_per_s']:.0f})"),
              "quality, balanced - contiguous (medians): "
              + ", ".join(f"{k[len('delta_'):]} {v:+.4f}" for k, v in metrics.items() if k.startswith("delta_")),
              f"signal:           {floor_verdict(runs)}"]
    return "\n".join(lines)


def floor_verdict(runs: dict[str, list[dict]]) -> str:
    """Whether the bubble balancing removed is above the machine's noise floor, from the repeats'
    ranges: the contiguous bubbles against the control's (the floor) and the balanced ones."""
    bubbles = {v: [float(r["summary"]["bubble_fraction"]) for r in rows] for v, rows in runs.items()}
    if "control" not in bubbles:
        return "unknown: no control, so no noise floor was measured (run with --control and --repeats 3 or more)"
    con, bal, ctl = bubbles["contiguous"], bubbles["balanced"], bubbles["control"]
    spread = "" if min(map(len, bubbles.values())) > 1 else " (1 repeat: no spread, so a weak verdict)"
    if min(con) <= max(ctl):
        return ("within the noise floor: some contiguous repeat's bubble is at or under a control's; "
                "more steps or repeats are needed to tell" + spread)
    if max(bal) >= min(con):
        return ("the contiguous bubble is above the floor, but the balanced and contiguous repeats overlap"
                + spread)
    return ("above the floor: every contiguous repeat's bubble exceeds every control's and every balanced "
            "repeat's" + spread)


def comparison_note(summary: dict) -> str:
    """The parent run's description (Markdown): what was compared, the table and the reductions."""
    table, _, lines = format_table(summary["runs"], summary["metrics"]).partition("\n\n")
    return (f"**{summary['comparison']}**: {summary['repeats']} repeats of "
            f"{summary['max_steps'] or 'one pass of'} steps on {summary['world_size']} ranks x "
            f"{summary['local_batch_size']} samples, balanced with `{summary['strategy']}`, variants alternating.\n\n"
            + table + "\n\n" + "\n".join(f"- {line.replace('  ', '')}" for line in lines.splitlines())
            + f"\n\nPer-rank timelines: `{PLOT_NAME}` (artifacts); every number: `comparison.json`.\n")


def plot_comparison(runs: dict[str, list[dict]], path: Path, title: str) -> Path:
    """Contiguous and balanced side by side: for each, the repeat with its median bubble."""
    from freescale.training.timing.bubble_plot import plot_comparison_timelines

    columns = {}
    for variant in ("contiguous", "balanced"):
        rows = sorted(runs[variant], key=lambda r: r["summary"]["bubble_fraction"])
        chosen = rows[(len(rows) - 1) // 2]
        saved = read_run_summary(chosen["summary_json"])
        columns[f"{variant} (repeat {chosen['repeat']}): bubble {chosen['summary']['bubble_fraction']:.2%}"] = \
            (timing_table(saved, chosen["summary_json"]), saved["steps"])
    return plot_comparison_timelines(columns, path, title=title)


@dataclass
class Comparison:
    """One comparison's names, sizes and shard sets, fixed before its parent run opens."""

    name: str
    comparison: str
    experiment: str
    uri: str
    work: Path
    world_size: int
    local_batch_size: int
    strategy: str
    """The balanced variant's."""
    given_sets: dict[str, Path]
    """--shards' sets, by variant ({} with --input: they are built)."""
    control: str | None


def describe(spec: CompareSpec, manifests: dict, tracking: Tracking) -> Comparison:
    """The comparison's name (and so its MLflow names and folder) from its sizes and the time."""
    if spec.input is not None:
        prepared, world_size, batch = Path(spec.input), spec.world_size, spec.local_batch_size
        strategy, given = spec.balanced["strategy"], {}
    else:
        balanced = manifests["balanced"]
        world_size, batch, strategy = balanced.world_size, balanced.local_batch_size, balanced.strategy
        sets = parse_shard_sets(spec.shards, spec.control)
        # In VARIANTS' order, whatever the order given: the runs alternate in it.
        prepared, given = prepared_of(balanced), {v: sets[v] for v in VARIANTS if v in sets}
    name = f"compare-k{world_size}-b{batch}"
    comparison = f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    work = Path(spec.workdir or Path("out") / "compare" / comparison)
    control = "mirror" if spec.control or "control" in given else None
    return Comparison(name, comparison, tracking.experiment or f"freescale-{dataset_name(prepared)}", tracking.uri,
                      work, world_size, batch, strategy, given, control)
