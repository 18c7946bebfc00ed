#!/usr/bin/env bash
# Multi-rank training against one rank with the same global batch (registered with ctest by
# tests/parallel/CMakeLists.txt): trains the reference on one process, the run under mpirun, and
# compares the training loss step by step: the first EXACT steps (default 1: the first step's
# loss, a forward of the same weights) bitwise, the others within the relative tolerance TOL
# (0: bitwise too).
#   parallel_train.sh FP8MOE MPIRUN NP TOL CONFIG "REF ARGS" "RUN ARGS"
# With RESUME=1 in the environment the reference is the uninterrupted run under mpirun, and the
# run is trained in two pieces: --stop-at 2 under mpirun, then resumed on one process with REF
# ARGS (a checkpoint saved at one data-parallel size resumed at another; EXACT=3: the next loss
# after the resume is the one of continuing), or under mpirun on RESUME_NP ranks when given (at
# another layout of data-parallel and expert-parallel ranks).
set -euo pipefail
bin=$1 mpirun=$2 np=$3 tol=$4 cfg=$5 ref_args=$6 run_args=$7
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# One thread per rank: the same OpenMP partition of every sum in the reference and the run.
export OMP_NUM_THREADS=1
common=(train -c "$cfg" --backend cpu --steps 4 --seq-len 32 --eval-every 1000 --eval-batches 1 --seed 11 -q)
# shellcheck disable=SC2086
if [[ "${RESUME:-0}" == 1 ]]; then
  # shellcheck disable=SC2086
  "$mpirun" --oversubscribe -np "$np" "$bin" "${common[@]}" --ckpt-every 0 $run_args -o "$dir/ref"
  # shellcheck disable=SC2086
  "$mpirun" --oversubscribe -np "$np" "$bin" "${common[@]}" --stop-at 2 $run_args -o "$dir/run"
  if [[ -n "${RESUME_NP:-}" ]]; then
    # shellcheck disable=SC2086
    "$mpirun" --oversubscribe -np "$RESUME_NP" "$bin" "${common[@]}" --resume $ref_args -o "$dir/run"
  else
    # shellcheck disable=SC2086
    "$bin" "${common[@]}" --resume $ref_args -o "$dir/run"
  fi
else
  # shellcheck disable=SC2086
  "$bin" "${common[@]}" --ckpt-every 0 $ref_args -o "$dir/ref"
  # shellcheck disable=SC2086
  "$mpirun" --oversubscribe -np "$np" "$bin" "${common[@]}" --ckpt-every 0 $run_args -o "$dir/run"
fi
losses() { sed -E 's/.*[{,]"loss":([^,}]*).*/\1/' "$1/metrics.jsonl"; }
paste <(losses "$dir/ref") <(losses "$dir/run") | awk -v tol="$tol" -v exact="${EXACT:-1}" '
  { n++; a = $1 + 0; b = $2 + 0; d = a - b; if (d < 0) d = -d; r = d / (a < 0 ? -a : a); if (r > worst) worst = r;
    printf "step %d  reference %s  run %s  relative %.3g%s\n", n - 1, $1, $2, r, n <= exact ? " (bitwise)" : "";
    if (((tol == 0 || n <= exact) && $1 != $2) || r > tol) bad++ }
  END { if (n != 4) { print "expected 4 steps, got " n; exit 1 }
        printf "worst relative difference %.3g (tolerance %g)\n", worst, tol; exit bad > 0 }'
