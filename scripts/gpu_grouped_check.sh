#!/usr/bin/env bash
# GPU check of the grouped FP8 GEMMs (contiguous, masked, K-grouped Wgrad), for a machine with an
# NVIDIA Hopper GPU: builds the targets (or takes prebuilt binaries), runs test_cuda_grouped_gemm,
# the dense test_cuda_gemm (the grouped GEMMs are the same kernel), compute-sanitizer memcheck on a
# small set of the grouped tests, a SASS sanity check (FP8 WGMMA = QGMMA present) and
# `fp8moe bench grouped`; writes the logs to $OUT (default ./gpu_grouped_out) and prints a short
# summary last.
#
#   scripts/gpu_grouped_check.sh                       # configure + build in build-gpu/, then check
#   FP8MOE_BIN=<dir> scripts/gpu_grouped_check.sh      # use <dir>/{fp8moe,test_cuda_grouped_gemm,test_cuda_gemm}
#   FP8MOE_STEPS=tests,memcheck ...                    # a subset of: tests,dense,memcheck,bench (default all)
#   FP8MOE_BENCH_SET=contiguous FP8MOE_ITERS=20 ...     # bench subset (all|contiguous|masked|wgrad) / timed runs
#   FP8MOE_BENCH_TILES=128x128/pipe,128x192,128x128 ... # also time these grouped tiles on every case (D checked bit for bit)
# Every step has a time limit (together 570 s), so a hung kernel shows up as a TIMEOUT
# row instead of a stuck run.
set -u
OUT=${OUT:-$PWD/gpu_grouped_out}
mkdir -p "$OUT"
ITERS=${FP8MOE_ITERS:-20}
SET=${FP8MOE_BENCH_SET:-all}
STEPS=${FP8MOE_STEPS:-tests,dense,memcheck,bench}
source "$(dirname "$0")/gpu_common.sh"
gpu_bins fp8moe_cli test_cuda_grouped_gemm test_cuda_gemm

gpu_info
want() { [[ ",$STEPS," == *",$1,"* ]]; }  # want <step>: the step is in FP8MOE_STEPS

want tests && step "test_cuda_grouped_gemm" 120 "$OUT/tests.log" "$BIN_T/test_cuda_grouped_gemm"
want dense && step "test_cuda_gemm" 90 "$OUT/tests.log" "$BIN_T/test_cuda_gemm"
HUNG=$(printf '%s\n' "${ROWS[@]:-}" | grep -c "TIMEOUT")
# The exact tests cover every grouped tile at group boundaries (M_max and N not multiples of the
# tile, trailing padding rows, empty groups): out-of-bounds or cross-group accesses show here.
if want memcheck && [ "$HUNG" = 0 ]; then
  step "memcheck grouped" 120 "$OUT/memcheck.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$BIN_T/test_cuda_grouped_gemm" \
    --gtest_filter='CudaGroupedGemm.MaskedSmallIntegers*:CudaGroupedGemm.WgradSmallIntegers*:CudaGroupedGemm.ContiguousAccumulates*:CudaGroupedGemm.RejectsBad*'
fi
{ cuobjdump --dump-sass "$BIN_T/test_cuda_grouped_gemm" 2>/dev/null | grep -c QGMMA; } >"$OUT/sass.txt" 2>&1
if want bench && [ "$HUNG" = 0 ]; then
  step "bench grouped" 240 "$OUT/bench_grouped.md" "$BIN_CLI" bench grouped --iters "$ITERS" --set "$SET"
fi

echo
echo "== tests =="
grep -E "^\[  (PASSED|FAILED|SKIPPED) \]|Failure|error:|info     \]" "$OUT/tests.log" 2>/dev/null | head -60
echo "== memcheck =="
grep -E "ERROR SUMMARY" "$OUT/memcheck.log" 2>/dev/null
echo "== QGMMA instructions in test_cuda_grouped_gemm SASS: $(cat "$OUT/sass.txt") =="
echo "== bench grouped =="
cat "$OUT/bench_grouped.md" 2>/dev/null
print_steps
