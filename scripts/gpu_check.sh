#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: the CUDA kernels' tests against their CPU twins, compute-sanitizer's
# memcheck over them (all but the 1 GiB LM-head case) and its racecheck over the attention kernels'
# shared memory (the bf16 and the document-masked tests), then the kernel benchmark beside PyTorch's (bench/cuda_kernels_torch.py; --no-torch
# leaves it out). CI has no GPU: there these tests print SKIPPED.
# usage: scripts/gpu_check.sh [BIN_DIR (default build)] [OUT_DIR (default .)] [--no-torch]
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
for tool in memcheck racecheck; do
  echo "== compute-sanitizer $tool"
  filter='-*LmHeadInChunks*' limit=180
  [ $tool = racecheck ] && filter='*AttentionBf16*:*AttentionDocumentMask*' limit=120
  timeout $limit compute-sanitizer --tool $tool --error-exitcode 9 "$bin/origami_gpu_tests" --gtest_filter="$filter" \
    >"$out/$tool.txt" 2>&1
  rc=$?
  tail -3 "$out/$tool.txt"
  echo "$tool exit code $rc"
  [ $rc -eq 0 ] || status=1
done
echo "== benchmark: origami"
"$bin/cuda_kernels_bench" | tee "$out/bench_origami.txt" || status=1
if [ "${3:-}" != --no-torch ]; then
  echo "== benchmark: PyTorch"
  python3 bench/cuda_kernels_torch.py | tee "$out/bench_torch.txt" || status=1
fi
exit $status
