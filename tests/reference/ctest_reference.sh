#!/usr/bin/env bash
# ctest's entry to the PyTorch reference comparison (run_reference.sh): exit 77 (skipped) where
# python3 cannot import torch.
#   tests/reference/ctest_reference.sh <fp8moe binary> <output folder>
set -euo pipefail
cli=$1
out=$2
if ! python3 -c "import torch" 2>/dev/null; then
  echo "python3 cannot import torch: the PyTorch reference comparison is skipped"
  exit 77
fi
rm -rf "$out"
FP8MOE_CLI=$cli exec "$(dirname "$0")/run_reference.sh" all - "$out"
