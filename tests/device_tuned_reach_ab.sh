#!/usr/bin/env bash
# Tile configs with the table's "tuned_reach" set (a tuned entry stands for slot counts within 2**reach of its own,
# farther the documented default: plan.tile_config) against the table as committed (the nearest entry at any
# distance), on one GPU: the tiles that change at the benchmark's points, then the benchmark at those points,
# torch, one process each, the committed table first.
#   OUT=<results folder> [REACHES="1 2"] [NEAREST=0] bash tests/device_tuned_reach_ab.sh
set -u
REACHES=${REACHES:-1}
python -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
for reach in $REACHES; do
mkdir -p "$OUT/reach$reach"
python - "$OUT/reach$reach" "$reach" <<'PY' > "$OUT/changes$reach.txt"
import json, os, sys
from pathlib import Path
import torch
from moe_shared.kernels import plan as plans
name = plans.device_file_name(torch.cuda.get_device_name())
table = json.loads((plans.CONFIG_DIR / f"{name}.json").read_text())
reached = table | {"tuned_reach": float(sys.argv[2])}
(Path(sys.argv[1]) / f"{name}.json").write_text(json.dumps(reached, indent=1) + "\n")
device = torch.cuda.get_device_name()
shapes = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2), "deepseek-v3": (7168, 2048, 256, 8)}
for shape, (H, I, E, k) in shapes.items():
    for kernel, N, K in (("gate_up", I, H), ("down", H, I), ("dgrad_down", I, H), ("dgrad_up", H, 2 * I),
                         ("wgrad", H, I), ("wgrad", 2 * I, H)):
        for T in (16, 64, 256, 1024):
            plans.clear_caches()
            before = plans.tile_config(device, kernel, N, K, E, T * k)
            os.environ[plans.CONFIG_DIR_VARIABLE] = sys.argv[1]
            plans.clear_caches()
            after = plans.tile_config(device, kernel, N, K, E, T * k)
            del os.environ[plans.CONFIG_DIR_VARIABLE]
            if before != after:
                print(shape, kernel, N, K, "T", T, "nearest", before, "reach", after)
PY
done
run_bench() {
  timeout -s TERM 240 python -m bench --no-plot --compile off --frameworks torch --backends triton \
    --modes fwd,fwd+bwd --config qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --tokens 16,64,256,1024 \
    --out "$OUT/$1" > "$OUT/$1.log" 2>&1
}
names=""
if [ "${NEAREST:-1}" = 1 ]; then run_bench nearest; names="nearest"; fi
for reach in $REACHES; do
  MOE_EXPERTS_TRITON_CONFIGS="$OUT/reach$reach" run_bench "reach$reach"
  names="$names reach$reach"
done
wc -l "$OUT"/changes*.txt
for f in $names; do echo "== $f"; grep -E "triton" "$OUT/$f.log" | grep -v "%" | tail -n 24; done
