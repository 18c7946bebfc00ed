#!/usr/bin/env bash
# GPU check of the MoE dispatch ops, for a machine with an NVIDIA Hopper GPU: runs
# test_cuda_moe_dispatch, compute-sanitizer memcheck on its small cases, and
# `fp8moe bench permute`; writes the logs to $OUT (default ./gpu_dispatch_out) and prints a short
# summary last.
#
#   FP8MOE_BIN=<dir> scripts/gpu_dispatch_check.sh   # <dir>/fp8moe and <dir>/test_cuda_moe_dispatch
#   scripts/gpu_dispatch_check.sh                    # configure + build them in build-gpu/ first
#   FP8MOE_ITERS=20 ...                              # timed runs per op in the benchmark
# Every step has a time limit, so a hung kernel shows up as a TIMEOUT row instead of a stuck run.
set -u
OUT=${OUT:-$PWD/gpu_dispatch_out}
mkdir -p "$OUT"
ITERS=${FP8MOE_ITERS:-30}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}

if [ -z "${FP8MOE_BIN:-}" ]; then
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j"$(nproc)" --target fp8moe_cli test_cuda_moe_dispatch >>"$OUT/build.log" 2>&1 ||
    { echo "build failed, see $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
  BIN_CLI=build-gpu/bin/fp8moe
  BIN_T=build-gpu/tests/cuda
else
  BIN_CLI=$FP8MOE_BIN/fp8moe
  BIN_T=$FP8MOE_BIN
fi

declare -a ROWS
step() {  # step <name> <seconds> <log> <cmd...>: runs, records "name | result | seconds"
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout --signal=KILL "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local st="ok"
  [ $rc -ne 0 ] && st="FAIL(rc=$rc)"
  [ $rc -eq 137 ] && st="TIMEOUT(${limit}s)"
  ROWS+=("| $name | $st | $((SECONDS - t0)) s |")
  echo "[gpu_dispatch_check] $name: $st ($((SECONDS - t0)) s)"
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

step "test_cuda_moe_dispatch" 300 "$OUT/tests.log" "$BIN_T/test_cuda_moe_dispatch"
step "memcheck dispatch" 300 "$OUT/memcheck.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
  "$BIN_T/test_cuda_moe_dispatch" \
  --gtest_filter='*OutOfRange*:*Unaligned*:*Captured*:*RejectsBad*:*CombineWeightGrad*'
step "bench permute" 300 "$OUT/bench_permute.md" "$BIN_CLI" bench permute --iters "$ITERS"

echo
echo "== tests =="
grep -E "^\[  (PASSED|FAILED|SKIPPED) \]|Failure|error:" "$OUT/tests.log" | head -40
echo "== memcheck =="
grep -E "ERROR SUMMARY" "$OUT/memcheck.log"
echo "== bench permute =="
cat "$OUT/bench_permute.md"
echo
echo "| step | result | time |"
echo "|---|---|---|"
printf '%s\n' "${ROWS[@]}"
