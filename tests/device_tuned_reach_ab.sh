#!/usr/bin/env bash
# A tuned entry standing for slot counts within 2x of its own (plan.TUNED_REACH), against the nearest entry at any
# distance (the code before, OLD_PLAN: that plan.py), on one GPU (2026-12-07): the benchmark at the points whose
# tiles change on the H100 (forward+backward at T = 16..1024, forward at T = 16 and 256), torch, one process each.
#   OUT=<results folder> OLD_PLAN=<plan.py> bash tests/device_tuned_reach_ab.sh
set -u
python -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
K=$(python -c 'import moe_shared.kernels as k, os; print(os.path.dirname(k.__file__))')
run_bench() {
  local b="python -m bench --no-plot --compile off --frameworks torch --backends triton --out $OUT/$1"
  timeout -s TERM 100 $b --modes fwd+bwd --config qwen3-30b-a3b,mixtral-8x7b --tokens 16,64,256,1024 \
    > "$OUT/$1-train.log" 2>&1
  timeout -s TERM 60 $b --modes fwd+bwd --config deepseek-v3 --tokens 16,256 > "$OUT/$1-train-ds.log" 2>&1
  timeout -s TERM 50 $b --modes fwd --config qwen3-30b-a3b,deepseek-v3 --tokens 16,256 > "$OUT/$1-fwd.log" 2>&1
}
run_bench new
cp "$OLD_PLAN" "$K/plan.py"
run_bench old
for f in new-train new-train-ds new-fwd old-train old-train-ds old-fwd; do
  echo "== $f"; grep -E "triton" "$OUT/$f.log" | grep -v "%" | tail -n 12
done
