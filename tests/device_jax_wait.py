"""How long a single jitted JAX call takes to be seen finished, by how it is waited for (on the device; not
collected by pytest):

    python tests/device_jax_wait.py --out DIR

A JAX call timed alone ends with ``block_until_ready``; earlier timelines found it returning 0.2-0.25 ms after the
call's last kernel at calls near 1 ms, with no CUDA call in between, while torch's synchronize returned 0.03-0.04
ms after. Each call here (the benchmark's JAX ``triton`` forward at several sizes, and XLA's own dot of about the
same lengths) is timed alone, the GPU idle before it, waited for in turn by:

- ``block_until_ready``: what a JAX user (and the benchmark) does;
- ``is_ready`` spin: Python polling the output's readiness flag;
- ``device sync``: ``torch.cuda.synchronize()`` alone (the primary context, so XLA's streams too; under JAX's
  synchronous dispatch the call's launches are issued before it returns): when the GPU work ended;
- ``device sync, then block``: the same, then ``block_until_ready``.

XLA marks a result ready from a CUDA host function queued behind the call (``cuLaunchHostFunc`` on a callback
stream, handed on to a worker thread), and ``is_ready`` and ``block_until_ready`` both read that state, so the
first two show the same chain and ``device sync`` shows the call without it.

Writes ``DIR/<--name>.json`` (``jax-wait``) after each call; prints each call's medians (ms, alternating rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

POINTS = (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 4096), ("mixtral-8x7b", 4096))
DOTS = (1024, 4096, 8192, 12288)
# how the JAX GPU client waits for and runs a call: the host function's spin-wait (CUDA >= 13.2) and the TFRT GPU
# client in place of the stream-executor one (read by jax's CUDA plugin when the client is made)
CLIENT_VARIABLES = ("XLA_CUDA_HOST_CALLBACK_SPINWAIT", "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT")


def _runtime() -> dict:
    """The GPU client that runs the calls, as jax reports it."""
    import jax
    client = jax.devices()[0].client
    return {name: str(getattr(client, name, None)) for name in ("runtime_type", "platform_version")}


def waits():
    import jax
    import torch

    def block(out):
        jax.block_until_ready(out)

    def spin(out):
        leaves = jax.tree_util.tree_leaves(out)
        while not all(leaf.is_ready() for leaf in leaves):
            pass

    def device_sync(out):
        torch.cuda.synchronize()

    def device_sync_then_block(out):
        torch.cuda.synchronize()
        jax.block_until_ready(out)

    return {"block_until_ready": block, "is_ready spin": spin, "device sync": device_sync,
            "device sync, then block": device_sync_then_block}


def time_alone(call, wait_by, rounds=8, calls=10):
    import torch
    for wait in wait_by.values():
        for _ in range(3):
            wait(call())
    times = {name: [] for name in wait_by}
    for r in range(rounds):
        order = list(wait_by.items())
        for name, wait in (order if r % 2 == 0 else order[::-1]):
            for _ in range(calls):
                torch.cuda.synchronize()
                time.sleep(0.0005)
                t0 = time.perf_counter()
                wait(call())
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: round(statistics.median(v), 4) for name, v in times.items()}


def main():
    import jax
    import jax.numpy as jnp
    import torch
    import moe_jax
    import moe_torch
    from device_triton_check import _jax_point, _point

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="jax-wait")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    wait_by = waits()
    result = {"meta": {"jax": jax.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                       **{name: os.environ.get(name, "") for name in CLIENT_VARIABLES},
                       "runtime": _runtime(),
                       "command": "python tests/device_jax_wait.py --out DIR"},
              "calls": {}}

    def record(name, times):
        result["calls"][name] = times
        print(name, times, flush=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")

    def forward(x, idx, w, gate_up, down):
        return moe_jax.experts_forward(x, idx, w, gate_up, down, implementation="triton", validate=False)

    def torch_forward(x, idx, w, gate_up, down):
        with torch.no_grad():
            return moe_torch.experts_forward(x, idx, w, gate_up, down, implementation="triton", validate=False)

    jitted = jax.jit(forward)
    for shape, T in POINTS:
        arrays = _jax_point(shape, T)[:5]
        name = f"triton forward {shape} T={T}"
        times = time_alone(lambda: jitted(*arrays), wait_by)
        (gate_up, down), (x, idx, w, _) = _point(shape, T)
        times["torch, synchronize"] = time_alone(
            lambda: torch_forward(x, idx, w, gate_up, down), {"sync": lambda out: torch.cuda.synchronize()})["sync"]
        record(name, times)
    dot = jax.jit(lambda a, b: a @ b)
    key = jax.random.PRNGKey(0)
    for n in DOTS:
        a = jax.random.normal(key, (4096, 4096), jnp.bfloat16)
        b = jax.random.normal(key, (4096, n), jnp.bfloat16)
        record(f"XLA dot 4096x4096x{n}", time_alone(lambda: dot(a, b), wait_by))
    one = jnp.ones((1,), jnp.float32)
    add = jax.jit(lambda v: v + 1)
    record("one-element add", time_alone(lambda: add(one), wait_by))


if __name__ == "__main__":
    main()
