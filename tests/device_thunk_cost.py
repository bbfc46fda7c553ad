"""What one more custom call costs inside a jitted JAX program (run on the lent GPU; not collected by pytest):

    python tests/device_thunk_cost.py --out DIR

A chain of n launches of a one-program Triton kernel (each reading the last one's output) through moe_jax's
launcher, one custom call each, timed on the host's clock until ready: (t(n=41) - t(n=1)) / 40 per call, against
against the same chain from torch: replayed as one CUDA graph (the kernel's device time and the gaps), and
launched eagerly through triton's launch wrapper."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import torch
import triton
import triton.language as tl

from moe_jax import triton_call


@triton.jit
def bump(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + 1.0)


@triton.jit
def bump_many(x_ptr, a_ptr, b_ptr, c_ptr, d_ptr, e_ptr, f_ptr, out_ptr, side_ptr, BLOCK: tl.constexpr):
    """bump with six more operands it does not read and a second result, as a decode launch has (7 operands)."""
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + 1.0)


def jax_chain_many(n, target):
    def f(x, *others):
        for _ in range(n):
            x, _ = triton_call.launch(bump_many, 1, [x, *others], [jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2,
                                      {"BLOCK": 1024}, num_warps=4, num_stages=1, target=target)
        return x
    return f


def jax_chain(n, target):
    def f(x):
        for _ in range(n):
            (x,) = triton_call.launch(bump, 1, [x], [jax.ShapeDtypeStruct(x.shape, x.dtype)], {"BLOCK": 1024},
                                      num_warps=4, num_stages=1, target=target)
        return x
    return f


def clock(fn, reps=200):
    for _ in range(10):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    x = jnp.zeros(1024, jnp.float32)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for target in (triton_call.LAUNCH_TARGET, triton_call.GRAPHED_LAUNCH_TARGET):
        times = {}
        for n in (1, 41):
            ex = jax.jit(jax_chain(n, target)).lower(x).compile()
            out = ex(x)
            assert float(out[0]) == n, (n, float(out[0]))
            times[n] = clock(lambda ex=ex: jax.block_until_ready(ex(x)))
        result[target] = {"ms_n1": times[1], "ms_n41": times[41], "us_per_call": (times[41] - times[1]) / 40 * 1e3}
        print(target, result[target], flush=True)
    others = [jnp.zeros(1024, jnp.float32) + i for i in range(6)]
    times = {}
    for n in (1, 41):
        ex = jax.jit(jax_chain_many(n, triton_call.LAUNCH_TARGET)).lower(x, *others).compile()
        times[n] = clock(lambda ex=ex: jax.block_until_ready(ex(x, *others)))
    result["seven_operands_two_results"] = {"ms_n1": times[1], "ms_n41": times[41],
                                            "us_per_call": (times[41] - times[1]) / 40 * 1e3}
    print("seven operands", result["seven_operands_two_results"], flush=True)
    t = torch.zeros(1024, device="cuda")
    outs = [torch.empty_like(t) for _ in range(41)]

    def torch_chain(n):
        src = t
        for i in range(n):
            bump[(1,)](src, outs[i], BLOCK=1024, num_warps=4)
            src = outs[i]
    torch_chain(41)
    torch.cuda.synchronize()
    times = {}
    for n in (1, 41):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch_chain(n)
        times[n] = clock(lambda g=g: (g.replay(), torch.cuda.synchronize()))
    result["torch_cuda_graph"] = {"ms_n1": times[1], "ms_n41": times[41],
                                  "us_per_call": (times[41] - times[1]) / 40 * 1e3}
    times = {n: clock(lambda n=n: (torch_chain(n), torch.cuda.synchronize())) for n in (1, 41)}
    result["torch_eager_triton_launch"] = {"ms_n1": times[1], "ms_n41": times[41],
                                           "us_per_call": (times[41] - times[1]) / 40 * 1e3}
    print(json.dumps(result, indent=1))
    (args.out / "thunk_cost.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
