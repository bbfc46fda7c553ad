#!/usr/bin/env bash
# batched_mm compiled at decode against transformers' batched_mm, qwen3-30b-a3b forward, one process per run: the
# benchmark with COMPILED_FUSED_SLOTS["cuda"] set per run (moe_torch/backends/batched_mm.py); then, with "profile",
# bench.profile of both at T=1 and 8 in turn.
#   OUT=<results folder> bash tests/device_compiled_ab.sh NAME:FUSED_SLOTS:COMPILE_MODE:TOKENS:TIMEOUT_S... [profile]
set -u
python -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
for run in "$@"; do
  if [ "$run" = profile ]; then
    timeout -s TERM 200 python -m bench.profile --config qwen3-30b-a3b --tokens 1,8 --modes fwd \
      --compile-mode max-autotune --backends transformers:batched_mm,batched_mm,transformers:batched_mm,batched_mm \
      --calls 200 --top 14 --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
    echo "profile rc=$?"
    continue
  fi
  IFS=: read -r name slots mode tokens limit <<< "$run"
  timeout -s TERM "$limit" python -c "import sys, runpy
from moe_torch.backends import batched_mm
batched_mm.COMPILED_FUSED_SLOTS['cuda'] = int(sys.argv[1])
sys.argv = ['bench'] + sys.argv[2:]
runpy.run_module('bench', run_name='__main__')" "$slots" --no-plot --config qwen3-30b-a3b --tokens "$tokens" \
    --frameworks torch --backends batched_mm,transformers:batched_mm --modes fwd --compile on --compile-mode "$mode" \
    --rounds 3 --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "^qwen3-30b-a3b  fwd" "$OUT/$name.log" | tail -n 4
done
