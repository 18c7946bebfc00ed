#!/usr/bin/env bash
# GPU check of the expert-parallel kernels (src/cuda/ep/), for a machine with an NVIDIA Hopper
# GPU: test_cuda_ep, compute-sanitizer memcheck and racecheck on its small cases, and
# `fp8moe bench ep` (2, 4 and 8 ranks on the one GPU, with the GEMM slowdown); writes the logs to
# $OUT (default ./gpu_ep_out) and prints a short summary last.
#
#   FP8MOE_BIN=<dir> scripts/gpu_ep_check.sh   # <dir>/fp8moe and <dir>/test_cuda_ep
#   scripts/gpu_ep_check.sh                    # configure + build them in build-gpu/ first
#   FP8MOE_ITERS=20 ...                        # timed runs per step in the benchmark
# Every step has a time limit; the kernels themselves give up on a missing peer after their timeout.
set -u
OUT=${OUT:-$PWD/gpu_ep_out}
mkdir -p "$OUT"
ITERS=${FP8MOE_ITERS:-20}
source "$(dirname "$0")/gpu_common.sh"
gpu_bins fp8moe_cli test_cuda_ep

gpu_info

step "test_cuda_ep" 60 "$OUT/tests.log" "$BIN_T/test_cuda_ep"
SMALL='*TwoRanksUniform*:*EightRanksFewChannels*:*FourRanksPullCombine*:*TooManyTokens*:*FourRanksAsTwoNodesWithASilentRank*:*TwoRanksAsTwoNodesFullHidden*'
step "memcheck ep" 80 "$OUT/memcheck.log" compute-sanitizer --tool memcheck --error-exitcode 3 \
  "$BIN_T/test_cuda_ep" --gtest_filter="$SMALL"
step "racecheck ep" 60 "$OUT/racecheck.log" compute-sanitizer --tool racecheck --error-exitcode 3 \
  "$BIN_T/test_cuda_ep" --gtest_filter='*TwoRanksUniform*:*FourRanksAsTwoNodesWithASilentRank*'
step "bench ep" 80 "$OUT/bench_ep.md" "$BIN_CLI" bench ep --iters "$ITERS" --gemm
step "bench ep pull" 80 "$OUT/bench_ep_pull.md" "$BIN_CLI" bench ep --iters "$ITERS" --gemm --pull
# Other SM budgets: more SMs per rank, and 8 ranks that fit one block per SM (num_sms 16).
step "bench ep sms" 60 "$OUT/bench_ep_sms.md" bash -c "'$BIN_CLI' bench ep --iters $ITERS --ranks 2,4 --num-sms 32 \
  --no-check && '$BIN_CLI' bench ep --iters $ITERS --ranks 8 --num-sms 16 --no-check"
# Small messages: 128 tokens per rank (the normal mode's latency; no low-latency kernels yet).
step "bench ep small" 40 "$OUT/bench_ep_small.md" "$BIN_CLI" bench ep --iters "$ITERS" --ranks 2,8 --tokens 128

echo
echo "== tests =="
grep -E "^\[  (PASSED|FAILED|SKIPPED) \]|Failure|error|Expected|Which is" "$OUT/tests.log" | head -30
echo "== sanitizers =="
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error" "$OUT/memcheck.log" "$OUT/racecheck.log" | head -10
echo "== bench ep =="
cat "$OUT/bench_ep.md"
grep -E "^\| [0-9]|^# [0-9]" "$OUT/bench_ep_pull.md" 2>/dev/null
grep -E "^\| [0-9]" "$OUT/bench_ep_sms.md" 2>/dev/null
grep -E "^\| [0-9]" "$OUT/bench_ep_small.md" 2>/dev/null
print_steps
