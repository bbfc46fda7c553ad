#!/bin/bash
# call 2: with SHORT_TAILS in the table: the vectors and graphs checks, the public call profiled (host time too),
# then the benchmark at T=4096 (three configs, torch and JAX, fwd and fwd+bwd)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$SECONDS
if ! python -c "import jax_triton, moe_torch" 2>/dev/null; then
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/jax_triton*.whl >/dev/null 2>&1 || echo wheels failed
python -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1 || { echo install failed; exit 3; }
fi
export PYTHONPATH=/tmp/site
echo "== checks at $((SECONDS-T0)) s"
timeout 170 python tests/device_triton_check.py --out /tmp/c3 --parts vectors,graphs 2>&1 | grep -v "^\s*$" | tail -8 | cut -c1-300; cp /tmp/c3/triton-*.json $OUT/
echo "== profile at $((SECONDS-T0)) s"
timeout 100 python tests/device_triton_check.py --out /tmp/c4 --parts profile 2>&1 | grep -v "^\s*$" | grep -v "^    " | tail -8; cp /tmp/c4/triton-*.json $OUT/
save(){ for j in /tmp/n12/*/*.json; do [ -f $j ] && cp $j $OUT/bench-$(basename $j); done; }
( while sleep 10; do save; done ) &
echo "== bench at $((SECONDS-T0)) s"
timeout $((590-SECONDS+T0)) python -m bench --no-plot --out /tmp/n12 --config qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --tokens 4096 --frameworks torch,jax --modes fwd,fwd+bwd --backends triton --compile off --no-peers --max-point-s 100 --max-call-s 5 2>&1 | grep -vE "^\s*$|it/s|s/it|pt/s" | tail -16; save
echo "done at $((SECONDS-T0)) s"
