#!/usr/bin/env bash
# Training with --ep NP on the two expert-parallel transports (registered with ctest by
# tests/parallel/CMakeLists.txt): the same run with --ep-transport comm and nvlink, NP processes
# under mpirun on the CUDA backend (they may share one GPU), prints both loss lists and requires
# them bitwise equal at every step, and the nvlink run to have said it used nvlink. EXTRA, e.g.
# "--ranks-per-node 2", is added to both runs (nodes of ranks: the two-hop dispatch).
#   ep_transport_train.sh FP8MOE MPIRUN CONFIG [STEPS [NP [EXTRA]]]
# Exits 77 (skipped) without a GPU.
set -euo pipefail
bin=$1 mpirun=$2 cfg=$3 steps=${4:-10} np=${5:-2}
read -r -a extra <<< "${6:-}"
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "no GPU: skipped"
  exit 77
fi
# The repository's docs as the corpus: the transports' equality needs no particular text, and a
# GPU machine need not have the default corpus installed.
docs=$(cd "$(dirname "$0")/../../docs" && pwd)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
common=(train -c "$cfg" --backend cuda --ep "$np" --comm mpi --steps "$steps" --seq-len 64 --ckpt-every 0
        --eval-every 1000 --eval-batches 1 --seed 11 --data "$docs" "${extra[@]}")
for t in comm nvlink; do
  "$mpirun" --oversubscribe -np "$np" "$bin" "${common[@]}" --ep-transport "$t" -o "$dir/$t" > "$dir/$t.log" 2>&1 ||
    { cat "$dir/$t.log"; exit 1; }
  grep -q "^expert-parallel transport: $t\$" "$dir/$t.log" || { echo "--ep-transport $t: the run did not use $t"; cat "$dir/$t.log"; exit 1; }
done
losses() { sed -E 's/.*[{,]"loss":([^,}]*).*/\1/' "$1/metrics.jsonl"; }
paste <(losses "$dir/comm") <(losses "$dir/nvlink") | awk -v steps="$steps" '
  { n++; same = $1 == $2; bad += !same; printf "step %d  comm %s  nvlink %s  %s\n", n - 1, $1, $2, same ? "bitwise" : "DIFFERENT" }
  END { if (n != steps) { print "expected " steps " steps, got " n; exit 1 }
        printf "%d of %d steps bitwise equal\n", n - bad, n; exit bad > 0 }'
