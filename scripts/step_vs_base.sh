#!/usr/bin/env bash
# Two fp8moe binaries' training steps in turns on one device (the runtime issue's side by side:
# the current main against a base; batch 8 x 256): the median tokens/s of steps 3.. of each run,
# the ratio of each pair and of the medians, and the last step's loss of each run.
#   scripts/step_vs_base.sh BASE_BIN OURS_BIN [repeats (2)] [config (configs/medium.json)]
# FP8MOE_ARGS_OURS: more train options for OURS only (e.g. "--wgrad-stream off" to time a binary
# against itself); FP8MOE_STEPS (25), FP8MOE_BACKEND (cuda), FP8MOE_DATA (docs). Output under
# $OUT (default ./step_time_out).
set -u
BASE=$1
OURS=$2
REPEAT=${3:-2}
CFG=${4:-configs/medium.json}
OUT=${OUT:-$PWD/step_time_out}
STEPS=${FP8MOE_STEPS:-25}
mkdir -p "$OUT"
ARGS=(train -c "$CFG" --batch-size 8 --seq-len 256 --steps "$STEPS" --ckpt-every 0 --backend "${FP8MOE_BACKEND:-cuda}"
      --data "${FP8MOE_DATA:-docs}" --eval-every 100000)
for i in $(seq 1 "$REPEAT"); do
  for who in base ours; do
    rm -rf "$OUT/${who}_$i"
    bin=$BASE
    extra=()
    if [ "$who" = ours ]; then bin=$OURS; read -r -a extra <<<"${FP8MOE_ARGS_OURS:-}"; fi
    timeout --signal=KILL 300 "$bin" "${ARGS[@]}" "${extra[@]}" -o "$OUT/${who}_$i" >"$OUT/${who}_$i.log" 2>&1
    echo "[$who run $i] rc=$?"
  done
done
python3 - "$OUT" "$REPEAT" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
med = {}
print(f"{'run':>4} {'base tok/s':>11} {'ours tok/s':>11} {'ours/base':>10}   last loss (base, ours)")
for i in range(1, n + 1):
    row, loss = [], []
    for who in ("base", "ours"):
        try:
            m = [json.loads(l) for l in open(f"{out}/{who}_{i}/metrics.jsonl")]
        except OSError:
            m = []
        tok = [r["tokens_per_s"] for r in m[3:]]
        row.append(statistics.median(tok) if tok else float("nan"))
        loss.append(m[-1]["loss"] if m else float("nan"))
        med.setdefault(who, []).append(row[-1])
    print(f"{i:>4} {row[0]:11.0f} {row[1]:11.0f} {row[1] / row[0]:9.2f}x   {loss[0]!r}, {loss[1]!r}")
b, o = statistics.median(med["base"]), statistics.median(med["ours"])
print(f"medians: base {b:.0f}, ours {o:.0f} tokens/s: {o / b:.2f}x")
PY
