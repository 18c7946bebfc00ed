#!/usr/bin/env bash
# GPU check of the training path: the CUDA model ops and optimizer against the CPU backend, every
# backend op on cuda/cublaslt against cpu, then short bf16 and fp8 training runs on the GPU next to
# the CPU's first steps (same seed: the first losses agree), a --stop-at/--resume check on the GPU,
# and a table last. Logs under $OUT (default ./gpu_train_out).
#   scripts/gpu_train_check.sh                       # binaries from build/
#   FP8MOE_BIN=<dir> FP8MOE_DATA=<text> scripts/gpu_train_check.sh
set -u
OUT=${OUT:-$PWD/gpu_train_out}
mkdir -p "$OUT"
BIN=${FP8MOE_BIN:-build}
CLI=$BIN/fp8moe
[ -x "$CLI" ] || CLI=$BIN/bin/fp8moe
T=$BIN
[ -x "$T/test_cuda_model_ops" ] || T=$BIN/tests
DATA=${FP8MOE_DATA:-../shared/data/tinyshakespeare.txt}
CFG=${FP8MOE_CONFIG:-configs/small.json}
STEPS=${FP8MOE_STEPS:-60}
GPU=${FP8MOE_GPU_BACKEND:-cuda}  # cpu: a dry run of this script without a GPU
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
export FP8MOE_SOURCE_DIR=$PWD  # configs/ for test binaries built elsewhere
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

run() {  # run <name> <seconds> <cmd...>
  local name=$1 limit=$2
  shift 2
  timeout --signal=KILL "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "[$name] rc=$?"
}
find_bin() { for d in "$T" "$T/cuda" "$T/cpu" "$T/model"; do [ -x "$d/$1" ] && { echo "$d/$1"; return; }; done; }

run model_ops 120 "$(find_bin test_cuda_model_ops)"
run backend_ops 120 "$(find_bin test_backend_ops)" --gtest_filter='*cuda*:*cublaslt*'
run model_cuda 180 "$(find_bin test_model_cuda)"
common=(-c "$CFG" --data "$DATA" --log-every 10 --eval-every 30 --eval-batches 4 --seed 7)
for r in bf16 fp8; do
  run "train_gpu_$r" 200 "$CLI" train --backend "$GPU" --recipe "$r" "${common[@]}" --steps "$STEPS" -o "$OUT/gpu_$r"
done
run train_cpu_fp8 120 "$CLI" train --backend cpu --recipe fp8 "${common[@]}" --steps "$STEPS" --stop-at 3 -o "$OUT/cpu_fp8"
run resume_a 120 "$CLI" train --backend "$GPU" --recipe fp8 "${common[@]}" --steps 12 -o "$OUT/res_a"
run resume_b1 120 "$CLI" train --backend "$GPU" --recipe fp8 "${common[@]}" --steps 12 --stop-at 5 -o "$OUT/res_b"
run resume_b2 120 "$CLI" train --backend "$GPU" --recipe fp8 "${common[@]}" --steps 12 --resume -o "$OUT/res_b"

echo "== model ops ==";   grep -E "^\[  (PASSED|FAILED|SKIPPED) \]|Failure" "$OUT/model_ops.log" | head -20
echo "== backend ops =="; grep -E "^\[  (PASSED|FAILED|SKIPPED) \]|Failure" "$OUT/backend_ops.log" | head -20
echo "== model cuda vs cpu =="; grep -E "^\[  (PASSED|FAILED) \]|Failure|cuda/cpu|Expected|actual|Which" "$OUT/model_cuda.log" | head -30
for r in bf16 fp8; do echo "== gpu $r =="; grep -E "^step|done|error" "$OUT/train_gpu_$r.log" | tail -8; done
echo "== cpu fp8 (first steps) =="; grep -E "^step|error" "$OUT/train_cpu_fp8.log" | head -4
echo "== gpu fp8 (first steps) =="; head -3 "$OUT/gpu_fp8/metrics.jsonl" | cut -c1-160
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def losses(d):
    return [json.loads(l)["loss"] for l in open(f"{out}/{d}/metrics.jsonl")]
a, b = losses("res_a"), losses("res_b")
print(f"resume on GPU: {len(a)} vs {len(b)} steps, identical losses: {a == b}")
c, g = losses("cpu_fp8"), losses("gpu_fp8")
print("first losses cpu vs gpu (fp8):", [round(x, 5) for x in c[:3]], [round(x, 5) for x in g[:3]])
PY
