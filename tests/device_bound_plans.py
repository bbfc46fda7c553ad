"""Eager torch ``triton`` inference through bound plans (``moe_torch.backends.triton._Bound``) on the device (not
collected by pytest):

    python tests/device_bound_plans.py --out DIR

Checks, per point: the bound call's output bit-identical to the plan path's (the same kernels launched through
``run_plan``), with decode graphs off and on (a decode graph then captures the bound call); a kernel building tensor
descriptors on the device bound too (its global scratch per launch). Timing: the public call
(``moe_torch.experts_forward(..., implementation="triton")``) on the benchmark's kind of inputs, several input sets
(one routing each) in turn: alone (the GPU idle before it, the host clock to a device sync, as the benchmark's
``ms``) and back to back (per call), medians, for four variants: ``plan`` (binding switched off: the code before),
``bound``, each with the decode graphs on and off (on: ``triton`` given the other backends' bound, 8192 MiB, which
it had before the spec took its graphs away on these results). Writes ``DIR/bound-plans.json``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2),
          "deepseek-v3": (7168, 2048, 256, 8)}
POINTS = {"qwen3-30b-a3b": (1, 2, 4, 8, 16, 64, 256, 1024, 4096), "mixtral-8x7b": (1, 4, 64, 1024, 4096),
          "deepseek-v3": (1, 4, 64, 1024)}
VARIANTS = ("plan+graphs", "bound+graphs", "plan", "bound")
SETS = 8


def _weights(shape):
    import torch
    H, I, E, k = SHAPES[shape]
    g = torch.Generator("cuda").manual_seed(len(shape))
    return (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * H**-0.5,
            torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * I**-0.5)


def _sets(shape, T):
    import torch
    H, I, E, k = SHAPES[shape]
    g = torch.Generator("cuda").manual_seed(1000 + T)
    sets = []
    for _ in range(SETS):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1), k, -1)
        sets.append((x, idx, w.to(torch.bfloat16)))
    return sets


GRAPHS_MIB = 8192  # the decode graphs' bound of batched_mm and grouped_mm (and of triton's before)


class _Variant:
    """Switches binding (``_bind``) and the decode graphs for the calls made inside it."""

    def __init__(self, name):
        self.bound, self.graphs = name.startswith("bound"), name.endswith("+graphs")

    def __enter__(self):
        import moe_torch
        from moe_torch import api, graphs
        from moe_torch.backends import triton as backend
        self.saved = backend._bind, graphs.allowed
        if not self.bound:
            backend._bind = lambda *args: None
        if self.graphs:
            graphs.allowed = partial(_allowed_with_triton, graphs.allowed)
        backend._BOUND.clear()
        api._CHECKED.clear()  # it keeps whether a signature may run as a graph
        moe_torch.graphs.release()
        os.environ["MOE_TORCH_GRAPHS"] = "auto" if self.graphs else "off"
        return self

    def __exit__(self, *exc):
        import moe_torch
        from moe_torch import api, graphs
        from moe_torch.backends import triton as backend
        backend._bind, graphs.allowed = self.saved
        backend._BOUND.clear()
        api._CHECKED.clear()
        moe_torch.graphs.release()
        os.environ.pop("MOE_TORCH_GRAPHS", None)


def _allowed_with_triton(allowed, implementation, activation, gate_up_proj, down_proj, slots, training=False):
    """``allowed`` (``moe_torch.graphs.allowed``) with ``triton`` given GRAPHS_MIB for inference."""
    if implementation != "triton" or training:
        return allowed(implementation, activation, gate_up_proj, down_proj, slots, training)
    expert_bytes = (math.prod(gate_up_proj.shape[1:]) + math.prod(down_proj.shape[1:])) * gate_up_proj.element_size()
    return isinstance(activation, str) and 0 < slots * expert_bytes <= GRAPHS_MIB << 20


def _call(gate_up, down, inputs):
    import moe_torch
    x, idx, w = inputs
    return moe_torch.experts_forward(x, idx, w, gate_up, down, implementation="triton", validate=False)


def check_bits(shape, T, weights, sets) -> dict:
    """Outputs of every variant on every input set, against the plan path without graphs."""
    import torch
    outputs = {}
    for name in VARIANTS:
        with _Variant(name), torch.no_grad():
            outputs[name] = [[_call(*weights, s) for s in sets] for _ in range(3)]
    reference = outputs["plan"][0]
    return {name: all(torch.equal(a, b) for run in runs for a, b in zip(run, reference))
            for name, runs in outputs.items()}


def time_variant(name, weights, sets, rounds) -> dict:
    import torch
    from moe_torch.backends import triton as backend
    with _Variant(name), torch.no_grad():
        for s in sets * 2:
            _call(*weights, s)
        torch.cuda.synchronize()
        alone, back = [], []
        for _ in range(rounds):
            for s in sets:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                _call(*weights, s)
                torch.cuda.synchronize()
                alone.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for s in sets:
                _call(*weights, s)
            torch.cuda.synchronize()
            back.append((time.perf_counter() - t0) / len(sets))
        bound = sum(b is not None for b in backend._BOUND.values())
    return {"alone_ms": round(statistics.median(alone) * 1e3, 4), "back_to_back_ms":
            round(statistics.median(back) * 1e3, 4), "bound_keys": bound}


def descriptor_check() -> dict:
    """A plan whose GEMMs build tensor descriptors on the device (TMA weight tiles forced by an override), bound:
    the bits of its plan path."""
    from moe_shared.kernels import plan as plans
    shape, T = "qwen3-30b-a3b", 256
    H, I, E, k = SHAPES[shape]
    weights = _weights(shape)
    sets = _sets(shape, T)[:2]
    for kernel, N, K in (("gate_up", I, H), ("down", H, I)):
        plans.OVERRIDES[kernel, N, K, E] = plans.TileConfig(BM=64, BN=64, BK=64, num_warps=4, num_stages=3,
                                                            TMA=True)
    plans.clear_caches()
    try:
        result = check_bits(shape, T, weights, sets)
        from moe_torch.backends import triton as backend
        x, idx, w = sets[0]
        problem = backend.problem_of(x, idx, *weights, None, None, "silu")
        result["descriptor_steps"] = sum(plans.makes_tensor_descriptors(s) for s in plans.forward_plan(problem).steps)
    finally:
        plans.OVERRIDES.clear()
        plans.clear_caches()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    import torch
    import triton
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"meta": {"torch": torch.__version__, "triton": triton.__version__,
                        "device": torch.cuda.get_device_name(), "sets": SETS, "rounds": args.rounds,
                        "command": " ".join(sys.argv)}, "points": {}}
    started = time.time()
    results["descriptors"] = descriptor_check()
    print("descriptors", results["descriptors"], flush=True)
    for shape in args.shapes.split(","):
        weights = _weights(shape)
        for T in POINTS[shape]:
            sets = _sets(shape, T)
            point = {"bits": check_bits(shape, T, weights, sets)}
            for name in VARIANTS:
                point[name] = time_variant(name, weights, sets, args.rounds)
            results["points"][f"{shape} T={T}"] = point
            times = " ".join(f"{n}: {point[n]['alone_ms']:.4f}/{point[n]['back_to_back_ms']:.4f}" for n in VARIANTS)
            print(f"{shape:14s} T={T:5d} {times} bits {point['bits']}", flush=True)
            (out / "bound-plans.json").write_text(json.dumps(results, indent=1))
            del sets
        del weights
        torch.cuda.empty_cache()
    results["meta"]["seconds"] = round(time.time() - started, 1)
    (out / "bound-plans.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
