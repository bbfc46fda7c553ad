"""Which route from JAX into SonicMoE's steps costs less host time (run on the lent H200; not collected by pytest):

    python tests/device_sonicmoe_routes.py --out DIR [--tokens 4096] [--calls 50] [--quack-configs first]

moe_jax's ``sonicmoe`` runs its steps in a ``jax.experimental.buffer_callback``. That puts a Python host callback
in the executable, and jit then dispatches every call through its Python path (``pxla.create_cpp_call`` returns
None for an executable with host callbacks), while the callback itself waits for the GIL that the dispatching
thread holds. The other route the issue names registers the Python function as an XLA FFI target through
``jax_tvm_ffi`` (an FFI handler that calls a ``tvm_ffi.Function``; no JAX host callback, so jit keeps its C++
dispatch). ``ffi_callback`` below is a stand-in for ``buffer_callback`` with that route (same buffers, same
callback, XLA's stream from ``ctx.stream``); it gave the same bits as ``buffer_callback`` on the CPU with the
stand-in steps of ``fake_sonicmoe``, forward and backward.

qwen3-30b-a3b shape, bf16 inference forward. For torch and for each JAX route: ``calls`` calls issued back to back
(host time per call, and wall time per call once the device is done) and 30 calls each timed alone to the end
(median); the routes are timed twice, interleaved, and their outputs compared bit for bit with each other and with
torch's. Writes ``DIR/sonicmoe-routes.json`` and prints a line per series. ``--quack-configs first`` pins every
quack GEMM to its first valid config (as ``device_sonicmoe_check.py`` does): a fresh machine's autotuning took
longer than 150 s for this shape; the routes differ on the host only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("QUACK_CACHE_AUTOTUNING", "1")

from device_sonicmoe_host import E, H, I, K, qwen3_inputs  # noqa: E402

_TARGETS = itertools.count()


def ffi_callback(callback, result_types, platform: str = "gpu"):
    """``jax.experimental.buffer_callback(callback, result_types)`` through a jax_tvm_ffi FFI target: ``callback(ctx,
    outputs, *inputs)`` gets the buffers as tvm_ffi tensors (DLPack) and ``ctx.stream``, XLA's stream."""
    import jax
    import jax_tvm_ffi
    import tvm_ffi
    out_leaves, out_tree = jax.tree.flatten(result_types)

    def call(*args):
        in_leaves, in_tree = jax.tree.flatten(args)
        count = len(in_leaves)

        def target(stream, *tensors):
            callback(SimpleNamespace(stream=stream), jax.tree.unflatten(out_tree, list(tensors[count:])),
                     *jax.tree.unflatten(in_tree, list(tensors[:count])))

        name = f"moe_experts_sonicmoe_{next(_TARGETS)}"
        jax_tvm_ffi.register_ffi_target(name, tvm_ffi.convert(target), ["ctx.stream", "args", "rets"],
                                        platform=platform, pass_owned_tensor=True)
        return jax.tree.unflatten(out_tree, list(jax.ffi.ffi_call(name, out_leaves)(*in_leaves)))

    return call


def measure(call, wait, calls: int) -> dict:
    for _ in range(3):
        wait(call())
    start = time.perf_counter()
    outs = [call() for _ in range(calls)]
    issued = time.perf_counter()
    wait(outs[-1])
    done = time.perf_counter()
    alone = []
    for _ in range(30):
        begin = time.perf_counter()
        wait(call())
        alone.append(time.perf_counter() - begin)
    return {"host_ms": (issued - start) * 1e3 / calls, "wall_ms": (done - start) * 1e3 / calls,
            "alone_median_ms": float(np.median(alone)) * 1e3}, outs[-1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--quack-configs", choices=("first", "tuned"), default="first")
    args = p.parse_args()
    if args.quack_configs == "first":
        from device_sonicmoe_check import pin_first_quack_configs
        pin_first_quack_configs()
    import jax
    import jax.numpy as jnp
    import torch

    import moe_jax
    import moe_torch
    from moe_jax.backends import sonicmoe as jax_sonic

    x, ids, w, gate_up, down = qwen3_inputs(args.tokens)
    arrays = [jnp.from_dlpack(t) for t in (x, ids.to(torch.int32), w, gate_up, down)]
    routes = {"buffer_callback": jax_sonic.buffer_callback, "tvm-ffi": ffi_callback}
    jitted = {}
    for name, route in routes.items():
        jax_sonic.buffer_callback = route  # traced now: the route is baked into this jitted function
        jitted[name] = jax.jit(lambda *a: moe_jax.experts_forward(*a, implementation="sonicmoe"))
        jax.block_until_ready(jitted[name](*arrays))
    results, outputs = {}, {}
    with torch.no_grad():
        results["torch"], torch_out = measure(
            lambda: moe_torch.experts_forward(x, ids, w, gate_up, down, implementation="sonicmoe", validate=False),
            lambda r: torch.cuda.synchronize(), args.calls)
        print("torch", results["torch"], flush=True)
        for round_ in (1, 2):
            for name, fn in jitted.items():
                key = f"jax {name} round {round_}"
                results[key], outputs[name] = measure(lambda fn=fn: fn(*arrays), jax.block_until_ready, args.calls)
                print(key, results[key], flush=True)
    as_numpy = {n: np.asarray(o.astype(jnp.float32)) for n, o in outputs.items()}
    results["identical"] = {"tvm-ffi_vs_buffer_callback": bool(np.array_equal(as_numpy["tvm-ffi"],
                                                                               as_numpy["buffer_callback"])),
                            "tvm-ffi_vs_torch": bool(np.array_equal(as_numpy["tvm-ffi"],
                                                                     torch_out.float().cpu().numpy()))}
    print(results["identical"])
    meta = {"torch": torch.__version__, "jax": jax.__version__, "device": torch.cuda.get_device_name(),
            "tokens": args.tokens, "calls": args.calls, "shape": {"H": H, "I": I, "E": E, "k": K},
            "quack_configs": args.quack_configs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sonicmoe-routes.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
