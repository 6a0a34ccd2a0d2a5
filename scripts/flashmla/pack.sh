#!/usr/bin/env bash
# Packs the FlashMLA sources the side-by-side benchmark needs (issue 17) into
# .carry/flashmla/flashmla-src.tar.xz (git-ignored; never committed): csrc/ without the sm100
# kernels and without its CUTLASS submodule (this tree's CUTLASS headers are used, see
# scripts/h200/pack.sh), plus its LICENSE and commit. Usage, on the dev machine:
#   fetch github:deepseek-ai/FlashMLA            (the session's fetch tool: a bare mirror)
#   scripts/flashmla/pack.sh [MIRROR_GIT_DIR]    (default /work/.mirror/deepseek-ai+FlashMLA/repo)
#   scripts/h200/pack.sh                          (CUTLASS), then on the H200:
#   run(command="scripts/flashmla/run.sh", carry=[".carry"])
set -euo pipefail
cd "$(dirname "$0")/../.."
MIRROR="${1:-/work/.mirror/deepseek-ai+FlashMLA/repo}"
[ -d "$MIRROR" ] || { echo "no FlashMLA mirror at $MIRROR (fetch github:deepseek-ai/FlashMLA)"; exit 1; }
mkdir -p .carry/flashmla
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
git --git-dir="$MIRROR" archive HEAD LICENSE csrc/params.h csrc/utils.h csrc/defines.h \
  csrc/kerutils csrc/sm90 csrc/smxx | tar -x -C "$TMP"
git --git-dir="$MIRROR" rev-parse HEAD > "$TMP/COMMIT"
tar -cJf .carry/flashmla/flashmla-src.tar.xz -C "$TMP" .
echo "FlashMLA $(cat "$TMP/COMMIT") -> .carry/flashmla/flashmla-src.tar.xz ($(du -h .carry/flashmla/flashmla-src.tar.xz | cut -f1))"
