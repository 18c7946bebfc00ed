#!/usr/bin/env bash
# Step time of the bf16 and fp8 recipes on one config and backend, side by side in one run:
# tokens/s and achieved TFLOPS (model FLOPs, fwd + bwd) averaged over the steps from step 3 on
# (the first three are warm-up). FP8MOE_REPEAT (default 1) runs the pair that many times,
# alternating the recipes, and averages over all of them.
#   scripts/step_time.sh [config] [steps] [backend]     (defaults: configs/wide.json 12 cuda)
# FP8MOE_BIN (folder with fp8moe, default build/bin) and FP8MOE_DATA (text, default the shared
# tinyshakespeare) as in gpu_train_check.sh; FP8MOE_ARGS (more train options, default
# "--ema-every 1000 --ckpt-every 0": the step without the EMA's host snapshot, docs/PERF-log.md,
# and no checkpoint at the end, which for configs/gemm.json is ~17 GB to write). Output under
# $OUT (default ./step_time_out).
set -u
CFG=${1:-configs/wide.json}
STEPS=${2:-12}
BACKEND=${3:-cuda}
OUT=${OUT:-$PWD/step_time_out}
CLI=${FP8MOE_BIN:-build/bin}/fp8moe
DATA=${FP8MOE_DATA:-../shared/data/tinyshakespeare.txt}
ARGS=${FP8MOE_ARGS---ema-every 1000 --ckpt-every 0}
REPEAT=${FP8MOE_REPEAT:-1}
mkdir -p "$OUT"
for i in $(seq 1 "$REPEAT"); do
  for r in bf16 fp8; do
    timeout --signal=KILL 240 "$CLI" train -c "$CFG" --backend "$BACKEND" --recipe "$r" --data "$DATA" --steps "$STEPS" \
      --log-every 4 --eval-every 100000 --eval-batches 1 $ARGS -o "$OUT/${r}_$i" >"$OUT/${r}_$i.log" 2>&1
    echo "[$r run $i] rc=$?"
  done
done
python3 - "$OUT" "$CFG" <<'PY'
import glob, json, sys
out, cfg = sys.argv[1], sys.argv[2]
rows = {}
for r in ("bf16", "fp8"):
    m, last = [], None
    for p in sorted(glob.glob(f"{out}/{r}_*/metrics.jsonl")):
        run = [json.loads(l) for l in open(p)]
        m += run[3:]  # skip warm-up steps 0..2
        last = run[-1]["loss"] if run else last
    if not m:
        continue
    tps = sum(x["tokens_per_s"] for x in m) / len(m)
    tf = sum(x["tflops"] for x in m) / len(m)
    rows[r] = (tps, tf, last)
print(f"config {cfg}")
print(f"{'recipe':8} {'tokens/s':>10} {'TFLOPS':>8} {'last loss':>10}")
for r, (tps, tf, loss) in rows.items():
    print(f"{r:8} {tps:10.0f} {tf:8.2f} {loss:10.4f}")
if len(rows) == 2:
    print(f"fp8 / bf16 speed: {rows['fp8'][0] / rows['bf16'][0]:.3f}x")
PY
