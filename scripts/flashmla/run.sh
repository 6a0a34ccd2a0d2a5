#!/usr/bin/env bash
# On the H200: our sparse decode beside FlashMLA's sm90 sparse FP8 decode, in one process, on
# the same cache pages (bench/flashmla/flashmla_side_by_side.cu). Needs what
# scripts/flashmla/pack.sh and scripts/h200/pack.sh put in .carry/. Usage:
#   run(command="scripts/flashmla/run.sh [--quick]", carry=[".carry"])
# Output: $OUT/flashmla_side_by_side.log and $OUT/flashmla.jsonl (one line per shape: ours as
# us, FlashMLA's as peer_us, the outputs' relative L2 in the shape).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/dsv4-h200}"
mkdir -p "$OUT"
if [ -f .carry/cutlass.tar.xz ] && [ ! -f .cutlass/include/cutlass/version.h ]; then
  mkdir -p .cutlass && tar -xJf .carry/cutlass.tar.xz -C .cutlass
fi
[ -f .carry/flashmla/flashmla-src.tar.xz ] || { echo "no .carry/flashmla/flashmla-src.tar.xz (scripts/flashmla/pack.sh)"; exit 1; }
FM="$PWD/build-flashmla/src"
rm -rf build-flashmla && mkdir -p "$FM" build-flashmla/obj
tar -xJf .carry/flashmla/flashmla-src.tar.xz -C "$FM"
echo "FlashMLA $(cat "$FM/COMMIT")"
# FlashMLA's own nvcc flags (its setup.py), sm_90a only.
FLAGS=(-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -Wno-deprecated-declarations
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
  -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda
  --use_fast_math -gencode arch=compute_90a,code=sm_90a
  -I"$FM/csrc" -I"$FM/csrc/kerutils/include" -I"$FM/csrc/sm90" -I"$PWD/.cutlass/include")
SRCS=(smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu smxx/decode/combine/combine.cu
  sm90/decode/sparse_fp8/instantiations/model1_persistent_h64.cu
  sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu)
# FlashMLA's four sources in the background while this tree's library builds.
pids=()
for s in "${SRCS[@]}"; do
  o="build-flashmla/obj/$(basename "$s" .cu).o"
  nvcc "${FLAGS[@]}" -c "$FM/csrc/$s" -o "$o" > "$o.log" 2>&1 &
  pids+=($!)
done
cmake -S . -B build-h200 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DBUILD_TESTING=ON -DDSV4_GPU_ONLY=ON -DDSV4_BENCH=ON \
  -DDSV4_FLASHMLA_DIR="$FM" -DDSV4_FLASHMLA_LIB="$PWD/build-flashmla/libflashmla_sm90.a" \
  > "$OUT/flashmla-configure.log" 2>&1 || { tail -30 "$OUT/flashmla-configure.log"; exit 1; }
cmake --build build-h200 -j "$(nproc)" --target dsv4_backend_cuda > "$OUT/flashmla-build.log" 2>&1 ||
  { grep -E "error" "$OUT/flashmla-build.log" | head -30; exit 1; }
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "FlashMLA ${SRCS[$i]} failed:"; tail -20 "build-flashmla/obj/$(basename "${SRCS[$i]}" .cu).o.log"; exit 1; }
done
ar rcs build-flashmla/libflashmla_sm90.a build-flashmla/obj/*.o
cmake --build build-h200 -j "$(nproc)" --target flashmla_side_by_side >> "$OUT/flashmla-build.log" 2>&1 ||
  { grep -E "error" "$OUT/flashmla-build.log" | head -30; exit 1; }
DSV4_BENCH_OUT="$OUT/flashmla.jsonl" timeout 400 build-h200/bench/flashmla_side_by_side "$@" \
  2>&1 | tee "$OUT/flashmla_side_by_side.log"
