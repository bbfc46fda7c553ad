#!/usr/bin/env bash
# The triton backend's decode round on one GPU (2026-12-06). With "sweep": the decode kernels' tile variants timed
# step by step (tests/device_triton_check.py --parts steps), the fastest merged into this device's table, the decode
# thresholds re-measured with them. Then the benchmark with those kernels and table, and again with the kernels and
# table of $OLD (moe.py, plan.py and configs/ of the code before), one process each.
#   OUT=<results folder> OLD=<folder> bash tests/device_decode_round.sh [sweep]
set -u
python -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
K=$(python -c 'import moe_shared.kernels as k, os; print(os.path.dirname(k.__file__))')
NAME=$(python -c 'import torch; from moe_shared.kernels import plan; print(plan.device_file_name(torch.cuda.get_device_name()))')
if [ "${1:-}" = sweep ]; then
  POINTS=qwen3-30b-a3b:1,qwen3-30b-a3b:2,qwen3-30b-a3b:8,mixtral-8x7b:1,mixtral-8x7b:2,deepseek-v3:1,deepseek-v3:2
  timeout -s TERM 170 python tests/device_triton_check.py --out "$OUT/steps" --parts steps --variant-kinds decode \
    --step-plans decode --step-points $POINTS > "$OUT/steps.log" 2>&1
  python tests/device_triton_check.py --merge-steps "$OUT/steps/triton-steps.json" --table "$K/configs/$NAME.json" \
    > "$OUT/merge.log" 2>&1
  timeout -s TERM 60 python tests/device_triton_check.py --out "$OUT/threshold" --parts decode-threshold \
    --configs-out "$OUT/table" > "$OUT/threshold.log" 2>&1
  cp "$OUT/table/$NAME.json" "$K/configs/$NAME.json"
fi
run_bench() {
  local b="python -m bench --no-plot --modes fwd --compile off --rounds 2 --out $OUT/$1"
  timeout -s TERM 110 $b --config qwen3-30b-a3b --tokens 1,2,4,8,16,64 --frameworks torch,jax \
    --backends triton,batched_mm,transformers:batched_mm,transformers:grouped_mm > "$OUT/$1-qwen3.log" 2>&1
  timeout -s TERM 50 $b --config mixtral-8x7b,deepseek-v3 --tokens 1,2,4 --frameworks torch,jax --backends triton \
    > "$OUT/$1-big.log" 2>&1
}
run_bench new
cp "$OLD/moe.py" "$OLD/plan.py" "$K/"
MOE_EXPERTS_TRITON_CONFIGS="$OLD/configs" run_bench old
for f in new-qwen3 new-big old-qwen3 old-big; do grep -E "triton|finished" "$OUT/$f.log" | grep -v "%" | tail -n 20; done
