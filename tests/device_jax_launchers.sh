#!/usr/bin/env bash
# JAX triton through moe_jax's two launchers, one process per setting: the direct one (XLA_LAUNCHER, the default)
# and the command-buffer compatible one (GRAPHED_LAUNCHER), the latter at XLA's default graph size and at 2. The
# benchmark's single calls and graphed_ms (calls of three input sets in one jitted function), qwen3-30b-a3b.
#   OUT=<results folder> bash tests/device_jax_launchers.sh NAME:LAUNCHER:XLA_FLAGS:TOKENS:MODES:TIMEOUT_S ...
set -u
python -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
for run in "$@"; do
  IFS=: read -r name launcher flags tokens modes limit <<< "$run"
  XLA_FLAGS="$flags" timeout -s TERM "$limit" python -c "import sys, runpy
from moe_jax.backends import triton
triton._launcher = getattr(triton, sys.argv[1])
sys.argv = ['bench'] + sys.argv[2:]
runpy.run_module('bench', run_name='__main__')" "$launcher" --no-plot --config qwen3-30b-a3b --tokens "$tokens" \
    --frameworks jax --backends triton --modes "$modes" --rounds 2 --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "^qwen3-30b-a3b  jax" "$OUT/$name.log" | cut -c1-150
done
