"""The HSTU attention kernels compile for sm_90 (H100/H200) on this GPU-less machine.

CI has no GPU, so without this the compiled kernels would first meet Triton's compiler on a GPU
machine, in a check that has minutes to run. ``benchmarks/kernel_static.py`` compiles them for
sm_90 with the ptxas Triton ships; here one small config each, in a subprocess because this test
session interprets Triton (tests/conftest.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.spawns, pytest.mark.extended]  # every test compiles in a subprocess


def compile_rows(tmp_path_factory, *extra: str) -> list[dict]:
    out = tmp_path_factory.mktemp("static") / "rows.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "benchmarks.kernel_static", "--configs", "32/4/2", "--json", str(out), *extra],
                   cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    return compile_rows(tmp_path_factory)


def loops_of(rows: list[dict], kernel: str) -> list[dict]:
    found = [row for row in rows if row["kernel"] == kernel]
    assert found and not any("error" in row for row in found), found
    return found


def test_forward_compiles_fits_an_sm_and_keeps_its_tile_loop_in_registers(compiled) -> None:
    (loop,) = loops_of(compiled, "forward")
    assert loop["fits"] and loop["spill ld/st"] == 0
    assert loop["tensor-core"] > 0 and loop["atomics"] == 0
    # lg2, ex2 and rcp per entry: the SFU approximations, not the ~20-instruction accurate routines.
    assert loop["SFU"] >= 3 * 32 * 32 // (4 * 32)


def test_backward_adds_bias_gradients_in_phase_two_only(compiled) -> None:
    key_tiles, query_tiles = loops_of(compiled, "backward")
    for loop in (key_tiles, query_tiles):
        assert loop["fits"] and loop["spill ld/st"] == 0 and loop["tensor-core"] > 0
    assert key_tiles["atomics"] == 0 and query_tiles["atomics"] > 0
    # Relaxed atomics: an acq_rel add is preceded by a GPU-wide fence, one per add per thread.
    assert key_tiles["fences"] == 0 and query_tiles["fences"] == 0


def test_bf16_kernels_compile_with_bf16_dots_and_no_spills_in_their_loops(tmp_path_factory) -> None:
    """``training.precision = "bf16"``: the kernels as launched on bf16 q, k, v (fp32 bias tables)
    compile for sm_90, keep their tile loops in registers and run their dots on tensor cores. The
    interpreter cannot check bf16 (tests/training/test_hstu_kernel.py), and no GPU has run it yet; ~7 s."""
    rows = compile_rows(tmp_path_factory, "--dtype", "bf16")
    assert {row["dtype"] for row in rows} == {"bf16"}
    for kernel, loops in (("forward", 1), ("backward", 2)):
        found = loops_of(rows, kernel)
        assert len(found) == loops
        assert all(loop["fits"] and loop["spill ld/st"] == 0 and loop["tensor-core"] > 0 for loop in found)


def test_atomic_dq_backward_is_one_loop_with_fewer_instructions_per_entry_than_both_phases(tmp_path_factory) -> None:
    """``backward="atomic_dq"`` in bf16 at 32/4/2: one tile loop (every gradient from one score tile),
    relaxed atomics (no fences), its dots on tensor cores, no spills in the loop, and fewer instructions
    per tile entry than the two-phase backward's two loops together (both visit every tile pair)."""
    rows = compile_rows(tmp_path_factory, "--dtype", "bf16", "--kernels", "backward,backward_atomic_dq")
    (fused,) = loops_of(rows, "backward_atomic_dq")
    phases = loops_of(rows, "backward")
    assert fused["fits"] and fused["spill ld/st"] == 0 and fused["tensor-core"] > 0
    assert fused["atomics"] > 0 and fused["fences"] == 0
    assert fused["per entry"] < sum(loop["per entry"] for loop in phases)
