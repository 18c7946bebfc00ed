#!/usr/bin/env bash
# The PyTorch reference comparison: dumps one forward_backward of the tiny config per recipe with
# the C++ model (CPU, or CUDA with FP8MOE_REF_BACKEND=cuda), then compares each with
# tests/reference/compare.py where torch is installed.
#   End to end: the fp32 recipe must agree within 1e-3 relative error per tensor; fp8 is reported
#   (its distance from the exact reference is the recipe's error); bf16 against the reference with
#   BF16 GEMM operands is reported with the reference's own noise floor: rounding flips compound
#   through the layers to a few BF16 ulps.
#   Teacher forced (per sublayer, on the C++ model's own sublayer inputs and output gradients):
#   fp32 must agree within 1e-3 per tensor (outputs, input gradients, parameter gradients), bf16
#   within 1e-3 or the tensor's noise floor, whichever is larger (compare.py --noise-floor).
#   tests/reference/run_reference.sh dump  [BUILD_DIR] [OUT_DIR]   # needs the fp8moe binary
#   tests/reference/run_reference.sh compare [OUT_DIR]             # needs python3 + torch
#   tests/reference/run_reference.sh all [BUILD_DIR] [OUT_DIR]
#   FP8MOE_CLI=<fp8moe binary> overrides BUILD_DIR/bin/fp8moe (ctest: ctest_reference.sh).
#   FP8MOE_REF_BACKEND=cuda dumps with the CUDA backend (default cpu): the GPU check compares the
#   CUDA backend's forward and gradients with the reference (scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-all}
config=configs/tiny.json
if [[ $mode == dump || $mode == all ]]; then
  bin=${FP8MOE_CLI:-${2:-build}/bin/fp8moe}
  out=${3:-out/reference}
  backend=${FP8MOE_REF_BACKEND:-cpu}
  for r in fp32 bf16 fp8; do
    sub=--dump-sublayers
    [[ $r == fp8 ]] && sub=
    "$bin" model --config $config --recipe $r --seed 7 --backend "$backend" --dump "$out/$r" $sub
  done
  # Every recipe starts from the same weights: keep one copy.
  rm -f "$out/bf16/weights.safetensors" "$out/fp8/weights.safetensors"
fi
if [[ $mode == compare || $mode == all ]]; then
  out=${2:-out/reference}
  [[ $mode == all ]] && out=${3:-out/reference}
  cmp=tests/reference/compare.py
  python3 $cmp "$out/fp32" $config --tol 1e-3 | tail -n 12
  python3 $cmp "$out/fp8" $config --weights "$out/fp32" --report-only | tail -n 1
  python3 $cmp "$out/bf16" $config --weights "$out/fp32" --bf16 --noise-floor 8 --report-only | tail -n 12
  python3 $cmp "$out/fp32" $config --teacher-forced --tol 1e-3 | tail -n 2
  python3 $cmp "$out/bf16" $config --weights "$out/fp32" --teacher-forced --bf16 --noise-floor 8 --tol 1e-3 | tail -n 2
fi
