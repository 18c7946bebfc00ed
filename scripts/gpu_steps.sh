# shellcheck shell=bash
# Shared parts of the GPU check scripts (sourced, not run):
#   gpu_binaries <test targets...>  sets BIN_CLI (the fp8moe command) and BIN_T (the folder of the
#                                   test binaries): $FP8MOE_BIN, or a build of fp8moe_cli and the
#                                   targets in build-gpu/ (log: $OUT/build.log);
#   record_gpu                      the GPU's name and clocks, to $OUT/gpu.txt and stdout;
#   step <name> <seconds> <log> <cmd...>  runs a command under a time limit, appends its output to
#                                   <log> and records a row "| name | result | time |" (ok,
#                                   FAIL(rc=N) or TIMEOUT); STEP_TAG prefixes the progress lines;
#   print_steps                     the rows as a table.
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}

# shellcheck disable=SC2034  # BIN_CLI and BIN_T are read by the sourcing script
gpu_binaries() {
  if [ -z "${FP8MOE_BIN:-}" ]; then
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
      cmake --build build-gpu -j"$(nproc)" --target fp8moe_cli "$@" >>"$OUT/build.log" 2>&1 ||
      { echo "build failed, see $OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
    BIN_CLI=build-gpu/bin/fp8moe
    BIN_T=build-gpu/tests/cuda
  else
    BIN_CLI=$FP8MOE_BIN/fp8moe
    BIN_T=$FP8MOE_BIN
  fi
}

declare -a ROWS
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local t0=$SECONDS
  timeout --signal=KILL "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local st="ok"
  [ $rc -ne 0 ] && st="FAIL(rc=$rc)"
  [ $rc -eq 137 ] && st="TIMEOUT(${limit}s)"
  ROWS+=("| $name | $st | $((SECONDS - t0)) s |")
  echo "[${STEP_TAG:-gpu}] $name: $st ($((SECONDS - t0)) s)"
}

print_steps() {
  echo "| step | result | time |"
  echo "|---|---|---|"
  printf '%s\n' "${ROWS[@]:-}"
}

record_gpu() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
  cat "$OUT/gpu.txt"
}
