#!/bin/bash
# call 1: short tiles for the experts' last blocks (SHORT_TAILS) checked against the reference and torch vs JAX on
# the GPU; the public call profiled (where its time goes); each GEMM step timed with SHORT_TAILS 0..3
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$SECONDS
if ! python -c "import jax_triton, moe_torch" 2>/dev/null; then
python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/jax_triton*.whl >/dev/null 2>&1 || echo wheels failed
python -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1 || { echo install failed; exit 3; }
fi
export PYTHONPATH=/tmp/site
echo "== tails,profile at $((SECONDS-T0)) s"
timeout 220 python tests/device_triton_check.py --out /tmp/c1 --parts tails,profile 2>&1 | grep -v "^\s*$" | tail -70 | cut -c1-400; cp /tmp/c1/triton-*.json $OUT/
echo "== steps at $((SECONDS-T0)) s"
timeout $((590-SECONDS+T0)) python tests/device_triton_check.py --out /tmp/c2 --parts steps --variant-kinds tails 2>&1 | grep -v "^\s*$" | grep -v "^    " | tail -40; cp /tmp/c2/triton-*.json $OUT/
echo "done at $((SECONDS-T0)) s"
