#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the CUDA kernels' tests against their CPU twins, compute-sanitizer's
# memcheck over the attention, LM-head and norm tests, and the kernel benchmark beside PyTorch's
# (bench/cuda_kernels_torch.py). CI has no GPU: there these tests print SKIPPED.
# usage: scripts/gpu_check.sh [BIN_DIR (default build)] [OUT_DIR (default .)]
#   BIN_DIR holds origami_gpu_tests and cuda_kernels_bench (ninja -C build origami_gpu_tests cuda_kernels_bench)
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build}
out=${2:-.}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== tests"
"$bin/origami_gpu_tests" 2>&1 | tee "$out/gpu_tests.txt" | grep -v "^\[ RUN\|^\[       OK" || status=1
grep -q "FAILED\|SKIPPED" "$out/gpu_tests.txt" && status=1
echo "== compute-sanitizer memcheck"
timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/origami_gpu_tests" \
  --gtest_filter='*AttentionDocumentMask*:*AttentionBf16*:*LmHead*:*Norms*:*Linear*:*Moe*' >"$out/memcheck.txt" 2>&1
rc=$?
tail -3 "$out/memcheck.txt"
echo "memcheck exit code $rc"
[ $rc -eq 0 ] || status=1
echo "== benchmark: origami"
"$bin/cuda_kernels_bench" | tee "$out/bench_origami.txt"
echo "== benchmark: PyTorch"
python3 bench/cuda_kernels_torch.py | tee "$out/bench_torch.txt"
exit $status
