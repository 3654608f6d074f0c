#!/usr/bin/env bash
# Installs everything origami needs on a fresh Debian 12 machine. Safe to run twice:
# packages already present are skipped, and apt is only refreshed when something is missing.
set -euo pipefail

# Product dependencies (Debian packages only).
debian_packages=(
  build-essential cmake ninja-build pkg-config
  libopenblas0-openmp libopenblas-dev     # BLAS, OpenMP build: one thread pool shared with our own loops
  libdnnl-dev                             # oneDNN (OpenMP build): its sgemm for the layers' GEMMs
  libomp-dev
  openmpi-bin libopenmpi-dev              # MPI launcher and library
  nlohmann-json3-dev                      # config.json / safetensors header / run-config parsing
  libpcre2-dev                            # regex of Hugging Face tokenizer.json pre-tokenizers
  libicu-dev                              # Unicode normalizers (NFC...) of Hugging Face tokenizer.json
  gnuplot-nox                             # origami plan --plot (its pngcairo terminal)
  libgtest-dev                            # unit tests
  python3 python3-torch python3-numpy python3-pip   # PyTorch oracle for tests/reference (Debian's 1.13)
  fortunes fortunes-min                   # the demo corpus: public-domain text, %-separated documents
  time                                    # /usr/bin/time: peak RSS per rank in tests/parallel/test_run_safety.py
)

# `setup.sh --fuzz` (scripts/fuzz_libfuzzer.sh): also clang 16 with its libFuzzer/sanitizer runtimes, for
# the libFuzzer targets of tests/fuzz (nothing else needs them; Debian 12's default clang 14 cannot compile
# origami's C++20).
if [ "${1:-}" = "--fuzz" ]; then
  debian_packages+=(clang-16 libclang-rt-16-dev)
fi

missing=()
for p in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Test-only Python packages (PyPI), installed for Debian's python3 next to its torch 1.13:
# Hugging Face transformers/tokenizers/safetensors check our checkpoints and BPE encodings.
PY=/usr/bin/python3
# lizard: the test command's check that no function is over 120 lines or complexity 50.
# tensorboard: its own reader checks the event files of `origami train --tensorboard`.
# Their dependencies are pinned too (scripts/pip-constraints.txt).
imports="import transformers, tokenizers, safetensors, lizard, tensorboard"
if ! $PY -c "$imports" 2>/dev/null; then
  echo "setup: installing test-only Python packages from PyPI"
  $PY -m pip install -q --break-system-packages --no-warn-script-location -c "$(dirname "$0")/pip-constraints.txt" \
    "transformers==4.46.3" "tokenizers==0.20.3" "safetensors==0.4.5" "lizard==1.17.31" "tensorboard==2.18.0"
  $PY -c "$imports"  # (installed but broken: the import error is shown here, and setup fails)
fi
echo "setup: ok"
