#!/usr/bin/env bash
# Sets up, builds, checks function sizes (lizard), builds the ASan+UBSan binary of the bounded fuzz and runs
# the whole test suite: unit tests (gtest), the PyTorch oracle (tests/reference), command-line tests
# (tests/cli), mpirun layouts (tests/parallel) and the bounded fuzz (tests/fuzz).
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
# The ASan+UBSan build that the bounded fuzz test (fuzz.mutate_bounded, tests/fuzz/) runs against.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Release -DORIGAMI_SANITIZE=ON -DORIGAMI_TESTS=OFF
ninja -C build-asan origami
ctest --test-dir build --output-on-failure -j 1 "$@"
