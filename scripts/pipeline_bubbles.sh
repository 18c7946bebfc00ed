#!/usr/bin/env bash
# The measured pipeline bubble of every schedule at PP = 2 and 4 on CPU ranks (mpirun
# --oversubscribe, one OpenMP thread per rank), beside the simulator fed with the measured F, B, W
# and F&B times and Table 2's formula: the table of docs/SCHEDULES.md. Each run trains 3 steps of
# tests/parallel/tiny_deep.json (4 layers, 8 trunk sublayers) with 8 micro-batches of 2 x 32
# tokens and reports the last step (`fp8moe train --trace`, whose traces stay in $OUT).
#   scripts/pipeline_bubbles.sh [build/bin/fp8moe]
set -euo pipefail
bin=${1:-build/bin/fp8moe}
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
printf '| schedule | PP | ranks | F | B | W | F&B | measured bubble | simulated | Table 2 |\n'
printf '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n'
for pp in 2 4; do
  for s in 1f1b zb1p dualpipe dualpipev; do
    log="$OUT/$s-pp$pp.log"
    mpirun --oversubscribe -np "$pp" "$bin" train -c "$root/tests/parallel/tiny_deep.json" --backend cpu --steps 3 \
      --seq-len 32 --grad-accum 8 --eval-every 1000 --eval-batches 1 --ckpt-every 0 --seed 11 --overwrite \
      --pp "$pp" --schedule "$s" -o "$OUT/$s-pp$pp" --trace "$OUT/$s-pp$pp.json" >"$log"
    costs=$(sed -nE 's/^measured op costs, ms: F ([0-9.]+), B ([0-9.]+), W ([0-9.]+), F&B ([0-9.]+)$/\1 | \2 | \3 | \4/p' "$log")
    bubble=$(sed -nE 's/^bubble, ms: measured ([0-9.]+) .*, simulated ([0-9.]+), Table 2 ([-0-9.]+);.*/\1 | \2 | \3/p' "$log")
    stages=$([[ $s == dualpipev ]] && echo $((2 * pp)) || echo "$pp")
    printf '| %s | %s | %s | %s | %s |\n' "$s" "$stages" "$pp" "$costs" "$bubble"
  done
done
echo "logs and traces: $OUT" >&2
