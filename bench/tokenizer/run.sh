#!/usr/bin/env bash
# Builds and runs the tokenizer benchmark: dsv4 vs HF tokenizers (python3 -m pip install
# tokenizers), single thread, on the ~6 MB test corpus; writes bench/results/tokenizer.md.
#   bench/tokenizer/run.sh [BUILD_DIR (default build)] [tokenizer_bench flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD="${1:-build}"
shift || true
cmake --build "$BUILD" --target tokenizer_bench
"$BUILD/bench/tokenizer/tokenizer_bench" --out bench/results/tokenizer.md "$@"
cat bench/results/tokenizer.md
