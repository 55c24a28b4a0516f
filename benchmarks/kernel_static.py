"""What the HSTU attention kernels compile to on an H100/H200 (sm_90), measured without a GPU.

    python -m benchmarks.kernel_static [--configs 64/4/2,64/8/2] [--output FILE]     # from the repository root

Triton compiles for a GPU it does not have: its ``compile`` takes a target, and its wheel
carries ``ptxas`` and ``nvdisasm``. For each kernel and autotune config (``BLOCK/num_warps/
num_stages``) this prints the registers and spill bytes ``ptxas -v`` reports, the shared memory
the kernel needs, and, for every loop of the compiled SASS, the instructions one iteration
issues per thread along its cheapest path (the kernels branch per tile only to a rarely taken
64-bit path), per tile entry, and the SFU, global-load, atomic, GPU-wide fence and local-memory (spill)
instructions among them.

These are static counts, not times: a GPU run of ``benchmarks.hstu_gpu_bench`` is the
measurement. They say whether a config compiles, spills or fits an SM, and how much work a
tile entry costs, which is what a kernel change moves. The model's shapes: heads of 64, 64
buckets, fp32 with TF32 dots; ``--dtype bf16`` compiles the kernels as ``training.precision =
"bf16"`` launches them (q, k, v, the output and their gradients bf16; bias tables and their
gradients fp32).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import commit as repo_commit

SHARED_PER_BLOCK = 227 * 1024
"""Most shared memory one block may use on sm_90."""

DEFAULT_CONFIGS = "64/4/2,64/8/2,32/4/2,64/4/1,64/8/1,128/8/2"
OPERAND_DTYPES = {"fp32": "*fp32", "bf16": "*bf16"}
"""``--dtype`` -> the pointer type of q, k, v, the output and their gradients (the dots' operands)."""
OPERANDS = ("Q", "K", "V", "OUT", "DOUT", "DQ_OUT", "DK_OUT", "DV_OUT")
KERNELS = {"forward": ("_forward_kernel", {}), "backward": ("_backward_kernel", {"ATOMIC_DQ": False}),
           "backward_atomic_dq": ("_backward_kernel", {"ATOMIC_DQ": True})}
"""``--kernels`` names -> the kernel and its variant's constants (``freescale.training.ops.hstu_attention.Backward``)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="BLOCK/num_warps/num_stages, comma-separated")
    parser.add_argument("--kernels", default="forward,backward", help=f"any of {', '.join(KERNELS)}")
    parser.add_argument("--dtype", choices=sorted(OPERAND_DTYPES), default="fp32",
                        help="q, k, v and what is computed in their dtype (default fp32)")
    parser.add_argument("--output", type=Path, help="also write the tables here")
    parser.add_argument("--json", type=Path, help="also write every row here, as a list of objects (tests read it)")
    args = parser.parse_args(argv)
    try:
        args.configs = [tuple(int(x) for x in c.split("/")) for c in args.configs.split(",")]
        if any(len(c) != 3 for c in args.configs):
            raise ValueError
    except ValueError:
        parser.error(f"--configs: expected BLOCK/num_warps/num_stages[,...], got {args.configs!r}")
    args.kernels = args.kernels.split(",")
    if not set(args.kernels) <= set(KERNELS):
        parser.error(f"--kernels: any of {', '.join(KERNELS)}, got {','.join(args.kernels)}")
    return args


def compile_kernel(ops, name: str, block: int, warps: int, stages: int, dtype: str = "fp32"):
    """``triton.compile`` of one kernel for sm_90, with the launch's specialisations (pointers and
    row strides divisible by 16), the model's constants and q, k, v in ``dtype`` (``OPERAND_DTYPES``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    function, variant = KERNELS[name]
    kernel = getattr(ops, function)
    names = kernel.arg_names
    constants = {"DQ": 64, "DV": 64, "BLOCK_DQ": 64, "BLOCK_DV": 64, "BLOCK": block, "NUM_POS": 64,
                 "NUM_TIME": 64, "PRECISION": "tf32", "STRIPES": ops.BIAS_STRIPES, **variant}
    constants = {k: v for k, v in constants.items() if k in names}
    pointers = {"offsets": "*i64", "times": "*i64", "pos_lut": "*i32", "time_thr": "*i32"}
    signature = {}
    for arg in names:
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = pointers[arg]
        elif arg == "DQ_OUT" and variant.get("ATOMIC_DQ"):
            signature[arg] = "*fp32"  # atomic_dq adds into fp32
        elif arg in OPERANDS:
            signature[arg] = OPERAND_DTYPES[dtype]
        elif (arg.isupper() and arg != "H") or arg.endswith("_w"):  # tensors; H is the head count
            signature[arg] = "*fp32"
        elif arg.endswith("_scale"):
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
    aligned = [i for i, arg in enumerate(names)
               if signature[arg].startswith("*") or (arg.startswith("stride") and arg.endswith("t"))]
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants,
                                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    target = GPUTarget("cuda", 90, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": warps, "num_stages": stages})
    return triton.compile(source, target=target, options=options.__dict__)


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resources(compiled, workdir: Path) -> tuple[int, int]:
    """(registers, spill-store bytes) from ``ptxas -v`` on the kernel's PTX."""
    ptx = workdir / "kernel.ptx"
    ptx.write_text(compiled.asm["ptx"])
    report = subprocess.run([_tool("ptxas"), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(workdir / "k.o")],
                            capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return registers, spills


def sass(compiled, workdir: Path) -> tuple[list[str], dict[str, int]]:
    """The kernel's SASS instructions (predicates kept) and each label's instruction index."""
    cubin = workdir / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    listing = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    instructions, labels = [], {}
    for line in listing:
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        instruction = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if instruction:
            instructions.append(instruction.group(1))
    return instructions, labels


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def _target(instruction: str) -> str | None:
    found = re.search(r"BRA `\((\.L_x_\d+)\)", instruction)
    return found.group(1) if found else None


def loops(instructions: list[str], labels: dict[str, int]) -> list[list[str]]:
    """Each loop's path through one iteration, from the label a backward branch jumps to, to that
    branch. Where the body branches into if/else (the kernels' 64-bit gap path is the only one),
    the cheaper side is taken; a conditional block with no else (an atomic add some lane of the
    warp needs, say) is counted as run."""
    found = []
    for end, instruction in enumerate(instructions):
        target = _target(instruction)
        if target is None or labels.get(target, end + 1) > end:
            continue
        start = labels[target]
        # Shortest path over the body: cost[i] = fewest instructions issued to reach index i.
        cost = {start: 0}
        best_path = {start: []}
        for i in range(start, end + 1):
            if i not in cost:
                continue
            path = best_path[i] + [instructions[i]]
            step = cost[i] + 1
            jump = _target(instructions[i])
            unconditional = jump is not None and not instructions[i].startswith("@")
            successors = [] if i == end else ([] if unconditional else [i + 1])
            if jump is not None and start <= labels.get(jump, -1) <= end and labels[jump] > i:
                landing = labels[jump]
                # A jump to an else block (the one before it ends in an unconditional jump to the join)
                # may skip the then block; a jump over a plain conditional block may not.
                if unconditional or (_target(instructions[landing - 1]) is not None
                                     and not instructions[landing - 1].startswith("@")):
                    successors.append(landing)
            for nxt in successors:
                if nxt not in cost or step < cost[nxt]:
                    cost[nxt], best_path[nxt] = step, path
            if i == end:
                found.append(path)
    return found


def describe(path: list[str], block: int, warps: int) -> dict[str, float]:
    counts = Counter(opcode(i) for i in path)
    return {
        "instructions": len(path),
        "per entry": len(path) * warps * 32 / (block * block),
        "SFU": counts["MUFU"],
        "global loads": counts["LDG"] + counts["LDGSTS"],
        "atomics": counts["RED"] + counts["ATOM"] + counts["ATOMG"] + counts["REDG"],
        "spill ld/st": counts["LDL"] + counts["STL"],
        "fences": sum(1 for i in path if "MEMBAR" in i and (".GPU" in i or ".SYS" in i)),  # not CTA-local ones
        "tensor-core": counts["HGMMA"] + counts["HMMA"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret
    from freescale.training.ops import hstu_attention as ops
    import triton

    lines, rows = [], []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    commit = repo_commit()
    emit("## HSTU attention kernels compiled for sm_90 (static; no GPU ran them)")
    emit()
    emit(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; commit: {commit}; "
         f"machine: {platform.machine()} CPU, triton {triton.__version__} (its ptxas and nvdisasm)")
    emit(f"- command: python -m benchmarks.kernel_static --configs "
         f"{','.join('/'.join(map(str, c)) for c in args.configs)}"
         + (f" --kernels {','.join(args.kernels)}" if args.kernels != ["forward", "backward"] else "")
         + (f" --dtype {args.dtype}" if args.dtype != "fp32" else ""))
    emit("- loop rows: one iteration (one tile) along the cheapest path; `per entry` is instructions issued per "
         "tile entry by all threads (instructions x threads / BLOCK^2)")
    emit()
    emit("| kernel | BLOCK/warps/stages | registers | spill bytes | shared KiB | fits an SM | loop | instructions "
         "| per entry | SFU | global loads | atomics | fences | spill ld/st | tensor-core |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name in args.kernels:
            for block, warps, stages in args.configs:
                started = time.perf_counter()
                try:
                    compiled = compile_kernel(ops, name, block, warps, stages, args.dtype)
                except Exception as err:  # a config the compiler rejects is a finding, not a crash
                    rows.append({"kernel": name, "dtype": args.dtype, "block": block, "warps": warps,
                                 "stages": stages, "error": f"{type(err).__name__}: {err}"})
                    emit(f"| {name} | {block}/{warps}/{stages} | compile failed: "
                         f"{type(err).__name__}: {str(err).splitlines()[0][:120]} ||||||||||||")
                    continue
                registers, spills = resources(compiled, workdir)
                shared = compiled.metadata.shared
                config = {"kernel": name, "dtype": args.dtype, "block": block, "warps": warps, "stages": stages,
                          "registers": registers,
                          "spill bytes": spills, "shared": shared, "fits": shared <= SHARED_PER_BLOCK}
                head = (f"| {name} | {block}/{warps}/{stages} | {registers} | {spills} | {shared / 1024:.0f} | "
                        f"{'yes' if shared <= SHARED_PER_BLOCK else '**no**'}")
                bodies = [p for p in loops(*sass(compiled, workdir)) if len(p) > 100]  # tile loops, not the search
                for index, path in enumerate(bodies):
                    d = describe(path, block, warps)
                    rows.append({**config, "loop": index + 1, **d})
                    emit(f"{head if index == 0 else '| | | | | |'} | {index + 1} | {d['instructions']} | "
                         f"{d['per entry']:.0f} | {d['SFU']} | {d['global loads']} | {d['atomics']} | {d['fences']} | "
                         f"{d['spill ld/st']} | {d['tensor-core']} |")
                print(f"  ({name} {block}/{warps}/{stages} compiled in {time.perf_counter() - started:.1f} s)",
                      file=sys.stderr)
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
