#!/usr/bin/env bash
# The PyTorch reference comparison of issue 5: dumps one forward_backward of the tiny config per
# recipe with the C++ model (CPU), then compares each with tests/reference/compare.py where torch
# is installed. The fp32 recipe, and the bf16 recipe against the reference with BF16 GEMM operands,
# must agree within 1e-3 relative error per tensor; fp8 is reported (its distance from the exact
# reference is the recipe's error).
#   tests/reference/run_reference.sh dump  [BUILD_DIR] [OUT_DIR]   # needs the fp8moe binary
#   tests/reference/run_reference.sh compare [OUT_DIR]             # needs python3 + torch
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-all}
config=configs/tiny.json
if [[ $mode == dump || $mode == all ]]; then
  bin=${2:-build}/bin/fp8moe
  out=${3:-out/reference}
  for r in fp32 bf16 fp8; do "$bin" model --config $config --recipe $r --seed 7 --dump "$out/$r"; done
  # Every recipe starts from the same weights: keep one copy.
  rm -f "$out/bf16/weights.safetensors" "$out/fp8/weights.safetensors"
fi
if [[ $mode == compare || $mode == all ]]; then
  out=${2:-out/reference}
  [[ $mode == all ]] && out=${3:-out/reference}
  python3 tests/reference/compare.py "$out/fp32" $config --tol 1e-3 | tail -n 12
  python3 tests/reference/compare.py "$out/fp8" $config --weights "$out/fp32" --report-only | tail -n 1
  python3 tests/reference/compare.py "$out/bf16" $config --weights "$out/fp32" --bf16 --tol 1e-3 | tail -n 12
fi
