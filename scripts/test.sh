#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite: unit tests (gtest), the PyTorch oracle
# (tests/reference) and command-line tests (tests/cli).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
ninja -C build
ctest --test-dir build --output-on-failure -j 1 "$@"
