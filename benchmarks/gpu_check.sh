#!/usr/bin/env bash
# The GPU check, one command on a bare GPU machine (torch, triton, numpy, pytest; no venv):
#   bash benchmarks/gpu_check.sh            # tables and logs under $OUT (default out/gpu-check)
# The CUDA comm tests, the compiled kernel's tests, then the kernel benchmark (< 5 min on an H200).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/gpu-check}"
mkdir -p "$out"
status=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())))"
} 2>&1 | tee "$out/machine.txt"
timeout 240 python -m pytest -q -rs -p no:cacheprovider tests/test_comm_cuda.py tests/test_hstu_kernel_cuda.py \
  2>&1 | tee "$out/gpu_tests.txt" || status=1
timeout 420 python benchmarks/hstu_gpu_bench.py --output "$out/hstu_gpu.md" 2>&1 | tail -n 200 > "$out/hstu_gpu.log" \
  || status=1
cat "$out/hstu_gpu.md" 2>/dev/null || tail -n 40 "$out/hstu_gpu.log"
exit $status
