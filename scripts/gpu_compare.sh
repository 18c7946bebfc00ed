#!/usr/bin/env bash
# BF16 against FP8 at scale on the GPU (docs/ACCURACY.md): for each seed, the bf16 run on GPU 0
# and the fp8 run on the last GPU (the same GPU on a one-GPU machine), side by side; then the
# comparison table over every metrics file found under $OUT (runs of earlier calls included).
#   scripts/gpu_compare.sh [config] [steps] [seeds]      defaults: configs/medium.json 3000 "1"
# FP8MOE_BIN (folder with fp8moe) or a build in build-gpu/ (gpu_common.sh); FP8MOE_DATA (text,
# default ../shared/data/tinyshakespeare.txt); FP8MOE_ARGS (more train options, default
# "--batch-size 8 --seq-len 256"); FP8MOE_LIMIT (seconds per run, default 540: a device command
# lasts at most 10 minutes, so run one seed per call); OUT (default ./gpu_compare_out).
#   scripts/gpu_compare.sh --summary [horizon]           only the table (e.g. after copying the
#                                                         metrics of several calls into $OUT)
set -u
OUT=${OUT:-$PWD/gpu_compare_out}
mkdir -p "$OUT"
summary() {
  python3 - "$OUT" "${1:-0}" <<'PY'
import json, sys, glob, os, re
out, horizon = sys.argv[1], int(sys.argv[2])
runs = {}
for p in glob.glob(f"{out}/**/metrics*.jsonl", recursive=True) + glob.glob(f"{out}/*.jsonl"):
    m = re.search(r"(bf16|fp8)_(\d+)", p)
    if m:
        runs[(m.group(1), int(m.group(2)))] = [json.loads(l) for l in open(p)]
if not runs:
    sys.exit("no metrics found under " + out)
# The common horizon: the last validation step every run reached (or the one asked for).
def vals(m): return {x["step"] + 1: x["val_loss"] for x in m if x.get("val_loss") is not None}
common = set.intersection(*(set(vals(m)) for m in runs.values()))
h = horizon or max(common)
lo = h - h // 10
row = {}
for k, m in sorted(runs.items()):
    tr = [x["loss"] for x in m if lo <= x["step"] < h]
    row[k] = (sum(tr) / len(tr), vals(m).get(h))
print(f"horizon {h} steps: train = mean loss of steps {lo}..{h - 1}, val = validation loss at step {h}")
print(f"{'run':10} {'train':>8} {'val':>8} {'train vs bf16':>14} {'val vs bf16':>12}")
for (r, s), (t, v) in row.items():
    b = row.get(("bf16", s))
    rel = lambda a, c: f"{100 * (a / c - 1):+.3f}%" if c and a else "-"
    print(f"{r + '_' + str(s):10} {t:8.4f} {v:8.4f} {rel(t, b[0]) if b and r != 'bf16' else '-':>14} "
          f"{rel(v, b[1]) if b and r != 'bf16' else '-':>12}")
bs = [v for (r, s), v in row.items() if r == "bf16"]
if len(bs) > 1:
    t, v = [x[0] for x in bs], [x[1] for x in bs]
    print(f"bf16 seed spread: train {100 * (max(t) - min(t)) / (sum(t) / len(t)):.3f}%, "
          f"val {100 * (max(v) - min(v)) / (sum(v) / len(v)):.3f}%")
PY
}
if [ "${1:-}" = "--summary" ]; then summary "${2:-0}"; exit; fi
CFG=${1:-configs/medium.json}
STEPS=${2:-3000}
SEEDS=${3:-1}
DATA=${FP8MOE_DATA:-../shared/data/tinyshakespeare.txt}
ARGS=${FP8MOE_ARGS:---batch-size 8 --seq-len 256}
LIMIT=${FP8MOE_LIMIT:-540}
source "$(dirname "$0")/gpu_common.sh"
gpu_bins fp8moe_cli
LAST=$(( $(nvidia-smi -L | wc -l) - 1 ))
for s in $SEEDS; do
  for r in bf16 fp8; do
    gpu=0; [ $r = fp8 ] && gpu=$LAST
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$gpu timeout --signal=INT "$LIMIT" "$BIN_CLI" train -c "$CFG" --backend cuda --recipe $r \
      --seed "$s" --data "$DATA" --steps "$STEPS" --log-every 100 --eval-every 250 --eval-batches 16 \
      --ckpt-every 1000000 $ARGS -o "$OUT/${r}_$s" >"$OUT/log_${r}_$s.txt" 2>&1 &
  done
done
wait
for f in "$OUT"/log_*.txt; do echo "== $f"; tail -n 2 "$f"; done
summary 0
