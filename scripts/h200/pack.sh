#!/usr/bin/env bash
# Packs what the H200 run needs and its image lacks into .carry/ (git-ignored), small enough for
# the device tool's 64 MiB: the CUTLASS headers (xz) and, optionally, one golden set in one
# checkpoint format. Then: run(command="scripts/h200/run.sh ...", carry=[".carry"]).
#   scripts/h200/pack.sh                      # CUTLASS only
#   scripts/h200/pack.sh tiny-flash nvfp4     # plus ../shared/golden/tiny-flash with hf-nvfp4
#   scripts/h200/pack.sh tiny-flash nvfp4 mxfp4   # both formats (~46 MB xz; one set per run)
#   scripts/h200/pack.sh serve                # plus what `run.sh serve|serve-bench` needs (~14 MB)
# serve: cpp-httplib as Debian packages it, the real tokenizer and the Python test client's
# wheels (openai, pytest and their dependencies for CPython 3.12 manylinux x86_64, one version
# each); it needs pip's network access here, not there.
set -euo pipefail
cd "$(dirname "$0")/../.."
SERVE=0
if [ "${1:-}" = "serve" ]; then SERVE=1; shift; fi
scripts/fetch_cutlass.sh
mkdir -p .carry
rm -f .carry/*.tar .carry/*.tar.xz
rm -rf .carry/wheels
tar -cJf .carry/cutlass.tar.xz -C .cutlass include VERSION
# PCRE2's header for the CLI (`run.sh cli`): the H200 image has the runtime library only.
if [ -f /usr/include/pcre2.h ]; then mkdir -p .carry/pcre2/include && cp /usr/include/pcre2.h .carry/pcre2/include/; fi
if [ "$SERVE" = 1 ]; then
  # Debian splits cpp-httplib: /usr/include/httplib.h declares, libcpp-httplib.so (built with
  # OpenSSL, zlib and Brotli support) defines, so the header alone does not link. It carries the
  # header, the library and the headers its pkg-config flags need (the CPPHTTPLIB_*_SUPPORT
  # macros change class layouts, so they must match the library's build); the image is Ubuntu
  # 24.04, whose libssl.so.3 / libz.so.1 / libbrotli*.so.1 share these sonames: run.sh links the
  # carried Debian copies only where the image lacks one.
  lib=/usr/lib/x86_64-linux-gnu
  [ -f /usr/include/httplib.h ] && [ -f "$lib/libcpp-httplib.so" ] ||
    { echo "pack.sh serve: install libcpp-httplib-dev (scripts/setup.sh)" >&2; exit 1; }
  for h in /usr/include/openssl/ssl.h /usr/include/zlib.h /usr/include/brotli/decode.h; do
    [ -f "$h" ] || { echo "pack.sh serve: $h is missing (libssl-dev, zlib1g-dev, libbrotli-dev)" >&2; exit 1; }
  done
  t="$(mktemp -d)"
  mkdir -p "$t/httplib/include" "$t/httplib/lib" "$t/httplib/fallback"
  cp /usr/include/httplib.h /usr/include/zlib.h /usr/include/zconf.h "$t/httplib/include/"
  cp -r /usr/include/openssl /usr/include/brotli "$t/httplib/include/"
  cp /usr/include/x86_64-linux-gnu/openssl/*.h "$t/httplib/include/openssl/"
  soname=$(objdump -p "$lib/libcpp-httplib.so" | awk '/SONAME/ {print $2}')
  cp -L "$lib/libcpp-httplib.so" "$t/httplib/lib/$soname"  # the name the loader looks for
  for so in libssl.so.3 libcrypto.so.3 libz.so.1 libbrotlicommon.so.1 libbrotlidec.so.1 libbrotlienc.so.1; do
    cp -L "$lib/$so" "$t/httplib/fallback/$so"
  done
  dpkg-query -W -f '${Package} ${Version}\n' libcpp-httplib-dev libssl-dev zlib1g-dev libbrotli-dev \
    > "$t/httplib/VERSIONS" 2>/dev/null || true
  mkdir -p "$t/tokenizer"
  cp "${DSV4_TOKENIZER_DIR:-../shared/tokenizer/deepseek-v4}/tokenizer.json" "$t/tokenizer/"
  tar -cJf .carry/serve.tar.xz -C "$t" httplib tokenizer
  rm -rf "$t"
  # The versions CI's set-up installs today; pip resolves their dependencies for the image's
  # Python (3.12) and keeps one version of each.
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .carry/wheels "openai==${DSV4_OPENAI_VERSION:-3.57.0}" "pytest==${DSV4_PYTEST_VERSION:-9.2.0}"
fi
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
echo "total: $(du -sh .carry | cut -f1) (the device tool carries at most 64 MiB with the working tree)"
