#!/usr/bin/env bash
# One command on the H200 (device tool): build the CUDA backend for sm_90a, run the GPU tests
# and the benchmarks, leave logs and results under $OUT. Usage from the dev machine:
#   scripts/fetch_cutlass.sh
#   run(command="DSV4_COMMIT=$(git rev-parse --short HEAD) scripts/h200/run.sh [tests|bench|all|cli] [filter]",
#       carry=[".carry"])   (after scripts/h200/pack.sh)
# depth [bench [args] | tests]: only e2e_depth_bench (V4-Flash and V4-Pro; $OUT/depth.md) or
#   real_shapes_test (issue 14).
# cli: builds the dsv4 CLI (build-cli/) and runs the README's GPU commands on make-tiny checkpoints.
# verify-real [flash|pro|flash8k|all]: issue 14 point 7 -- `dsv4 generate --backend cuda --verify`
#   (every op against its CPU op, within its bound) at the REAL V4 geometry: random weights from
#   tests/data/deepseek-v4-{flash,pro}.config.json, Flash's first 4 layers (SWA-hash x2,
#   CSA-hash, HCA: every attention kind, hash- and score-routed MoE), Pro's first 4 (HCA-hash x2,
#   CSA-hash, HCA; 5 would need ~78 GiB of GPU memory), all 256 / 384 routed experts with
#   --repeat-experts (one fp32 copy a block on the host), a 2048-token prompt and 4 decode
#   steps; flash8k: the first 3 layers (to the first CSA layer) at 8192 tokens. Identical
#   experts would hide an expert-index mix-up on the GPU; routing, grouping and every expert's
#   tiles still run. The checks run on the host's cores (16 on the H200 machine), one case per
#   call, each sized to fit one: flash checks every block (blocks 2-3 alone took 225 s with
#   loading at stop 28; all four not timed yet), pro only block 2, its CSA layer (341 s;
#   VERIFY_BLOCKS=3-3, its HCA block, took 414 s after an 81 s build at stop 30, once the
#   host's bounds ran on row tiles; VERIFY_BLOCKS=0-0 434 s at stop 31), flash8k only block 2
#   (478 s). Flash's first score-routed CSA block: VERIFY_LAYERS=5 VERIFY_BLOCKS=4-4 (206 s).
#   VERIFY_LAYERS / VERIFY_TOKENS override a case's layers / prompt length, VERIFY_BLOCKS=A-B its
#   checked blocks (--verify-layers; the embedding and head always). verify prints its progress
#   and host seconds per op kind every 20 s. Logs: $OUT/verify-real-*.log;
#   bench/results/verify-real-h200.md holds what ran.
# serve (after `scripts/h200/pack.sh serve`): builds dsv4 with the CUDA backend and the server
#   (build-serve/) and runs the server suite (tests/server/) against `dsv4 serve --backend cuda`;
#   [filter] is a pytest -k expression. Logs: $OUT/server-tests.log, $OUT/server-junit.xml.
# serve-bench (after `scripts/h200/pack.sh serve`): the serving benchmark (bench/serve/sweep.py) at
#   V4-Flash shapes cut to [filter] layers (default 8): JSON lines in $OUT/serve-bench.jsonl, the
#   table in $OUT/serve-bench.md. $SWEEP_ARGS: more sweep.py flags (scripts/h200/multi.sh: random
#   weights at full depth over several GPUs).
# scripts/h200/steps.sh: one call of named steps (only the targets, tests and benchmarks named),
#   for short lends.
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
OUT="${OUT:-/tmp/dsv4-h200}"
mkdir -p "$OUT"
WHAT="${1:-all}"
FILTER="${2:-}"
export DSV4_COMMIT="${DSV4_COMMIT:-unknown}"
# What scripts/h200/pack.sh carried: CUTLASS headers, and a golden set for the GPU golden tests.
if [ -f .carry/cutlass.tar.xz ] && [ ! -f .cutlass/include/cutlass/version.h ]; then
  mkdir -p .cutlass && tar -xJf .carry/cutlass.tar.xz -C .cutlass
fi
for g in .carry/golden-*.tar .carry/golden-*.tar.xz; do
  [ -f "$g" ] || continue
  mkdir -p .golden && tar -xf "$g" -C .golden && export DSV4_GOLDEN_DIR="$PWD/.golden"
done
setup_pcre2() {
  # The tokenizer needs PCRE2: the carried header, the image's libpcre2-8.so.0.
  P="$PWD/.carry/pcre2"
  [ -f "$P/include/pcre2.h" ] || { echo "no .carry/pcre2/include/pcre2.h (scripts/h200/pack.sh)"; return 1; }
  mkdir -p "$P/lib" "$P/pkgconfig"
  ln -sf /usr/lib/x86_64-linux-gnu/libpcre2-8.so.0 "$P/lib/libpcre2-8.so"
  printf 'includedir=%s/include\nlibdir=%s/lib\nName: libpcre2-8\nVersion: 10\nDescription: carried header\nLibs: -L${libdir} -lpcre2-8\nCflags: -I${includedir}\n' "$P" "$P" > "$P/pkgconfig/libpcre2-8.pc"
  export PKG_CONFIG_PATH="$P/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
}
# What `pack.sh serve` carried, unpacked under /tmp/dsv4-serve: Debian's cpp-httplib (its
# header, its library and the headers of its build flags; the Debian copies of libssl/libz/
# libbrotli only where the image lacks the soname), the tokenizer, and the test client's wheels
# installed into a private site directory (no registry is reached).
setup_serve() {
  S=/tmp/dsv4-serve
  [ -f .carry/serve.tar.xz ] && [ -d .carry/wheels ] || { echo "no .carry/serve.tar.xz or .carry/wheels (scripts/h200/pack.sh serve)"; return 1; }
  rm -rf "$S" && mkdir -p "$S" && tar -xJf .carry/serve.tar.xz -C "$S" || return 1
  H="$S/httplib"
  ln -sf "$(ls "$H"/lib/libcpp-httplib.so.* | head -1)" "$H/lib/libcpp-httplib.so"
  for so in libssl.so.3 libcrypto.so.3 libz.so.1 libbrotlicommon.so.1 libbrotlidec.so.1 libbrotlienc.so.1; do
    if ! ldconfig -p | grep -q "^[[:space:]]*$so "; then
      echo "the image has no $so: using Debian's (carried)"
      ln -sf "$H/fallback/$so" "$H/lib/$so"
    fi
  done
  mkdir -p "$H/pkgconfig"
  printf 'Name: cpp-httplib\nVersion: 0.11.4\nDescription: Debian libcpp-httplib-dev, carried\nLibs: -L%s/lib -lcpp-httplib -Wl,-rpath-link,%s/lib -Wl,-rpath,%s/lib\nCflags: -I%s/include -DCPPHTTPLIB_OPENSSL_SUPPORT -DCPPHTTPLIB_ZLIB_SUPPORT -DCPPHTTPLIB_BROTLI_SUPPORT\n' \
    "$H" "$H" "$H" "$H" > "$H/pkgconfig/cpp-httplib.pc"
  export PKG_CONFIG_PATH="$H/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export LD_LIBRARY_PATH="$H/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export DSV4_TOKENIZER_DIR="$S/tokenizer"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$S/site" .carry/wheels/*.whl > "$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; return 1; }
  export PYTHONPATH="$S/site${PYTHONPATH:+:$PYTHONPATH}"
  # The image's own pytest plugins (xdist, timeout, cov, ...) were built for its pytest.
  export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
}
if [ "$WHAT" = "serve" ] || [ "$WHAT" = "serve-bench" ]; then
  setup_pcre2 && setup_serve || exit 1
  t0=$(date +%s)
  cmake -S . -B build-serve -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DBUILD_TESTING=OFF -DDSV4_BENCH=OFF -DDSV4_SERVER=ON > "$OUT/serve-configure.log" 2>&1 || { tail -30 "$OUT/serve-configure.log"; exit 1; }
  cmake --build build-serve -j "$(nproc)" --target dsv4 engine_loop_bench > "$OUT/serve-build.log" 2>&1 || { grep -E "error|Error" "$OUT/serve-build.log" | head -30; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  export DSV4_CLI="$PWD/build-serve/tools/dsv4"
  if [ "$WHAT" = "serve" ]; then
    # One backend: CUDA (the CPU suite runs in CI). The suite gets what is left of the device
    # tool's 600 s after the build (a cut-short run names the tests it finished in its log; run
    # the same command again while the machine is warm: the build is then a no-op).
    left=$(( ${DSV4_RUN_LIMIT_S:-585} - ($(date +%s) - START) ))
    [ "$left" -gt 60 ] || { echo "only ${left} s left after the build: run the same command again (warm machine)"; exit 1; }
    echo "server suite: ${left} s left"
    DSV4_TEST_BACKEND=cuda PYTHONUNBUFFERED=1 timeout "$left" python3 tests/server/run.py -v --durations=15 \
      --junitxml="$OUT/server-junit.xml" ${FILTER:+-k "$FILTER"} 2>&1 | tee "$OUT/server-tests.log" | grep -vE "PASSED|^$"
    exit "${PIPESTATUS[0]}"
  fi
  # [filter]: the number of layers (default 8: what fits the run's time, not the GPU's memory).
  PYTHONUNBUFFERED=1 python3 bench/serve/sweep.py --cli "$DSV4_CLI" \
    --engine-bench "$PWD/build-serve/bench/serve/engine_loop_bench" --out "$OUT" \
    --layers "${FILTER:-8}" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/serve-bench.log" | grep -vE "^\{"
  exit "${PIPESTATUS[0]}"
fi
if [ "$WHAT" = "cli" ]; then
  setup_pcre2 || exit 1
  cmake -S . -B build-cli -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DBUILD_TESTING=OFF -DDSV4_BENCH=OFF -DDSV4_SERVER=OFF > "$OUT/cli-configure.log" 2>&1 || { tail -20 "$OUT/cli-configure.log"; exit 1; }
  cmake --build build-cli -j "$(nproc)" --target dsv4 > "$OUT/cli-build.log" 2>&1 || { grep -E "error" "$OUT/cli-build.log" | head -20; exit 1; }
  rc=0
  for p in flash pro; do
    D="/tmp/dsv4-tiny-$p"
    build-cli/tools/dsv4 make-tiny --preset $p --format nvfp4 --seed 1 --out "$D" --force > /dev/null || rc=1
    for flags in "--backend cpu" "--backend cuda" "--backend cuda --verify" "--backend cuda --exact-linears --verify"; do
      echo "$ dsv4 generate --model $D --prompt-ids 0,17,42,99 --max-new-tokens 8 $flags"
      out=$(build-cli/tools/dsv4 generate --model "$D" --prompt-ids 0,17,42,99 --max-new-tokens 8 $flags 2>&1) || rc=1
      echo "$out" | tail -3
    done
  done
  exit $rc
fi
if [ "$WHAT" = "verify-real" ]; then
  setup_pcre2 || exit 1
  cmake -S . -B build-cli -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DBUILD_TESTING=OFF -DDSV4_BENCH=OFF -DDSV4_SERVER=OFF > "$OUT/cli-configure.log" 2>&1 || { tail -20 "$OUT/cli-configure.log"; exit 1; }
  cmake --build build-cli -j "$(nproc)" --target dsv4 > "$OUT/cli-build.log" 2>&1 || { grep -E "error" "$OUT/cli-build.log" | head -20; exit 1; }
  echo "build: $(( $(date +%s) - START )) s"
  for n in 2048 8192; do
    python3 -c "print(','.join(str(10 + (i * 7919) % 120000) for i in range($n)))" > "/tmp/dsv4-prompt-$n.txt"
  done
  rc=0
  run_case() {  # name layers tokens config format [blocks]
    set -- "$1" "${VERIFY_LAYERS:-$2}" "${VERIFY_TOKENS:-$3}" "$4" "$5" "${VERIFY_BLOCKS:-${6:-}}"
    [ -f "/tmp/dsv4-prompt-$3.txt" ] ||
      python3 -c "print(','.join(str(10 + (i * 7919) % 120000) for i in range($3)))" > "/tmp/dsv4-prompt-$3.txt"
    local left=$(( ${DSV4_RUN_LIMIT_S:-585} - ($(date +%s) - START) - 10 ))
    [ "$left" -gt 30 ] || { echo "$1: no time left"; rc=1; return; }
    local t0=$(date +%s)
    timeout "$left" build-cli/tools/dsv4 generate --random-weights "tests/data/deepseek-v4-$4.config.json" \
      --format "$5" --layers "$2" --repeat-experts --prompt-file "/tmp/dsv4-prompt-$3.txt" \
      --max-new-tokens 4 --ignore-eos --backend cuda --verify ${6:+--verify-layers "$6"} \
      > "$OUT/verify-real-$1.log" 2>&1
    local r=$?
    [ "$r" = 0 ] || rc=1
    echo "$1 ($4, $2 layers, $3 tokens, $5, blocks ${6:-all} checked): rc $r in $(( $(date +%s) - t0 )) s"
    tail -3 "$OUT/verify-real-$1.log"
  }
  case "${FILTER:-all}" in
    flash) run_case flash 4 2048 flash nvfp4 ;;
    pro) run_case pro 4 2048 pro nvfp4 2-2 ;;
    flash8k) run_case flash8k 3 8192 flash mxfp4 2-2 ;;
    # Each case takes most of a call: all three need DSV4_RUN_LIMIT_S beyond the device tool's.
    all) run_case flash 4 2048 flash nvfp4; run_case pro 4 2048 pro nvfp4 2-2; run_case flash8k 3 8192 flash mxfp4 2-2 ;;
    *) echo "verify-real: unknown case '$FILTER' (flash, pro, flash8k, all)"; exit 2 ;;
  esac
  exit $rc
fi
if [ "$WHAT" = "depth" ]; then
  # Issue 14: only e2e_depth_bench and real_shapes_test (and the library they link).
  #   depth bench [args]: V4-Flash then V4-Pro (NVFP4; [args], e.g. --quick, go to both runs),
  #                       JSON lines in $OUT/depth.jsonl, tables in $OUT/depth.md, logs per model.
  #   depth tests:        real_shapes_test (the real-shape MoE and FP8 GEMM tests).
  cmake -S . -B build-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DBUILD_TESTING=ON -DDSV4_GPU_ONLY=ON -DDSV4_BENCH=ON > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
  t0=$(date +%s)
  cmake --build build-h200 -j "$(nproc)" --target e2e_depth_bench real_shapes_test > "$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  rc=0
  SUB="${FILTER:-bench}"
  if [ "$SUB" = "tests" ]; then
    build-h200/tests/real_shapes_test --gtest_color=no 2>&1 | tee "$OUT/real_shapes_test.log" | grep -E "^\[|^  [a-zA-Z]" | tail -60
    rc=${PIPESTATUS[0]}
    [ "$rc" = 77 ] && rc=0
  else
    export DSV4_BENCH_OUT="$OUT/depth.jsonl"
    shift 2 2>/dev/null || shift $#
    for m in flash pro; do
      t0=$(date +%s)
      timeout 280 build-h200/bench/e2e_depth_bench "$m" nvfp4 "$@" > /dev/null 2> "$OUT/depth-$m.log" || { rc=1; echo "e2e_depth_bench $m failed: $(tail -3 "$OUT/depth-$m.log")"; }
      echo "e2e_depth_bench $m: $(( $(date +%s) - t0 )) s"; grep -E "layers \+ MTP|done in|WARNING" "$OUT/depth-$m.log"
    done
    python3 scripts/e2e_depth_report.py "$OUT/depth.jsonl" > "$OUT/depth.md" && grep -A12 "^### Decode step" "$OUT/depth.md"
  fi
  exit $rc
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nvcc --version | tail -1; } > "$OUT/gpu.txt" 2>&1
cmake -S . -B build-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DBUILD_TESTING=ON -DDSV4_GPU_ONLY=ON -DDSV4_BENCH=ON > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
# Only what runs here: the GPU tests and the benchmarks (and the library they link).
targets=$(ls tests/cuda/*_test.cpp tests/cuda/*_test.cu bench/cuda/*_bench.cu bench/cuda/*_bench.cpp 2>/dev/null |
          xargs -n1 basename | sed 's/\.[^.]*$//' | tr '\n' ' ')
if ! cmake --build build-h200 -j "$(nproc)" --target $targets > "$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40
  exit 1
fi
grep -E "spill|stack frame" "$OUT/build.log" | grep -v " 0 bytes spill stores, 0 bytes spill loads" | grep -v "0 bytes stack frame" > "$OUT/ptxas-warnings.txt" || true
rc=0
if [ "$WHAT" = "tests" ] || [ "$WHAT" = "all" ]; then
  ctest --test-dir build-h200 -L gpu -j "$(nproc)" --timeout 420 --output-on-failure ${FILTER:+-R "$FILTER"} 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [ "$WHAT" = "bench" ] || [ "$WHAT" = "all" ]; then
  export DSV4_BENCH_OUT="$OUT/bench.jsonl"
  for b in build-h200/bench/*_bench; do
    [ -n "$FILTER" ] && [[ "$b" != *"$FILTER"* ]] && continue
    echo "== $b"
    timeout 300 "$b" > "$OUT/$(basename "$b").log" 2>&1 || echo "$b failed: $(tail -3 "$OUT/$(basename "$b").log")"
  done
fi
exit $rc
