#!/usr/bin/env bash
# Fails when a tracked C++/CUDA source differs from what clang-format (.clang-format) makes of it.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.h' '*.hpp' '*.cpp' '*.cc' '*.cu' '*.cuh' 2>/dev/null || true)
[ -n "$files" ] || { echo "no sources (not a git checkout?)"; exit 0; }
echo "$files" | xargs clang-format --dry-run --Werror
echo "clang-format: $(echo "$files" | wc -l) files conform"
