# Shared by the GPU check scripts (sourced, with OUT set and created): the binaries to run and a
# step runner with a time limit.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}

# gpu_bins <targets...>: BIN_CLI (the fp8moe command), BIN_T (the CUDA test binaries) and BIN_M
# (the model's GPU tests) from $FP8MOE_BIN when set; otherwise configures and builds the targets in
# build-gpu/ (log: $OUT/build.log) and exits when that fails.
gpu_bins() {
  if [ -n "${FP8MOE_BIN:-}" ]; then
    BIN_CLI=$FP8MOE_BIN/fp8moe
    BIN_T=$FP8MOE_BIN
    BIN_M=$FP8MOE_BIN
    return
  fi
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j"$(nproc)" --target "$@" >>"$OUT/build.log" 2>&1 ||
    { echo "build failed, see $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
  BIN_CLI=build-gpu/bin/fp8moe
  BIN_T=build-gpu/tests/cuda
  BIN_M=build-gpu/tests/model
}

declare -a ROWS
step() {  # step <name> <seconds> <log> <cmd...>: runs, records "| name | result | time |" in ROWS
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout --signal=KILL "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local st="ok"
  [ $rc -ne 0 ] && st="FAIL(rc=$rc)"
  [ $rc -eq 137 ] && st="TIMEOUT(${limit}s)"
  ROWS+=("| $name | $st | $((SECONDS - t0)) s |")
  echo "[$(basename "$0" .sh)] $name: $st ($((SECONDS - t0)) s)"
}

# The ROWS table, last thing a script prints.
print_steps() {
  echo
  echo "| step | result | time |"
  echo "|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
}

gpu_info() {  # the GPU, its driver and clocks, into $OUT/gpu.txt and on the screen
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
  cat "$OUT/gpu.txt"
}
