#!/usr/bin/env bash
# The decode kernels on the tensor cores (DOT) and the down projection per slot (BY_SLOT), on one GPU (2026-12-07).
#   OUT=<results folder> bash tests/device_decode_mma_round.sh sweep
#     the tile variants of --variant-kinds mma timed step by step, the fastest merged into a copy of this device's
#     table ($OUT/new), the decode thresholds re-measured with it; the table as committed in $OUT/old
#   OUT=<results folder> TABLES=<a sweep's OUT> bash tests/device_decode_mma_round.sh bench
#     the benchmark at decode sizes with $TABLES/new, then with $TABLES/old (the kernels of this tree in both)
set -u
python -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
K=$(python -c 'import moe_shared.kernels as k, os; print(os.path.dirname(k.__file__))')
NAME=$(python -c 'import torch; from moe_shared.kernels import plan; print(plan.device_file_name(torch.cuda.get_device_name()))')
if [ "$1" = sweep ]; then
  mkdir -p "$OUT/old" "$OUT/new"
  cp "$K/configs/$NAME.json" "$OUT/old/"
  cp "$K/configs/$NAME.json" "$OUT/new/"
  POINTS=qwen3-30b-a3b:1,qwen3-30b-a3b:4,qwen3-30b-a3b:8,mixtral-8x7b:1,mixtral-8x7b:2,deepseek-v3:1,deepseek-v3:2
  timeout -s TERM 400 python tests/device_triton_check.py --out "$OUT/steps" --parts steps --variant-kinds mma \
    --step-plans decode --step-points $POINTS > "$OUT/steps.log" 2>&1
  python tests/device_triton_check.py --merge-steps "$OUT/steps/triton-steps.json" --table "$OUT/new/$NAME.json" \
    > "$OUT/merge.log" 2>&1
  MOE_EXPERTS_TRITON_CONFIGS="$OUT/new" timeout -s TERM 90 python tests/device_triton_check.py \
    --out "$OUT/threshold" --parts decode-threshold --configs-out "$OUT/new" > "$OUT/threshold.log" 2>&1
  grep -v "warn" "$OUT/steps.log" | tail -n 60; cat "$OUT/merge.log"; tail -n 12 "$OUT/threshold.log"
  exit
fi
run_bench() {
  local b="python -m bench --no-plot --modes fwd --compile off --rounds 2 --out $OUT/$1"
  MOE_EXPERTS_TRITON_CONFIGS="$TABLES/$1" timeout -s TERM 120 $b --config qwen3-30b-a3b --tokens 1,2,4,8,16,64 \
    --frameworks torch,jax --backends triton > "$OUT/$1-qwen3.log" 2>&1
  MOE_EXPERTS_TRITON_CONFIGS="$TABLES/$1" timeout -s TERM 80 $b --config mixtral-8x7b,deepseek-v3 --tokens 1,2,4 \
    --frameworks torch,jax --backends triton > "$OUT/$1-big.log" 2>&1
}
run_bench new
run_bench old
for f in new-qwen3 new-big old-qwen3 old-big; do echo "== $f"; grep -E "triton|finished" "$OUT/$f.log" | grep -v "%" | tail -n 20; done
