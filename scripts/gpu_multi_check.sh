#!/usr/bin/env bash
# The multi-GPU runs, for a host with N >= 2 NVIDIA Hopper GPUs: `fp8moe bench ep` with a process
# per GPU (normal mode, pull combine, low-latency mode; from 8 GPUs also as two nodes of N/2, the
# two-hop dispatch), and training over NCCL at --ep N, --dp N and --pp 2 (DualPipe, F&B compared)
# against one GPU with the same global batch: losses side by side and tokens/s; with
# $FP8MOE_BIN/test_disaggregation at hand, the prefill-to-decode cache handover's GB/s. Logs and
# traces go to $OUT (default ./gpu_multi_out); a short table is printed last. NVLink multicast
# stays off (NCCL_NVLS_ENABLE=0).
#
#   FP8MOE_BIN=<dir> scripts/gpu_multi_check.sh   # <dir>/fp8moe
#   scripts/gpu_multi_check.sh                    # configure + build it in build-gpu/ first
#   FP8MOE_ITERS=20 ...                           # timed runs per benchmark step
#   FP8MOE_RANKS=2 FP8MOE_COMM=mpi ...            # a rehearsal on fewer GPUs: N processes share
#                                                 # them (NCCL refuses two ranks on one GPU)
# Every step has a time limit.
set -u
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${OUT:-$PWD/gpu_multi_out}
mkdir -p "$OUT"
ITERS=${FP8MOE_ITERS:-10}
source "$(dirname "$0")/gpu_common.sh"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
N=${FP8MOE_RANKS:-$GPUS}
COMM=${FP8MOE_COMM:-nccl}
if [ "$N" -lt 2 ] || [ "$GPUS" -lt 1 ]; then
  echo "gpu_multi_check: this host has $GPUS GPU(s); the multi-GPU runs need two or more (or FP8MOE_RANKS=N)"
  exit 1
fi
if [ "$N" -gt "$GPUS" ] && [ "$COMM" = nccl ]; then
  echo "gpu_multi_check: $N ranks on $GPUS GPU(s) need FP8MOE_COMM=mpi (NCCL refuses two ranks on one GPU)"
  exit 1
fi
echo "gpu_multi_check: $N ranks on $GPUS GPU(s), communicator $COMM"

gpu_bins fp8moe_cli
gpu_info
nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
MPI=(mpirun --oversubscribe -np "$N")

step "bench ep" 300 "$OUT/bench_ep.md" "${MPI[@]}" "$BIN_CLI" bench ep --iters "$ITERS"
step "bench ep pull" 300 "$OUT/bench_ep_pull.md" "${MPI[@]}" "$BIN_CLI" bench ep --iters "$ITERS" --pull
step "bench ep low-latency" 200 "$OUT/bench_ep_ll.md" "${MPI[@]}" "$BIN_CLI" bench ep --iters "$ITERS" --low-latency
if [ "$N" -ge 8 ]; then
  step "bench ep two nodes" 300 "$OUT/bench_ep_nodes.md" "${MPI[@]}" "$BIN_CLI" bench ep --iters "$ITERS" \
    --ranks-per-node $((N / 2))
fi

# Training: the parallel runs against one GPU with the same global batch (the reference's
# --grad-accum makes up the data-parallel ranks).
TR=(train -c configs/tiny.json --backend cuda --steps 10 --seq-len 64 --ckpt-every 0 --eval-every 1000
    --eval-batches 1 --seed 11 --data docs --overwrite)
step "train, 1 GPU, grad-accum $N" 300 "$OUT/train_ref.log" "$BIN_CLI" "${TR[@]}" --grad-accum "$N" -o "$OUT/ref"
step "train, 1 GPU, grad-accum 4" 300 "$OUT/train_ref4.log" "$BIN_CLI" "${TR[@]}" --grad-accum 4 -o "$OUT/ref4"
runs=()
train_run() {  # train_run <tag> <reference> <np> <args...>
  local tag=$1 ref=$2 np=$3
  shift 3
  step "train $*" 300 "$OUT/train_$tag.log" mpirun --oversubscribe -np "$np" "$BIN_CLI" "${TR[@]}" "$@" -o "$OUT/$tag"
  runs+=("$tag:$ref")
}
train_run ep "ref" "$N" --ep "$N" --comm "$COMM"
train_run ep_comm "ref" "$N" --ep "$N" --comm "$COMM" --ep-transport comm
train_run dp "ref" "$N" --dp "$N" --comm "$COMM"
train_run pp2 "ref4" 2 --pp 2 --schedule dualpipe --grad-accum 4 --fb compare --comm "$COMM" --trace "$OUT/pp2_trace.json"

# The prefill-to-decode cache handover between two GPUs (the MPI engine, staged through the host),
# where the test binary is at hand.
if [ -n "${FP8MOE_BIN:-}" ] && [ -x "$FP8MOE_BIN/test_disaggregation" ]; then
  step "cache handover, 2 GPUs" 300 "$OUT/handover.log" env FP8MOE_SERVE_BACKEND=cuda \
    mpirun --oversubscribe -np 2 "$FP8MOE_BIN/test_disaggregation"
fi

losses() { sed -E 's/.*[{,]"loss":([^,}]*).*/\1/' "$1/metrics.jsonl" 2>/dev/null; }
rate() { sed -nE 's/.*[{,]"tokens_per_s":([^,}]*).*/\1/p' "$1/metrics.jsonl" 2>/dev/null | sort -g |
         awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print "-" }'; }

echo
echo "== training: losses against one GPU with the same global batch =="
for r in "${runs[@]}"; do
  tag=${r%%:*} ref=${r#*:}
  paste <(losses "$OUT/$ref") <(losses "$OUT/$tag") | awk -v tag="$tag" '
    { n++; d = $1 - $2; if (d < 0) d = -d; x = d / ($1 < 0 ? -$1 : $1); if (x > worst) worst = x; same += $1 == $2 }
    END { printf "%-8s %d steps, %d bitwise, worst relative difference %.3g\n", tag, n, same, worst }'
  echo "         tokens/s (median): $(rate "$OUT/$tag") against $(rate "$OUT/$ref") on one GPU"
done
echo "== cache handover =="
grep -hE "GB/s" "$OUT/handover.log" 2>/dev/null | head -4
echo "== bench ep =="
for f in bench_ep bench_ep_pull bench_ep_ll bench_ep_nodes; do
  [ -f "$OUT/$f.md" ] && grep -E "^# fp8moe|^\| [0-9]" "$OUT/$f.md"
done
print_steps
