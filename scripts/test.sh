#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite: unit tests (gtest), the PyTorch oracle
# (tests/reference) and command-line tests (tests/cli).
set -euo pipefail
# Threads that wait sleep instead of spinning: on a shared or busy machine spinning costs up to 2x.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
ninja -C build
# The ASan+UBSan build that the bounded fuzz test (fuzz.mutate_bounded, tests/fuzz/) runs against.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Release -DORIGAMI_SANITIZE=ON -DORIGAMI_TESTS=OFF
ninja -C build-asan origami
ctest --test-dir build --output-on-failure -j 1 "$@"
