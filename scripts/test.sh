#!/usr/bin/env bash
# Sets up, builds, checks function sizes (lizard) and runs the whole test suite: unit tests (gtest), the PyTorch oracle
# (tests/reference) and command-line tests (tests/cli).
set -euo pipefail
# Threads that wait sleep instead of spinning: on a shared or busy machine spinning costs up to 2x.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
ninja -C build
# Functions short enough to read whole: none over 120 lines or cyclomatic complexity 50 (lizard
# prints the offenders and exits non-zero).
echo "lizard: functions over 120 lines or complexity 50 in src/ and apps/"
/usr/bin/python3 -m lizard src apps -l cpp -w -L 120 -C 50
ctest --test-dir build --output-on-failure -j 1 "$@"
