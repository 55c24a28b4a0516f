"""What the GPU benchmarks share: their markdown output, the commit a table was measured on, and
the modules a bare GPU machine lacks (a benchmark that loaded one refuses to report).

Imported as ``benchmarks.report`` once a script has put the repository on its path; standard
library only, so it loads on the GPU machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_MACHINE_LACKS = ("torchrec", "fbgemm_gpu", "pyspark", "mlflow", "ortools", "pandas", "pyarrow", "torchdata")


def loaded_gpu_machine_lacks() -> list[str]:
    """The top-level modules of GPU_MACHINE_LACKS this process has loaded."""
    return sorted({m.split(".")[0] for m in sys.modules} & set(GPU_MACHINE_LACKS))


class Markdown:
    """Lines to the terminal and, when ``output`` is given, appended to that file as they go, so a
    run cut short still leaves its finished tables."""

    def __init__(self, output: str | None) -> None:
        self.output = output

    def emit(self, line: str = "") -> None:
        print(line, flush=True)
        if self.output:
            with open(self.output, "a") as handle:
                handle.write(line + "\n")

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.emit("| " + " | ".join(header) + " |")
        self.emit("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            self.emit("| " + " | ".join(row) + " |")
        self.emit()


def commit() -> str:
    # A copied working tree may carry stale git metadata: the caller's word comes first.
    if os.environ.get("FREESCALE_COMMIT"):
        return os.environ["FREESCALE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here; set FREESCALE_COMMIT)"
