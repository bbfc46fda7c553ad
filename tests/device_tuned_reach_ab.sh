#!/usr/bin/env bash
# A tuned entry standing for slot counts within 2x of its own (plan.TUNED_REACH), against the nearest entry at any
# distance (the code before, OLD_PLAN: that plan.py), on one GPU (2026-12-07): the benchmark at the points whose
# tiles change on the H100 (forward and forward+backward at T = 16, 64, 256, qwen3-30b-a3b and mixtral-8x7b), torch, one process each.
#   OUT=<results folder> OLD_PLAN=<plan.py> bash tests/device_tuned_reach_ab.sh
set -u
python -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
K=$(python -c 'import moe_shared.kernels as k, os; print(os.path.dirname(k.__file__))')
run_bench() {
  timeout -s TERM 100 python -m bench --no-plot --compile off --frameworks torch --backends triton --out "$OUT/$1" \
    --modes fwd,fwd+bwd --config qwen3-30b-a3b,mixtral-8x7b --tokens 16,64,256 > "$OUT/$1.log" 2>&1
}
run_bench new
cp "$OLD_PLAN" "$K/plan.py"
run_bench old
for f in new old; do echo "== $f"; grep -E "triton" "$OUT/$f.log" | grep -v "%" | tail -n 14; done
