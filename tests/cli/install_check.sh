#!/usr/bin/env bash
# `cmake --install` into a fresh prefix, then the installed command run from / with a config by
# name and the default corpus it installed: it must not need the sources or the build tree.
#   tests/cli/install_check.sh <build dir>
# Exits 77 (skipped) when the default corpus is not on this machine (scripts/setup.sh installs it).
set -euo pipefail
build=$(cd "$1" && pwd)
prefix=$(mktemp -d /tmp/fp8moe_install_XXXXXX)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
test -x "$prefix/bin/fp8moe"
test -f "$prefix/share/fp8moe/configs/tiny.json"
if [ ! -d "$prefix/share/fp8moe/data/fortunes" ]; then
  echo "install_check: no default corpus installed (Debian's fortunes); skipped"
  exit 77
fi
cd /
out=$("$prefix/bin/fp8moe" train -c tiny --backend cpu --steps 2 --batch-size 1 --seq-len 32 --eval-batches 1 \
  -o "$prefix/run")
echo "$out"
grep -q "data $prefix/share/fp8moe/data/fortunes" <<<"$out"
grep -q "^done: step 2 of 2, train loss" <<<"$out"
test -f "$prefix/run/checkpoint.safetensors"
echo "install_check: passed"
