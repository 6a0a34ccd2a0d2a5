#!/usr/bin/env bash
# Packs what the H200 run needs and its image lacks into .carry/ (git-ignored), small enough for
# the device tool's 64 MiB: the CUTLASS headers (xz) and, optionally, one golden set in one
# checkpoint format. Then: run(command="scripts/h200/run.sh ...", carry=[".carry"]).
#   scripts/h200/pack.sh                      # CUTLASS only
#   scripts/h200/pack.sh tiny-flash nvfp4     # plus ../shared/golden/tiny-flash with hf-nvfp4
#   scripts/h200/pack.sh tiny-flash nvfp4 mxfp4   # both formats (~46 MB xz; one set per run)
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/fetch_cutlass.sh
mkdir -p .carry
rm -f .carry/*.tar .carry/*.tar.xz
tar -cJf .carry/cutlass.tar.xz -C .cutlass include VERSION
# PCRE2's header for the CLI (`run.sh cli`): the H200 image has the runtime library only.
if [ -f /usr/include/pcre2.h ]; then mkdir -p .carry/pcre2/include && cp /usr/include/pcre2.h .carry/pcre2/include/; fi
if [ $# -ge 2 ]; then
  set_name="$1"; shift
  root="${DSV4_GOLDEN_DIR:-../shared/golden}"
  dirs=()
  for fmt in "$@"; do dirs+=("$set_name/hf-$fmt"); done
  # xz: the sets are mostly FP4/FP8 codes and still shrink ~20 %, which is what lets two
  # checkpoint formats of one set fit the carry limit.
  tar -cf - -C "$root" \
    "$set_name/golden_logits.safetensors" "$set_name/golden_layers.safetensors" \
    "$set_name/manifest.json" "$set_name/summary.json" "${dirs[@]}" |
    xz -T0 -6 > ".carry/golden-$set_name.tar.xz"
fi
du -sh .carry/*
