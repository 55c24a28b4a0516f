"""The calibrate job's options, declared once: `freescale calibrate`'s command line is derived from
``CalibrateSpec`` (freescale/runtime/options.py), and the spec is what the calibration run takes
(freescale/launch/calibration_run.py) and what `freescale pipeline`'s calibrate stage builds from its
``[calibrate]`` section. Standard library only (the lengths' fit check loads NumPy when it runs):
the parser is built, and the arguments checked, before torch loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from freescale.runtime.errors import InputError
from freescale.runtime.options import option

Device = Literal["auto", "cpu", "cuda"]
TIMED_KEYS = ("model.", "loss.", "training.precision")
"""The config keys that make the timed model: its shape, its loss and the encoder's arithmetic (recorded
as the run's params; the pipeline's calibrate stage passes only these of [train.overrides])."""


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


@dataclass(frozen=True, kw_only=True)
class CalibrateSpec:
    """One calibration: what is timed and how often, where the cost model (and rank speeds) go. The
    model, loss and precision timed are the training config's (``config`` and its overrides)."""

    SURFACES = ("cli",)
    """`freescale calibrate`'s options (the pipeline's [calibrate] section sets a few of them)."""

    output: str = option(help="cost-model JSON to write (for `freescale balance --cost-model`)")
    config: str | None = option(None, "TOML config whose [model], [loss] and training.precision are calibrated "
                                      "(default: built-in defaults)")
    lengths: str | None = option(None, "comma-separated history lengths to profile "
                                       "(default: 10 log-spaced from 16 to model.hstu.max_seq_len)")
    repeats: int = option(7, "timed rounds over all batches; medians are used")
    warmup: int = option(2, "untimed rounds first")
    replicates: int = option(2, "calibration batches per length")
    num_items: int = option(2000, "synthetic catalog size")
    held_out_batches: int = option(24, "mixed batches the written model is checked on; 0 skips the check")
    seed: int = option(0, "seed of the synthetic batches and the model")
    device: Device = option("auto", "where the model is timed: cpu (thread CPU clock) or cuda (CUDA events); "
                                    "auto = cuda when available (default)")
    rank_speeds_output: str | None = option(None, "also measure relative rank speeds and write them here "
                                                  "(for `freescale balance --capacities @FILE`)")
    nproc_per_node: int = option(2, "ranks for the rank-speed measurement")
    rank_speed_repeats: int = option(30, "lock-step repeats of the rank-speed measurement")
    overwrite: bool = option(False, "replace existing output files")
    run_name: str | None = option(None, "MLflow run name (default calibrate-<host>)")

    @property
    def length_grid(self) -> list[int] | None:
        """``lengths`` parsed (None: the default grid of the model's max_seq_len)."""
        return parse_lengths(self.lengths) if self.lengths else None

    def check(self) -> None:
        """Every problem with the values as one ``InputError``, before any work or heavy import."""
        minimums = (("--repeats", self.repeats, 1), ("--warmup", self.warmup, 0),
                    ("--replicates", self.replicates, 1), ("--num-items", self.num_items, 1),
                    ("--held-out-batches", self.held_out_batches, 0), ("--nproc-per-node", self.nproc_per_node, 2),
                    ("--rank-speed-repeats", self.rank_speed_repeats, 3))
        for flag, value, minimum in minimums:
            if value < minimum:
                raise InputError(f"{flag} must be at least {minimum}, got {value}")
        if 0 < self.held_out_batches < 3:
            raise InputError(f"--held-out-batches must be 0 or at least 3 (a correlation needs them), "
                             f"got {self.held_out_batches}")
        outputs = [Path(self.output)] + ([Path(self.rank_speeds_output)] if self.rank_speeds_output else [])
        if len(outputs) == 2 and outputs[0].resolve() == outputs[1].resolve():
            raise InputError(f"--output and --rank-speeds-output are the same file {outputs[0]}")
        for path in outputs:
            if path.exists() and not self.overwrite:
                raise InputError(f"output {path} already exists (pass --overwrite to replace it)")
            if path.is_dir():
                raise InputError(f"output {path} is a directory")
        if self.lengths:
            from freescale.costs.calibration import check_lengths  # NumPy

            check_lengths(self.length_grid)
