#!/usr/bin/env bash
# BF16 against FP8 at scale on the GPU (docs/ACCURACY.md): for each seed, the bf16 run on GPU 0
# and the other recipes' runs on the last GPU (the same GPU on a one-GPU machine), all seeds at
# once; then `fp8moe compare --analyze-only` over every run found under $OUT (runs of earlier calls
# included): each run against BF16 of the same seed, the means over the seeds, the BF16 seed spread.
# Seed s runs in $OUT/<recipe> (s = 1) or $OUT/<recipe>-seed<s-1>, the names `fp8moe compare` uses
# for --seed 1. FP8MOE_RECIPES (default "bf16 fp8") adds ablations, e.g. "bf16 fp8 fp8-no-promotion".
#   scripts/gpu_compare.sh [config] [steps] [seeds]      defaults: configs/medium.json 3000 "1"
# FP8MOE_BIN (folder with fp8moe) or a build in build-gpu/ (gpu_common.sh); FP8MOE_DATA (text,
# default ../shared/data/tinyshakespeare.txt); FP8MOE_ARGS (more train options, default
# "--batch-size 8 --seq-len 256 --ema-every 10": the EMA does not change the losses);
# FP8MOE_LIMIT (seconds per run, default 540: a device command lasts at most 10 minutes);
# OUT (default ./gpu_compare_out).
#   scripts/gpu_compare.sh --summary [horizon]           only the comparison (at step `horizon`;
#                                                         default: each run's end), e.g. after
#                                                         copying the runs of several calls into $OUT
set -u
OUT=${OUT:-$PWD/gpu_compare_out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_common.sh"
gpu_bins fp8moe_cli
if [ "${1:-}" = "--summary" ]; then
  "$BIN_CLI" compare --analyze-only -o "$OUT" --horizon "${2:-0}"
  exit
fi
CFG=${1:-configs/medium.json}
STEPS=${2:-3000}
SEEDS=${3:-1}
DATA=${FP8MOE_DATA:-../shared/data/tinyshakespeare.txt}
ARGS=${FP8MOE_ARGS:---batch-size 8 --seq-len 256 --ema-every 10}
RECIPES=${FP8MOE_RECIPES:-bf16 fp8}
LIMIT=${FP8MOE_LIMIT:-540}
LAST=$(( $(nvidia-smi -L | wc -l) - 1 ))
for s in $SEEDS; do
  for r in $RECIPES; do
    gpu=0; [ $r != bf16 ] && gpu=$LAST
    name=$r; [ "$s" -gt 1 ] && name=$r-seed$((s - 1))
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$gpu timeout --signal=INT "$LIMIT" "$BIN_CLI" train -c "$CFG" --backend cuda --recipe $r \
      --seed "$s" --data "$DATA" --steps "$STEPS" --log-every 100 --eval-every 250 --eval-batches 16 \
      --ckpt-every 1000000 $ARGS -o "$OUT/$name" >"$OUT/log_$name.txt" 2>&1 &
  done
done
wait
for f in "$OUT"/log_*.txt; do echo "== $f"; tail -n 2 "$f"; done
"$BIN_CLI" compare --analyze-only -o "$OUT"
