#!/usr/bin/env bash
# The long fuzz run of issue 35: CASES mutated inputs (default 10000; tests/fuzz/mutate.py, after its probes)
# against the ASan+UBSan build (build-asan), then each libFuzzer target for SECONDS (default 300;
# scripts/fuzz_libfuzzer.sh, clang). Reproducers and the summary go to runs/fuzz-long-<time>/.
#
#   bash scripts/fuzz_long.sh [CASES] [SECONDS]      SECONDS 0: no libFuzzer part
#   FUZZ_SEED (default 1), FUZZ_JOBS (default 2), FUZZ_BIN (default build-asan/origami) change the run.
#
# Exit status 1 if either part found anything.
set -euo pipefail
cd "$(dirname "$0")/.."
cases=${1:-10000}
secs=${2:-300}
bash scripts/setup.sh
if [ -z "${FUZZ_BIN:-}" ]; then
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Release -DORIGAMI_SANITIZE=ON -DORIGAMI_TESTS=OFF
  ninja -C build-asan origami
fi
out=runs/fuzz-long-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
status=0
# (pipefail: a pipeline fails when the fuzzer does)
if ! /usr/bin/python3 tests/fuzz/mutate.py --bin "${FUZZ_BIN:-build-asan/origami}" --cases "$cases" \
    --seed "${FUZZ_SEED:-1}" --jobs "${FUZZ_JOBS:-2}" --out "$out" 2>&1 | tee "$out/mutate.log"; then
  status=1
fi
if [ "$secs" -gt 0 ] && ! bash scripts/fuzz_libfuzzer.sh "$secs" 2>&1 | tee "$out/libfuzzer.log"; then
  status=1
fi
echo "fuzz_long: mutation run in $out (summary.json), libFuzzer logs in build-fuzz/findings/"
exit $status
