#!/usr/bin/env bash
# BF16 against FP8 at scale on the GPU (docs/ACCURACY.md): for each seed, the bf16 run on GPU 0
# and the other recipes' runs on the last GPU (the same GPU on a one-GPU machine), side by side;
# then the comparison table over every metrics file found under $OUT (runs of earlier calls
# included). FP8MOE_RECIPES (default "bf16 fp8") adds ablations, e.g. "bf16 fp8 fp8-no-promotion".
#   scripts/gpu_compare.sh [config] [steps] [seeds]      defaults: configs/medium.json 3000 "1"
# FP8MOE_BIN (folder with fp8moe) or a build in build-gpu/ (gpu_common.sh); FP8MOE_DATA (text,
# default ../shared/data/tinyshakespeare.txt); FP8MOE_ARGS (more train options, default
# "--batch-size 8 --seq-len 256 --ema-every 10": the EMA does not change the losses);
# FP8MOE_LIMIT (seconds per run, default 540: a device command
# lasts at most 10 minutes, so run one seed per call); OUT (default ./gpu_compare_out).
#   scripts/gpu_compare.sh --summary [horizon]           only the table (e.g. after copying the
#                                                         metrics of several calls into $OUT)
set -u
OUT=${OUT:-$PWD/gpu_compare_out}
mkdir -p "$OUT"
summary() {
  python3 - "$OUT" "${1:-0}" <<'PY'
import json, sys, glob, re
out, horizon = sys.argv[1], int(sys.argv[2])
runs = {}
for p in glob.glob(f"{out}/**/metrics*.jsonl", recursive=True) + glob.glob(f"{out}/*.jsonl"):
    m = re.search(r"(bf16|fp8(?:-[a-z-]+)?)_(\d+)", p)
    if m:
        runs[(m.group(1), int(m.group(2)))] = [json.loads(l) for l in open(p)]
if not runs:
    sys.exit("no metrics found under " + out)
def vals(m): return {x["step"] + 1: x["val_loss"] for x in m if x.get("val_loss") is not None}
def at(m, h):  # (mean training loss of the last tenth before h, validation loss at h)
    lo = h - h // 10
    tr = [x["loss"] for x in m if lo <= x["step"] < h]
    return (sum(tr) / len(tr) if tr else None, vals(m).get(h))
def rel(a, c): return f"{100 * (a / c - 1):+.3f}%" if a and c else "-"
# The horizon: the last validation step every bf16 and fp8 run reached (or the one asked for);
# shorter runs (an ablation stopped early) are compared with BF16 at their own last validation.
main = [m for (r, s), m in runs.items() if r in ("bf16", "fp8")] or list(runs.values())
h = horizon or max(set.intersection(*(set(vals(m)) for m in main)))
print(f"horizon {h} steps: train = mean loss of the last tenth of the steps before it, val = validation loss there")
print(f"{'run':24} {'step':>5} {'train':>8} {'val':>8} {'train vs bf16':>14} {'val vs bf16':>12}")
row = {}
for (r, s), m in sorted(runs.items()):
    hh = h if h in vals(m) else max([v for v in vals(m) if v <= h] or [0])
    if hh == 0:
        continue
    t, v = at(m, hh)
    row[(r, s)] = (t, v)
    b = runs.get(("bf16", s))
    bt, bv = at(b, hh) if b else (None, None)
    print(f"{r + '_' + str(s):24} {hh:5} {t:8.4f} {v:8.4f} {rel(t, bt) if r != 'bf16' else '-':>14} "
          f"{rel(v, bv) if r != 'bf16' else '-':>12}")
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
ARGS=${FP8MOE_ARGS:---batch-size 8 --seq-len 256 --ema-every 10}
RECIPES=${FP8MOE_RECIPES:-bf16 fp8}
LIMIT=${FP8MOE_LIMIT:-540}
source "$(dirname "$0")/gpu_common.sh"
gpu_bins fp8moe_cli
LAST=$(( $(nvidia-smi -L | wc -l) - 1 ))
for s in $SEEDS; do
  for r in $RECIPES; do
    gpu=0; [ $r != bf16 ] && gpu=$LAST
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$gpu timeout --signal=INT "$LIMIT" "$BIN_CLI" train -c "$CFG" --backend cuda --recipe $r \
      --seed "$s" --data "$DATA" --steps "$STEPS" --log-every 100 --eval-every 250 --eval-batches 16 \
      --ckpt-every 1000000 $ARGS -o "$OUT/${r}_$s" >"$OUT/log_${r}_$s.txt" 2>&1 &
  done
done
wait
for f in "$OUT"/log_*.txt; do echo "== $f"; tail -n 2 "$f"; done
summary 0
