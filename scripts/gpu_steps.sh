# shellcheck shell=bash
# Timed steps of the GPU check scripts (sourced, not run): `step <name> <seconds> <log> <cmd...>`
# runs a command under a time limit, appends its output to <log> and records a row
# "| name | result | time |" (ok, FAIL(rc=N) or TIMEOUT) that print_steps prints as a table;
# STEP_TAG prefixes the progress lines. record_gpu writes the GPU's name and clocks to $OUT/gpu.txt.
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
