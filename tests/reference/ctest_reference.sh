#!/usr/bin/env bash
# ctest's entry to the PyTorch reference comparison (run_reference.sh): exit 77 (skipped) where
# python3 cannot import torch, or, for the CUDA backend, where the command finds no usable GPU.
#   tests/reference/ctest_reference.sh <fp8moe binary> <output folder> [cpu|cuda]
set -euo pipefail
cli=$1
out=$2
backend=${3:-cpu}
if ! python3 -c "import torch" 2>/dev/null; then
  echo "python3 cannot import torch: the PyTorch reference comparison is skipped"
  exit 77
fi
rm -rf "$out"
if [[ $backend == cuda ]] && ! probe=$("$cli" model --config tiny --dump "$out/probe" --backend cuda 2>&1); then
  if [[ $probe == *"no usable CUDA device"* ]]; then
    echo "$probe"
    echo "the PyTorch reference comparison on the CUDA backend is skipped"
    exit 77
  fi
  echo "$probe"
  exit 1
fi
rm -rf "$out"
FP8MOE_CLI=$cli FP8MOE_REF_BACKEND=$backend exec "$(dirname "$0")/run_reference.sh" all - "$out"
