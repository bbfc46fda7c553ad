"""The fixed cost of a jitted JAX call on the GPU, timed alone (run on the lent H200; not collected by pytest):

    python tests/device_callback_overhead.py --out DIR [--calls 200]

What a ``sonicmoe`` call pays before and after its kernels, piece by piece, each call timed from the call to its
result being ready (median), as the benchmark's ``ms`` column times a JAX call: a jitted ``x + 1``; a jitted
``buffer_callback`` that does nothing; the same callback viewing its buffers with torch on XLA's stream; the shared
routing kernels alone (qwen3-30b-a3b at T=4096; left out where triton is not installed); and
torch's ``x + 1`` with a synchronize. Then the same for a call that keeps the GPU busy for about 0.6 ms, a bf16
matmul [4096, 2048] @ [2048, 24576]: XLA's own dot, torch's with a synchronize, and torch's inside a
``buffer_callback`` through ``torch_bridge.graphed_callback`` (its CUDA graph replayed, as a ``sonicmoe`` call's
steps are), also with two more outputs the size of a qwen3-30b-a3b T=4096 forward's scratch that the jitted call
drops, and with the graphs off. So a JAX call's extra time splits into what any jitted call of that length pays
and what the bridge adds. Each JAX series also records when the call returned, before its result was ready
(``returned_ms``). Writes ``DIR/callback-overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def alone(call, wait, calls: int) -> tuple[float, float]:
    """Median ms of ``calls`` calls each timed from the call to its result being ready, and to the call's return."""
    for _ in range(10):
        wait(call())
    times, returned = [], []
    for _ in range(calls):
        begin = time.perf_counter()
        result = call()
        returned.append(time.perf_counter() - begin)
        wait(result)
        times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2] * 1e3, sorted(returned)[len(returned) // 2] * 1e3


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

    x = jnp.ones((4096, 2048), jnp.bfloat16)
    kind = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def nothing(ctx, out, x):
        pass

    def views(ctx, out, x):
        with torch_bridge.on_xla_stream(ctx, x):
            torch_bridge.views({"x": x, "out": out})

    series = {
        "jax x + 1": (jax.jit(lambda x: x + 1), x),
        "jax buffer_callback, nothing": (jax.jit(lambda x: buffer_callback(nothing, kind)(x)), x),
        "jax buffer_callback, torch views on XLA's stream": (jax.jit(lambda x: buffer_callback(views, kind)(x)), x),
    }
    try:
        from moe_jax.backends import sonicmoe as jax_sonic
        import triton  # noqa: F401
    except ImportError as err:
        skipped = {"jax routing kernels": f"not measured: {err}"}
    else:
        skipped = {}
        ids = jax.random.randint(jax.random.key(0), (4096, 8), 0, 128, jnp.int32)
        w = jax.random.uniform(jax.random.key(1), (4096, 8), jnp.float32)
        series["jax routing kernels"] = (jax.jit(lambda ids, w: jax_sonic._routing(ids, w, 128)), (ids, w))
    a = jax.random.normal(jax.random.key(2), (4096, 2048), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (2048, 24576), jnp.bfloat16)
    product = jax.ShapeDtypeStruct((4096, 24576), jnp.bfloat16)
    matmul = torch_bridge.graphed_callback(lambda t, m, o: torch.matmul(t["a"], t["b"], out=o["out"]))
    graphed = jax.jit(lambda a, b: buffer_callback(matmul, {"out": product})({"a": a, "b": b}, {})["out"])
    scratch = {"out": product, "slot_out": jax.ShapeDtypeStruct((32768, 2048), jnp.bfloat16),
               "postact": jax.ShapeDtypeStruct((32768, 768), jnp.bfloat16)}  # a qwen3 T=4096 forward's scratch
    with_scratch = jax.jit(lambda a, b: buffer_callback(matmul, scratch)({"a": a, "b": b}, {})["out"])
    series |= {"jax matmul 4096x2048x24576 (XLA)": (jax.jit(jnp.matmul), (a, b)),
               "jax matmul 4096x2048x24576 (torch in graphed_callback)": (graphed, (a, b)),
               "jax matmul 4096x2048x24576 (torch in graphed_callback, two unused scratch outputs)":
                   (with_scratch, (a, b))}
    results, returned = {}, {}
    for name, (fn, arg) in series.items():
        args_ = arg if isinstance(arg, tuple) else (arg,)
        results[name], returned[name] = alone(lambda: fn(*args_), jax.block_until_ready, args.calls)
    torch_bridge.CALLBACK_GRAPHS = False
    name = "jax matmul 4096x2048x24576 (torch in graphed_callback, graphs off)"
    results[name], returned[name] = alone(lambda: graphed(a, b), jax.block_until_ready, args.calls)
    torch_bridge.CALLBACK_GRAPHS = True
    t = torch.ones(4096, 2048, device="cuda", dtype=torch.bfloat16)
    results["torch x + 1, synchronize"] = alone(lambda: t + 1, lambda r: torch.cuda.synchronize(), args.calls)[0]
    ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
    results["torch matmul 4096x2048x24576, synchronize"] = alone(lambda: ta @ tb, lambda r: torch.cuda.synchronize(),
                                                                  args.calls)[0]
    for name, ms in results.items():
        print(f"{ms:8.4f} ms  {name}" + (f" (returned {returned[name]:.4f})" if name in returned else ""))
    meta = {"torch": torch.__version__, "jax": jax.__version__, "device": torch.cuda.get_device_name(),
            "calls": args.calls}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "callback-overhead.json").write_text(json.dumps(
        {"meta": meta, "median_ms": results, "returned_median_ms": returned, "not_measured": skipped}, indent=1))


if __name__ == "__main__":
    main()
