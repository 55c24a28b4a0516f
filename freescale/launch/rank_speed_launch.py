"""The rank-speed ranks of `freescale calibrate --rank-speeds-output`, started: ``--nproc-per-node``
gloo ranks under torch's elastic launcher (as `freescale train` starts its ranks), each running
``python -m WORKER_MODULE WORKER_FLAG`` (freescale/training/calibration/rank_speed_ranks.py's
:func:`rank_speeds_worker`); rank 0 gathers the raw ``[repeats, ranks]`` times into a file this
process reads. The statistics are freescale/costs/rank_speeds.py's. No torch here: the ranks load it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from freescale.training.calibration.calibrate_spec import CalibrateSpec
from freescale.training.calibration.rank_speed_ranks import WORKER_FLAG

REPO_ROOT = Path(__file__).resolve().parents[2]


WORKER_MODULE = "freescale.jobs.calibrate"
"""How a rank is started: ``python -m WORKER_MODULE WORKER_FLAG ARGS``."""


class RankSpeedsFailed(RuntimeError):
    """The ranks did not write their times: the message has their exit status and last output lines."""


def measure_rank_speeds(spec: CalibrateSpec, overrides: list[str]) -> dict:
    """Launch the ranks with torch's elastic launcher; the raw ``[repeats, ranks]`` times rank 0 gathered."""
    with tempfile.TemporaryDirectory(prefix="freescale-rank-speeds-") as tmp:
        result = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={spec.nproc_per_node}", "-m", WORKER_MODULE, WORKER_FLAG,
               "--result", str(result), "--repeats", str(spec.rank_speed_repeats),
               "--num-items", str(spec.num_items), "--seed", str(spec.seed)]
        if spec.config:
            cmd += ["--config", spec.config]
        cmd += overrides
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0 or not result.exists():
            tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-15:])
            raise RankSpeedsFailed(f"rank-speed ranks failed (exit {run.returncode}):\n{tail}")
        return json.loads(result.read_text())
