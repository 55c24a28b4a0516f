"""benchmarks/hstu_gpu_bench.py, the one-command GPU check, rehearsed on CPU (``--smoke``).

The GPU machine gets one short try, so the script must not fail there for a reason a CPU run
could have shown: every section runs here at toy sizes through the Triton interpreter, on the
packages the GPU machine has (the script refuses to report if torchrec, pyspark, mlflow,
ortools, ... got loaded). Its numbers measure nothing and the script says so.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "benchmarks.hstu_gpu_bench"]  # run from the repository root


@pytest.fixture
def smoke(gpu_bench_smoke) -> tuple[subprocess.CompletedProcess, str]:
    """The session's smoke run (tests/scenarios.py: started in the background with the session)."""
    return gpu_bench_smoke


@pytest.mark.extended  # docs/testing.md
def test_smoke_run_prints_every_section_and_writes_them(smoke) -> None:
    run, written = smoke
    assert run.returncode == 0, run.stderr[-2000:]
    for heading in ("## a. Numerics", "## b. Cost curve", "## d. Where a target batch's step goes",
                    "## e. CUDA graphs", "## f. Where the GPU's time goes", "### Cost model fitted",
                    "## Targets (issues 14 and 24"):
        assert heading in run.stdout
    assert written.strip() == run.stdout.strip()
    assert "SMOKE RUN on CPU" in written and "issue 24, 1 x U[17, 20]: attention op" in written
    assert "TF32 matmuls (training.precision fp32;" in written
    # section e ran the graphed encoder (rerun on CPU) on both target batches, every call graphed
    assert "6 graphed calls over 2 captures (0 dropped)" in written and "eager calls: none" in written


@pytest.mark.extended  # docs/testing.md
def test_smoke_run_claims_no_target(smoke) -> None:
    run, written = smoke
    targets = written.split("## Targets", 1)[1]
    rows = [line for line in targets.splitlines() if line.startswith("| ") and "target" not in line]
    assert len(rows) >= 6 and all(row.rstrip().endswith("| n/a (smoke) |") for row in rows)


@pytest.mark.extended  # docs/testing.md
def test_smoke_numerics_agree(smoke) -> None:
    """The interpreter computes in fp32: triton and grouped agree to rounding."""
    run, written = smoke
    section = written.split("## a. Numerics", 1)[1].split("## b.", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| fp32")]
    assert len(rows) == 12  # six tensors, TF32 and full fp32 dots (the interpreter computes both in fp32)
    assert all(float(cells[4]) <= 1e-4 for cells in rows), rows


def test_precision_is_the_trainers_key(tmp_path, capsys) -> None:
    """``--precision`` and a trainer config's ``training.precision`` choose the encoder's arithmetic,
    through the trainer's loader and its check; the interpreter's rehearsal refuses bf16 (its dots
    have none) before it runs anything. The script's argument parsing, in this process."""
    from benchmarks import hstu_gpu_bench as bench

    bf16, bad = tmp_path / "bf16.toml", tmp_path / "bad.toml"
    bf16.write_text('[training]\nprecision = "bf16"\n')
    bad.write_text('[training]\nprecision = "fp8"\n')
    assert bench.parse_args([]).precision == "fp32"
    assert bench.parse_args(["--config", str(bf16)]).precision == "bf16"
    assert bench.parse_args(["--config", str(bf16), "--precision", "fp32"]).precision == "fp32"
    for argv, message in ((["--smoke", "--precision", "bf16"], "whose dots cannot take bf16"),
                          (["--smoke", "--config", str(bf16)], "whose dots cannot take bf16"),
                          (["--config", str(bad)], "training.precision must be one of 'fp32', 'bf16', got 'fp8'"),
                          (["--precision", "fp16"], "invalid choice: 'fp16'")):
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv


@pytest.mark.spawns
def test_without_a_gpu_the_real_check_refuses() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the real check would run")
    run = subprocess.run(BENCH, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "no CUDA device" in run.stderr
