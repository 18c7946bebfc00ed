#!/usr/bin/env bash
# GPU check of the CUDA backend, for a machine with an NVIDIA Hopper GPU: builds the CUDA targets
# (or takes prebuilt binaries), runs the GPU tests, compute-sanitizer memcheck, a SASS sanity check
# (FP8 WGMMA = QGMMA present), the PyTorch reference comparison on the CUDA backend, the memory
# account against the allocator (test_model_memory_cuda), `fp8moe bench quant` and
# `fp8moe bench gemm`, writes the logs to
# $OUT (default ./gpu_check_out) and prints a short table last.
#
#   scripts/gpu_check.sh                      # configure + build in build-gpu/, then check
#   FP8MOE_BIN=<dir> scripts/gpu_check.sh     # use <dir>/{fp8moe,test_cuda_quantize,test_cuda_gemm,test_cuda_gemm_emulated,test_model_memory_cuda}
#   FP8MOE_BENCH_SET=m4096 FP8MOE_ITERS=20 ... # bench subset / timed runs per case
#   FP8MOE_BENCH_TILES=128x128,256x128/direct ... # also time these tiles on every GEMM case (D checked bit for bit)
# Every step has a time limit, so a hung kernel shows up as a TIMEOUT row instead of a stuck run.
set -u
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
ITERS=${FP8MOE_ITERS:-30}
SET=${FP8MOE_BENCH_SET:-all}
source "$(dirname "$0")/gpu_common.sh"
gpu_bins fp8moe_cli test_cuda_quantize test_cuda_gemm test_cuda_gemm_emulated test_model_memory_cuda

gpu_info

step "test_cuda_quantize" 60 "$OUT/tests.log" "$BIN_T/test_cuda_quantize"
step "test_cuda_gemm" 90 "$OUT/tests.log" "$BIN_T/test_cuda_gemm"
step "test_cuda_gemm_emulated" 120 "$OUT/tests.log" "$BIN_T/test_cuda_gemm_emulated"
GEMM_HUNG=$(printf '%s\n' "${ROWS[@]}" | grep -c "test_cuda_gemm | TIMEOUT")
if [ "$GEMM_HUNG" = 0 ]; then
  step "memcheck gemm" 90 "$OUT/memcheck.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$BIN_T/test_cuda_gemm" --gtest_filter='CudaGemm.SmallIntegers*:CudaGemm.Accumulates*:CudaGemm.RejectsBad*'
fi
step "memcheck emulated" 120 "$OUT/memcheck.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
  "$BIN_T/test_cuda_gemm_emulated" --gtest_filter='*Masked*:*Wgrad*:*ZeroTiles*:*NanWhere*:*Padded*'
step "memcheck quantize" 90 "$OUT/memcheck.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
  "$BIN_T/test_cuda_quantize" --gtest_filter='*Rows1x128*:*Transposed*:*Requantize*:*Blocks*'
{ cuobjdump --dump-sass "$BIN_T/test_cuda_gemm" 2>/dev/null | grep -c QGMMA; } >"$OUT/sass.txt" 2>&1
# The independent oracle: the PyTorch reference model (torch is installed here) against the C++
# model's forward and every gradient on the CUDA backend, end to end and per sublayer
# (tests/reference/run_reference.sh; exit 77 = torch missing).
step "torch reference" 300 "$OUT/reference.log" tests/reference/ctest_reference.sh "$BIN_CLI" "$OUT/reference" cuda
# The memory account against the allocator over a medium-config step's forward (within 5%).
step "model memory" 180 "$OUT/tests.log" env FP8MOE_SOURCE_DIR="$PWD" "$BIN_M/test_model_memory_cuda"
step "bench quant" 60 "$OUT/bench_quant.md" "$BIN_CLI" bench quant --iters "$ITERS"
[ "$GEMM_HUNG" = 0 ] && step "bench gemm" 200 "$OUT/bench_gemm.md" "$BIN_CLI" bench gemm --iters "$ITERS" --set "$SET"

echo
echo "== tests =="
grep -E "^\[  (PASSED|FAILED|SKIPPED) \]|Failure|error:|info     \]|memory   \]" "$OUT/tests.log" | head -40
echo "== memcheck =="
grep -E "ERROR SUMMARY" "$OUT/memcheck.log"
echo "== QGMMA instructions in test_cuda_gemm SASS: $(cat "$OUT/sass.txt") =="
echo "== bench quant =="
cat "$OUT/bench_quant.md"
echo "== bench gemm =="
cat "$OUT/bench_gemm.md"
print_steps
