#!/usr/bin/env bash
# Installs everything dsv4 needs on a fresh Debian machine (Debian packages and PyPI only)
# and builds it three times: build/ (CUDA targets too when nvcc is found), build-asan/ (CPU
# only, AddressSanitizer + UndefinedBehaviorSanitizer) and build-fuzz/ (the libFuzzer targets
# only, clang), whose tests build/'s CTest runs as well.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
if command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends \
    build-essential cmake ninja-build pkg-config git \
    libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libpcre2-dev \
    clang-format python3 python3-pip >/dev/null
  # libssl-dev: SHA-256 in the tokenizer tests. clang + libclang-rt-dev: libFuzzer (tests/fuzz).
  # libcpp-httplib-dev: the server's HTTP library.
  $SUDO apt-get install -y -qq --no-install-recommends libssl-dev clang libclang-rt-dev \
    libcpp-httplib-dev >/dev/null
fi

# HF tokenizers, the tokenizer tests' oracle and benchmark reference (PyPI). Optional: without
# it tokenizer_oracle_test skips and says why; the stored expectations are still checked.
if ! python3 -c 'import tokenizers' >/dev/null 2>&1; then
  python3 -m pip install --quiet tokenizers >/dev/null 2>&1 ||
    python3 -m pip install --quiet --break-system-packages tokenizers >/dev/null 2>&1 ||
    echo "dsv4: could not install the Python package tokenizers; tokenizer_oracle_test will skip" >&2
fi

# The official openai client and pytest, for the server suite (server_test skips, saying why,
# without them).
if ! python3 -c 'import openai, pytest' >/dev/null 2>&1; then
  python3 -m pip install --quiet openai pytest >/dev/null 2>&1 ||
    python3 -m pip install --quiet --break-system-packages openai pytest >/dev/null 2>&1 ||
    echo "dsv4: could not install the Python packages openai and pytest; server_test will skip" >&2
fi

# CUTLASS/CuTe headers for the CUDA backend, from PyPI (only where nvcc can use them), and
# NCCL for the parallel engine's device collectives (PyPI's nvidia-nccl-cu13 wheel).
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  scripts/fetch_cutlass.sh
  if ! python3 -c 'import nvidia.nccl' >/dev/null 2>&1; then
    python3 -m pip install --quiet nvidia-nccl-cu13 >/dev/null 2>&1 ||
      python3 -m pip install --quiet --break-system-packages nvidia-nccl-cu13 >/dev/null 2>&1 ||
      echo "dsv4: could not install nvidia-nccl-cu13; the NCCL communicator is not built" >&2
  fi
fi

JOBS="${DSV4_JOBS:-$(nproc)}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DDSV4_SANITIZER_BUILD_DIR="$PWD/build-asan" -DDSV4_FUZZ_BUILD_DIR="$PWD/build-fuzz"
cmake --build build -j "$JOBS"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_SANITIZE=ON
cmake --build build-asan -j "$JOBS"
# The fuzz targets: -O1 keeps the build short; the CI runs are seconds long anyway.
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DDSV4_FUZZ=ON
cmake --build build-fuzz -j "$JOBS" --target dsv4_fuzz
echo "dsv4: built build/, build-asan/ and build-fuzz/; run the tests with: ctest --test-dir build --output-on-failure -j 2"
