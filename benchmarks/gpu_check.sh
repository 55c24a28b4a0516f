#!/usr/bin/env bash
# The GPU check, one command on a bare GPU machine (torch, triton, numpy, pytest; no venv), under
# 10 minutes (each part has its own timeout; the parts most worth having run first):
#   bash benchmarks/gpu_check.sh            # tables and logs under $OUT (default out/gpu-check)
# 1. the CUDA graphs' tests (freescale.training.model.encoder_graphs against the eager encoder): if they fail, the
#    next two parts run with training.cuda_graphs = "off" and say so;
# 2. `freescale calibrate --device cuda` on the GPU model (benchmarks/configs/gpu_virtual_ranks.toml,
#    bf16, CUDA graphs): the cost model the virtual ranks plan with;
# 3. virtual ranks: contiguous, flops_kk, kk and the mirror control at K = 64 and 256, every rank's batch
#    timed (each case's table printed as it finishes);
# 4. the kernel benchmark in bf16 (numerics, cost curve, where a step goes, CUDA graphs, issue 24's targets);
# 5. the CUDA comm tests and the compiled kernel's tests.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out/gpu-check}"
mkdir -p "$out"
status=0
mark() { echo "[${SECONDS} s] $*" | tee -a "$out/timings.txt"; }  # when each part started, for the budgets
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', '.'.join(map(str, torch.cuda.nccl.version())))"
} 2>&1 | tee "$out/machine.txt"
graphs=encoder
mark "CUDA graphs' tests"
timeout 60 python -m pytest -q -rs -p no:cacheprovider tests/training/test_encoder_graphs_cuda.py \
  2>&1 | tee "$out/graph_tests.txt" | tail -n 15
if ! grep -q " passed" "$out/graph_tests.txt" || grep -qE "failed|error" "$out/graph_tests.txt"; then
  graphs=off; status=1
  echo "CUDA graphs' tests did not pass: calibrate and the virtual ranks run with training.cuda_graphs = off"
fi
echo "training.cuda_graphs = $graphs" | tee -a "$out/machine.txt"
config=benchmarks/configs/gpu_virtual_ranks.toml
mark "calibrate"
timeout 60 python -m freescale.jobs.cli calibrate --device cuda --config "$config" --output "$out/cost_model.json" \
  --overwrite --repeats 3 --warmup 1 --held-out-batches 8 --tracking-uri none --training.cuda_graphs "$graphs" \
  > "$out/calibrate.log" 2>&1 || { status=1; tail -n 20 "$out/calibrate.log"; }
if [ -f "$out/cost_model.json" ]; then
  mark "virtual ranks"
  timeout 240 python -m benchmarks.virtual_ranks --device cuda --config "$config" --cost-model "$out/cost_model.json" \
    --output "$out/virtual_ranks.md" --training.cuda_graphs "$graphs" > "$out/virtual_ranks.log" 2>&1 \
    || { status=1; tail -n 20 "$out/virtual_ranks.log"; }
  cat "$out/virtual_ranks.md" 2>/dev/null
fi
mark "kernel bench"
timeout 115 python -m benchmarks.hstu_gpu_bench --precision bf16 --repeats 3 --output "$out/hstu_gpu.md" 2>&1 \
  | tail -n 200 > "$out/hstu_gpu.log" || { status=1; tail -n 20 "$out/hstu_gpu.log"; }
cat "$out/hstu_gpu.md" 2>/dev/null
mark "GPU tests"
timeout 105 python -m pytest -q -rs -p no:cacheprovider tests/comm/test_comm_cuda.py tests/training/test_hstu_kernel_cuda.py \
  2>&1 | tee "$out/gpu_tests.txt" | tail -n 15 || status=1
mark "done, status $status"
exit $status
