"""Where a ``sonicmoe`` forward's host time goes, torch next to JAX (run on the lent H200; not collected by pytest):

    python tests/device_sonicmoe_host.py --out DIR [--tokens 4096] [--calls 50]

qwen3-30b-a3b shape, bf16 inference forward, the same inputs in both frameworks. Per framework, ``calls`` calls
issued back to back: the host time per call (torch: until the last launch returns; JAX: until the jitted call
returns) and the wall time per call once the device is done. Inside each call, with timers wrapped around them:
torch, buffer allocation and the steps (``moe_shared.sonic_steps.forward``); JAX, the callback as a whole, its
views of XLA's buffers (``torch_bridge.views``), the stream switch (``torch_bridge.on_xla_stream``) and the steps.
So a JAX call's extra host time splits into JAX's dispatch, the bridge and the same steps. Writes
``DIR/sonicmoe-host.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("QUACK_CACHE_AUTOTUNING", "1")

H, I, E, K = 2048, 768, 128, 8  # qwen3-30b-a3b


class Timers:
    def __init__(self):
        self.seconds = defaultdict(float)
        self.counts = defaultdict(int)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.counts[name] += 1
        return timed

    def wrap_context(self, name, factory):
        @contextlib.contextmanager
        def timed(*args, **kwargs):
            start = time.perf_counter()
            with factory(*args, **kwargs):
                self.seconds[name] += time.perf_counter() - start
                yield
        return timed

    def per_call(self, calls: int) -> dict:
        return {name: {"ms": self.seconds[name] * 1e3 / calls, "per_call": self.counts[name] / calls}
                for name in self.seconds}

    def reset(self):
        self.seconds.clear()
        self.counts.clear()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()
    import jax
    import jax.numpy as jnp
    import torch

    import moe_jax
    import moe_torch
    from moe_jax import torch_bridge
    from moe_jax.backends import sonicmoe as jax_sonic
    from moe_shared import sonic_steps
    from moe_torch.backends import sonicmoe as torch_sonic

    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(args.tokens, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w, ids = torch.topk(torch.softmax(torch.randn(args.tokens, E, device="cuda", generator=g), -1), K, dim=-1)
    w = w.to(torch.bfloat16)
    gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * H**-0.5
    down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * I**-0.5
    timers = Timers()
    steps_forward = sonic_steps.forward
    sonic_steps.forward = timers.wrap("steps", steps_forward)
    torch_sonic._allocate = timers.wrap("torch: allocate", torch_sonic._allocate)
    torch_bridge.views = timers.wrap("jax: views", torch_bridge.views)
    torch_bridge.on_xla_stream = timers.wrap_context("jax: stream switch", torch_bridge.on_xla_stream)
    forward_callback = jax_sonic._forward_callback

    def timed_callback(steps, activation):
        return timers.wrap("jax: callback", forward_callback(steps, activation))

    jax_sonic._forward_callback = timed_callback

    def torch_call():
        return moe_torch.experts_forward(x, ids, w, gate_up, down, implementation="sonicmoe", validate=False)

    arrays = [jnp.from_dlpack(t) for t in (x, ids.to(torch.int32), w, gate_up, down)]
    jitted = jax.jit(lambda *a: moe_jax.experts_forward(*a, implementation="sonicmoe"))

    def jax_call():
        return jitted(*arrays)

    results = {}
    with torch.no_grad():
        for name, call, wait in (("torch", torch_call, lambda r: torch.cuda.synchronize()),
                                 ("jax", jax_call, lambda r: jax.block_until_ready(r))):
            for _ in range(3):
                wait(call())
            torch.cuda.synchronize()
            timers.reset()
            start = time.perf_counter()
            outs = [call() for _ in range(args.calls)]
            issued = time.perf_counter()
            wait(outs[-1])
            torch.cuda.synchronize()
            done = time.perf_counter()
            results[name] = {"host_ms": (issued - start) * 1e3 / args.calls,
                             "wall_ms": (done - start) * 1e3 / args.calls, "inside": timers.per_call(args.calls)}
            del outs
    meta = {"torch": torch.__version__, "jax": jax.__version__, "device": torch.cuda.get_device_name(),
            "tokens": args.tokens, "calls": args.calls, "shape": {"H": H, "I": I, "E": E, "k": K}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sonicmoe-host.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    for name, r in results.items():
        print(f"{name:6} host {r['host_ms']:.3f} ms/call, wall {r['wall_ms']:.3f} ms/call")
        for part, v in sorted(r["inside"].items()):
            print(f"    {part:22} {v['ms']:.3f} ms/call ({v['per_call']:.0f}x)")


if __name__ == "__main__":
    main()
