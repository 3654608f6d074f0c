#!/usr/bin/env bash
# Builds the libFuzzer targets of the pure parsers (tests/fuzz/fuzz_*.cpp: safetensors header, tokenizer
# files, .idx, model config, cluster file, checkpoint metadata, --layout strings, blend strings) with
# Debian's clang 16 and -fsanitize=fuzzer,address,undefined in build-fuzz, then runs each for SECONDS.
#
#   bash scripts/fuzz_libfuzzer.sh [SECONDS] [TARGET ...]      (default: 60 s each, every target)
#
# Seed corpora come from the mutation fuzzer's seeds (made with build/origami) plus small synthetic
# files (tests/fuzz/libfuzzer_corpus.py). The runs continue past a finding (-fork=1 -ignore_crashes=1
# ...): each crash, leak-free OOM or timeout input is kept under build-fuzz/findings/TARGET/ and the
# summary lists them; reproduce one with `build-fuzz/fuzz_TARGET FILE`. Exit status 1 if any target
# has findings. FUZZ_JOBS (default 1) runs that many fuzzing processes per target.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
all=(safetensors tokenizer_json idx model_config cluster ckpt_metadata layout blend)
targets=("${@:-${all[@]}}")
[ ${#targets[@]} -eq 0 ] && targets=("${all[@]}")

bash scripts/setup.sh --fuzz
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=clang++-16 -DORIGAMI_FUZZ=ON \
  -DORIGAMI_TESTS=OFF ${CMAKE_CXX_COMPILER_LAUNCHER:+-DCMAKE_CXX_COMPILER_LAUNCHER=$CMAKE_CXX_COMPILER_LAUNCHER}
ninja -C build-fuzz "${targets[@]/#/fuzz_}"

# Seeds: made by the release binary (build it if needed).
if [ ! -x build/origami ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
  ninja -C build origami
fi
rm -rf build-fuzz/seeds-run build-fuzz/corpus
/usr/bin/python3 tests/fuzz/mutate.py --seeds-only --bin build/origami --out build-fuzz/seeds-run >/dev/null
/usr/bin/python3 tests/fuzz/libfuzzer_corpus.py build-fuzz/seeds-run/seeds build-fuzz/corpus

export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
if command -v llvm-symbolizer >/dev/null; then export ASAN_SYMBOLIZER_PATH=$(command -v llvm-symbolizer); fi
summary=()
status=0
for t in "${targets[@]}"; do
  rm -rf "build-fuzz/findings/$t"  # this run's findings only (the corpus it grew is kept)
  mkdir -p "build-fuzz/findings/$t" "build-fuzz/corpus-run/$t"
  log="build-fuzz/findings/$t.log"
  echo "== fuzz_$t for ${secs} s (log: $log)"
  # the first corpus directory collects new inputs; the seeds stay as they are
  build-fuzz/fuzz_$t -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -max_len=65536 \
    -fork="${FUZZ_JOBS:-1}" -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1 \
    -dict="build-fuzz/corpus/$t.dict" -artifact_prefix="build-fuzz/findings/$t/" \
    "build-fuzz/corpus-run/$t" "build-fuzz/corpus/$t" >"$log" 2>&1 || true
  n=$(find "build-fuzz/findings/$t" -type f | wc -l)
  runs=$(grep -o 'exec/s: [0-9]*' "$log" | tail -1 || true)
  execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#' || true)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 || true)
  summary+=("fuzz_$t: ${secs} s, ${execs:-?} inputs, ${cov:-cov ?}, ${runs:-exec/s ?}, findings: $n")
  if [ "$n" -gt 0 ]; then
    status=1
    for f in $(find "build-fuzz/findings/$t" -type f | sort | head -20); do
      # the first line that says what went wrong, from a rerun of the input
      why=$(timeout 60 build-fuzz/fuzz_$t -timeout=10 -rss_limit_mb=4096 "$f" 2>&1 |
            grep -a -m1 -E 'runtime error:|FUZZ FINDING|ERROR: AddressSanitizer|Sanitizer:DEADLYSIGNAL|out-of-memory|ERROR: libFuzzer' |
            cut -c1-200 | tr -c '[:print:]\n' '?' || true)
      summary+=("    $f: ${why:-(see the log)}")
    done
  fi
done
echo
printf '%s\n' "${summary[@]}"
exit $status
