#!/usr/bin/env bash
# Issue 13's steps on a machine with several H200s (device tool kind nvidia-h200-x2, or more),
# one command each (the tool's 10 minutes), after `scripts/h200/pack.sh serve`:
#   run(command="DSV4_COMMIT=$(git rev-parse --short HEAD) scripts/h200/multi.sh tests",
#       carry=[".carry"], kind="nvidia-h200-x2")
#   run(command="DSV4_COMMIT=... scripts/h200/multi.sh serve-bench [LAYERS]", carry=[".carry"],
#       kind="nvidia-h200-x2")
#   run(command="DSV4_COMMIT=... scripts/h200/multi.sh depth [nvfp4|mxfp4 [ARGS]]", ...)
# tests: builds dsv4 and the GPU tests that need several GPUs (build-multi/) and runs them:
#   parallel_cuda_test (its NCCL tuples test: a GPU per rank), nccl_test, multinode_cuda_test
#   (one process with 2 GPUs, and 2 nodes of one GPU each). Logs: $OUT/multi-tests.log.
# serve-bench: the serving benchmark (bench/serve/sweep.py through run.sh serve-bench) against
#   `dsv4 serve --random-weights tests/data/deepseek-v4-flash.config.json --format nvfp4
#   --repeat-experts --dp G --ep G --backend cuda` on the G GPUs: V4-Flash at full depth (LAYERS,
#   default 0 = all 43 + MTP) with weights generated in memory (no checkpoint file), 8192 in /
#   1024 out, concurrency 1, 16, 64, 256; no engine-loop run (the minutes go to the levels).
#   $OUT/serve-bench.jsonl and serve-bench.md.
# depth [FMT [ARGS...]]: point 2, bench/cuda/parallel_step_bench over NCCL on the G GPUs (dp G,
#   ep G): V4-Flash at full depth with random weights in memory, decode at batch 1, 32, 128 with
#   4K and 64K contexts and prefill of 8192 tokens; time per step, tokens/s, rank 0's roofline
#   and each rank's communication share. FMT nvfp4 (default) or mxfp4; ARGS go to the bench
#   (e.g. --batches 128 --contexts 4096). $OUT/parallel-depth.jsonl, parallel-depth.log. Its
#   build (build-multi-bench/) may take most of a command: then run the same command again on
#   the warm machine.
set -uo pipefail
cd "$(dirname "$0")/../.."
# NVLink multicast off in every process this starts (the device documentation, KINDS.md: a
# program that uses it can put the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s)
OUT="${OUT:-/tmp/dsv4-h200}"
mkdir -p "$OUT"
WHAT="${1:-tests}"
export DSV4_COMMIT="${DSV4_COMMIT:-unknown}"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nvcc --version | tail -1; } > "$OUT/gpu.txt" 2>&1
[ "$GPUS" -ge 2 ] || { echo "multi.sh: needs at least 2 GPUs, found $GPUS (kind nvidia-h200-x2)"; exit 1; }
echo "multi.sh $WHAT: $GPUS GPUs, commit $DSV4_COMMIT"

if [ "$WHAT" = "serve-bench" ]; then
  # run.sh builds dsv4 with the server and runs the sweep; these flags make it random weights
  # over every GPU (--layers 0: full depth).
  SWEEP_ARGS="--random-weights --format nvfp4 --dp $GPUS --ep $GPUS --skip-engine-loop" \
    exec scripts/h200/run.sh serve-bench "${2:-0}"
fi
[ "$WHAT" = "tests" ] || [ "$WHAT" = "depth" ] ||
  { echo "multi.sh: unknown step '$WHAT' (tests, serve-bench, depth)"; exit 2; }

if [ -f .carry/cutlass.tar.xz ] && [ ! -f .cutlass/include/cutlass/version.h ]; then
  mkdir -p .cutlass && tar -xJf .carry/cutlass.tar.xz -C .cutlass
fi
# dsv4 (multinode_cuda_test runs it) needs the tokenizer's PCRE2: the carried header, the
# image's library (as run.sh cli).
P="$PWD/.carry/pcre2"
[ -f "$P/include/pcre2.h" ] || { echo "no .carry/pcre2/include/pcre2.h (scripts/h200/pack.sh)"; exit 1; }
mkdir -p "$P/lib" "$P/pkgconfig"
ln -sf /usr/lib/x86_64-linux-gnu/libpcre2-8.so.0 "$P/lib/libpcre2-8.so"
printf 'includedir=%s/include\nlibdir=%s/lib\nName: libpcre2-8\nVersion: 10\nDescription: carried header\nLibs: -L${libdir} -lpcre2-8\nCflags: -I${includedir}\n' "$P" "$P" > "$P/pkgconfig/libpcre2-8.pc"
export PKG_CONFIG_PATH="$P/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
# The server suite of multinode_cuda_test needs the tokenizer (skipped without it).
[ -f .carry/serve.tar.xz ] && mkdir -p /tmp/dsv4-serve && tar -xJf .carry/serve.tar.xz -C /tmp/dsv4-serve \
  && export DSV4_TOKENIZER_DIR=/tmp/dsv4-serve/tokenizer

if [ "$WHAT" = "depth" ]; then
  FMT="${2:-nvfp4}"
  shift $(( $# < 2 ? $# : 2 ))
  t0=$(date +%s)
  cmake -S . -B build-multi-bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DBUILD_TESTING=OFF -DDSV4_BENCH=ON -DDSV4_SERVER=OFF \
    > "$OUT/depth-configure.log" 2>&1 || { tail -30 "$OUT/depth-configure.log"; exit 1; }
  grep -q "DSV4_HAVE_NCCL:INTERNAL=ON" build-multi-bench/CMakeCache.txt || { echo "NCCL not found (nvidia-nccl-cu13 wheel)"; exit 1; }
  cmake --build build-multi-bench -j "$(nproc)" --target parallel_step_bench > "$OUT/depth-build.log" 2>&1 ||
    { grep -E "error|Error" "$OUT/depth-build.log" | head -40; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  left=$(( ${DSV4_RUN_LIMIT_S:-585} - ($(date +%s) - START) ))
  [ "$left" -gt 120 ] || { echo "only ${left} s left after the build: run the same command again (warm machine)"; exit 1; }
  echo "parallel_step_bench: ${left} s left"
  DSV4_BENCH_OUT="$OUT/parallel-depth.jsonl" timeout "$left" build-multi-bench/bench/parallel_step_bench \
    flash "$FMT" --dp "$GPUS" --ep "$GPUS" --comm nccl "$@" > /dev/null 2> "$OUT/parallel-depth.log"
  rc=$?
  tail -30 "$OUT/parallel-depth.log"
  exit "$rc"
fi

t0=$(date +%s)
cmake -S . -B build-multi -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DBUILD_TESTING=ON -DDSV4_BENCH=OFF -DDSV4_SERVER=OFF > "$OUT/multi-configure.log" 2>&1 || { tail -30 "$OUT/multi-configure.log"; exit 1; }
grep -q "DSV4_HAVE_NCCL:INTERNAL=ON" build-multi/CMakeCache.txt || { echo "NCCL not found (nvidia-nccl-cu13 wheel): nccl_test and multinode_cuda_test would not exist"; exit 1; }
cmake --build build-multi -j "$(nproc)" --target dsv4 parallel_cuda_test nccl_test > "$OUT/multi-build.log" 2>&1 || { grep -E "error|Error" "$OUT/multi-build.log" | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
left=$(( ${DSV4_RUN_LIMIT_S:-585} - ($(date +%s) - START) ))
[ "$left" -gt 60 ] || { echo "only ${left} s left after the build: run the same command again (warm machine)"; exit 1; }
echo "tests: ${left} s left"
# One at a time: each wants every GPU.
timeout "$left" ctest --test-dir build-multi -R "^(parallel_cuda_test|nccl_test|multinode_cuda_test)$" \
  --timeout 420 --output-on-failure 2>&1 | tee "$OUT/multi-tests.log" | tail -40
exit "${PIPESTATUS[0]}"
