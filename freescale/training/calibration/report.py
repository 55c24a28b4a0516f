"""The tables `freescale calibrate` prints and records (calibration_report.txt): the fitted cost
model's per-length costs, fits, choice and held-out check, and the measured rank speeds. Torch-free
to import (the timing module's constants load with the first report).
"""
from __future__ import annotations

import math
from typing import Any


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:+.1%}"


def format_calibration_report(result: Any, output: str) -> str:
    """Readable tables of a ``CalibrationResult``: per-length costs, fits, choice, held-out check."""
    from freescale.costs.cost_model import KINDS
    from freescale.training.calibration.calibrate import CLOCKS, FIT_CLOCK, MIX_SAMPLES, PARETO_ALPHA, per_length_errors

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
