#!/usr/bin/env bash
# The whole GPU check of the Triton attention kernels, in one run (< 5 minutes on an H100/H200):
# the gpu-marked kernel tests (fp8 KV caches included: bit-equal writes, attention vs the
# dequantized reference), tp = 2 over NCCL (with two GPUs), then benchmarks/kernels.py. Output goes to the terminal and to
# $OUT (or the first argument; default $TMPDIR/pagestream-gpu-check): env.txt, tests.txt,
# benchmark.txt, kernels.json.
#
#   scripts/gpu_check.sh [out_dir]        # PYTHON=... picks the interpreter (needs CUDA torch,
#                                         # triton, pytest); FLEX=0 skips FlexAttention
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir=${1:-${OUT:-${TMPDIR:-/tmp}/pagestream-gpu-check}}
mkdir -p "$out_dir"

python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in .venv/bin/python python3 python; do
    if "$candidate" -c 'import sys, torch, triton; sys.exit(not torch.cuda.is_available())' \
        2>/dev/null; then
      python=$candidate
      break
    fi
  done
fi
if [ -z "$python" ]; then
  echo "gpu_check: no Python with CUDA torch and triton found; set PYTHON=" >&2
  exit 2
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$python" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
} | tee "$out_dir/env.txt"

echo "== gpu tests (tests/kernels/test_triton_gpu.py)"
timeout 170 "$python" -m pytest tests/kernels/test_triton_gpu.py -m gpu -q -rs \
  -p no:cacheprovider 2>&1 | tee "$out_dir/tests.txt"
tests_rc=${PIPESTATUS[0]}

echo "== tensor parallel over NCCL (tests/parallel/test_tensor_parallel_gpu.py; needs 2 GPUs)"
timeout 150 "$python" -m pytest tests/parallel/test_tensor_parallel_gpu.py -m gpu -q -rs \
  -p no:cacheprovider 2>&1 | tee "$out_dir/tp_tests.txt"
tp_rc=${PIPESTATUS[0]}

echo "== benchmark (benchmarks/kernels.py)"
flex_flag=--flex
[ "${FLEX:-1}" = "0" ] && flex_flag=
timeout 150 "$python" -u -m benchmarks.kernels $flex_flag --json "$out_dir/kernels.json" 2>&1 \
  | tee "$out_dir/benchmark.txt"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests rc=$tests_rc, tp tests rc=$tp_rc, benchmark rc=$bench_rc (124 = timed out)"
[ "$tests_rc" -eq 0 ] && [ "$tp_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
