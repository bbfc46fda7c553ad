"""The fixed cost of a jitted JAX call on the GPU, timed alone (run on the lent H200; not collected by pytest):

    python tests/device_callback_overhead.py --out DIR [--calls 200]

What a ``sonicmoe`` call pays before and after its kernels, piece by piece, each call timed from the call to its
result being ready (median), as the benchmark's ``ms`` column times a JAX call: a jitted ``x + 1``; a jitted
``buffer_callback`` that does nothing; the same callback viewing its buffers with torch on XLA's stream; the shared
routing kernels alone (``jax_triton``, qwen3-30b-a3b at T=4096); and torch's ``x + 1`` with a synchronize. Writes
``DIR/callback-overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def alone(call, wait, calls: int) -> float:
    for _ in range(10):
        wait(call())
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        wait(call())
        times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2] * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    import torch
    from jax.experimental.buffer_callback import buffer_callback

    from moe_jax import torch_bridge
    from moe_jax.backends import sonicmoe as jax_sonic

    x = jnp.ones((4096, 2048), jnp.bfloat16)
    kind = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def nothing(ctx, out, x):
        pass

    def views(ctx, out, x):
        with torch_bridge.on_xla_stream(ctx, x):
            torch_bridge.views({"x": x, "out": out})

    ids = jax.random.randint(jax.random.key(0), (4096, 8), 0, 128, jnp.int32)
    w = jax.random.uniform(jax.random.key(1), (4096, 8), jnp.float32)
    series = {
        "jax x + 1": (jax.jit(lambda x: x + 1), x),
        "jax buffer_callback, nothing": (jax.jit(lambda x: buffer_callback(nothing, kind)(x)), x),
        "jax buffer_callback, torch views on XLA's stream": (jax.jit(lambda x: buffer_callback(views, kind)(x)), x),
        "jax routing kernels (jax_triton)": (jax.jit(lambda ids, w: jax_sonic._routing(ids, w, 128)), (ids, w)),
    }
    results = {}
    for name, (fn, arg) in series.items():
        args_ = arg if isinstance(arg, tuple) else (arg,)
        results[name] = alone(lambda: fn(*args_), jax.block_until_ready, args.calls)
    t = torch.ones(4096, 2048, device="cuda", dtype=torch.bfloat16)
    results["torch x + 1, synchronize"] = alone(lambda: t + 1, lambda r: torch.cuda.synchronize(), args.calls)
    for name, ms in results.items():
        print(f"{ms:8.4f} ms  {name}")
    meta = {"torch": torch.__version__, "jax": jax.__version__, "device": torch.cuda.get_device_name(),
            "calls": args.calls}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "callback-overhead.json").write_text(json.dumps({"meta": meta, "median_ms": results}, indent=1))


if __name__ == "__main__":
    main()
