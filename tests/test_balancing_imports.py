"""balancing runs inside Spark pandas UDFs: it must stay light and self-contained."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_import_pulls_in_only_numpy() -> None:
    code = (
        "import sys, balancing; "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'pyspark', 'torch', 'pandas', 'pyarrow', 'ortools'}); "
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert out.stdout.strip() == ""
