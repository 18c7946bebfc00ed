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
source "$(dirname "$0")/gpu_common.sh"
gpu_bins fp8moe_cli test_cuda_moe_dispatch

gpu_info

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
print_steps
