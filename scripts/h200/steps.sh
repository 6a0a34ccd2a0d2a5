#!/usr/bin/env bash
# One device call made of named steps, for short lends: build only the targets named, run named
# test binaries with gtest filters, the depth benchmark, the MoE / mHC / wo_a benchmarks. Usage
# (after scripts/h200/pack.sh):
#   run(command="STEPS='build tests depth' TARGETS='mhc_test e2e_depth_bench' \
#        TESTS='mhc_test:*Split* gemm_test:*ActQuant*' DSV4_COMMIT=$(git rev-parse --short HEAD) \
#        scripts/h200/steps.sh", carry=[".carry"])
# Steps: build (configure build-h200 once; TARGETS), tests (TESTS: binary[:filter] ...,
# TEST_TIMEOUT s each), depth (e2e_depth_bench flash nvfp4 --quick --layers 8 DEPTH_ARGS; the
# step times and a CSA layer's prefill kernels printed), moe (moe_bench MOE_ARGS), mhc (mhc_bench
# --tokens MHC_TOKENS), woa (attn_output_bench's tensor-core rows), prefill_moe (the 8K prefill
# with each MoE kernel of MOE_TILED, default 'auto tiled ws128 ws256'). JSON lines land in $OUT (one
# file a step: the device tool returns a limited number of files). Keep the machine warm between
# calls: it is released after ~30 s idle, and a new one starts from an empty build tree.
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
OUT="${OUT:-/tmp/dsv4-steps}"
mkdir -p "$OUT"
export DSV4_COMMIT="${DSV4_COMMIT:-unknown}"
el() { echo "[$(($(date +%s) - T0)) s] $*"; }
if [ -f .carry/cutlass.tar.xz ] && [ ! -f .cutlass/include/cutlass/version.h ]; then
  mkdir -p .cutlass && tar -xJf .carry/cutlass.tar.xz -C .cutlass
fi
summary() {  # kernel, shape (shortened), us of the JSON lines on stdin
  python3 -c 'import sys, json
for l in sys.stdin:
    r = json.loads(l)
    print("  ", r["kernel"], "|", r["shape"][:70], "|", r["us"])'
}
for s in ${STEPS:-build}; do
  case $s in
    build)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
      if [ ! -f build-h200/build.ninja ]; then
        cmake -S . -B build-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
          -DCMAKE_CUDA_ARCHITECTURES=90a -DBUILD_TESTING=ON -DDSV4_GPU_ONLY=ON -DDSV4_BENCH=ON \
          > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
      fi
      cmake --build build-h200 -j "$(nproc)" --target ${TARGETS:?TARGETS names the targets} \
        > "$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; }
      el "build done" ;;
    tests)
      for tf in ${TESTS:?TESTS names binary[:filter] ...}; do
        b=${tf%%:*}; f=${tf#*:}; [ "$f" = "$tf" ] && f='*'
        timeout "${TEST_TIMEOUT:-300}" "build-h200/tests/$b" --gtest_color=no --gtest_filter="$f" \
          > "$OUT/$b.log" 2>&1
        r=$?
        el "$b ($f): rc $r: $(grep -E '^\[  PASSED|^\[  FAILED|^\[  SKIPPED' "$OUT/$b.log" | tr '\n' ' ')"
        grep -E "^\[  FAILED|Failure" "$OUT/$b.log" | head -8
      done ;;
    depth)
      DSV4_BENCH_OUT="$OUT/depth.jsonl" timeout "${DEPTH_TIMEOUT:-330}" build-h200/bench/e2e_depth_bench \
        flash nvfp4 --quick --layers 8 ${DEPTH_ARGS:---batches 1 --contexts 4096} > /dev/null 2> "$OUT/depth.log"
      el "depth rc $?"
      grep -E '"e2e_depth_(step_extrapolated|prefill_extrapolated|prefill_kind)"' "$OUT/depth.jsonl" | summary
      grep '"e2e_depth_kernel"' "$OUT/depth.jsonl" | grep ' CSA prefill ' | summary ;;
    prefill_moe)
      # The 8K prefill with each MoE kernel of the tiled path (e2e_depth_bench --moe-tiled).
      for v in ${MOE_TILED:-auto tiled ws128 ws256}; do
        DSV4_BENCH_OUT="$OUT/prefill_moe.jsonl" timeout "${DEPTH_TIMEOUT:-330}" \
          build-h200/bench/e2e_depth_bench flash nvfp4 --quick --layers 8 --batches 1 \
          --contexts 4096 --moe-tiled "$v" > /dev/null 2>> "$OUT/prefill_moe.log"
        el "prefill --moe-tiled $v: rc $?"
      done
      grep -E '"e2e_depth_prefill_extrapolated"' "$OUT/prefill_moe.jsonl" | summary
      grep '"e2e_depth_kernel"' "$OUT/prefill_moe.jsonl" | grep ' CSA prefill ' | grep moe_gemm | summary ;;
    moe)
      DSV4_BENCH_OUT="$OUT/moe.jsonl" timeout 300 build-h200/bench/moe_bench ${MOE_ARGS:-flash nvfp4 m4096 m8192} \
        > "$OUT/moe.log" 2>&1
      el "moe_bench rc $?"
      grep -E '"moe_(layer|stage_gateup|stage_down|experts_tiled|gemm_gateup_tiled|gemm_down_tiled)' "$OUT/moe.jsonl" | summary ;;
    mhc)
      DSV4_BENCH_OUT="$OUT/mhc.jsonl" timeout 300 build-h200/bench/mhc_bench --model all \
        --tokens "${MHC_TOKENS:-128,1024,8192}" > "$OUT/mhc.log" 2>&1
      el "mhc_bench rc $?"
      grep '\[split\]' "$OUT/mhc.jsonl" | summary ;;
    woa)
      DSV4_BENCH_OUT="$OUT/woa.jsonl" timeout 300 build-h200/bench/attn_output_bench > "$OUT/woa.log" 2>&1
      el "attn_output_bench rc $?"
      grep '"wo_a tensor-core"' "$OUT/woa.jsonl" | summary ;;
    *) echo "steps.sh: unknown step '$s'"; exit 2 ;;
  esac
done
el "all done"
