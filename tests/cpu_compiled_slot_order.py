"""Compiled batched_mm on the CPU with its GEMVs in expert order against slot order, the whole inference forward
(not collected by pytest):

    python tests/cpu_compiled_slot_order.py --tokens 8,16,64 [--out FILE]

qwen3-cpu's shape (H=1024, I=384, E=64, k=8, bfloat16), both forms compiled (fullgraph, max-autotune) in one process,
timed in alternating rounds (median of each round's calls over three input sets); prints, and writes to ``--out``
as JSON, whether the two gave the same bits and each round's median in ms. What
``batched_mm.COMPILED_ORDERED_FROM_SLOTS_PER_EXPERT`` rests on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import moe_torch
from moe_torch.backends import batched_mm

H, I, E, K = 1024, 384, 64, 8
SETTINGS = {"expert order": {"cpu": 1}, "slot order": {}}


def _median_ms(fn, inputs, seconds: float) -> float:
    for args in inputs:
        fn(*args)
    times, i = [], 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        fn(*inputs[i % len(inputs)])
        times.append(time.perf_counter() - t0)
        i += 1
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="8,16,64")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=0.6, help="timed calls per form and round")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.03).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * 0.03).bfloat16()

    def forward(x, ids, w):
        return moe_torch.experts_forward(x, ids, w, gate_up, down, implementation="batched_mm")

    # traced once per form: each graph's guards hold the setting it was traced under
    compiled = torch.compile(forward, fullgraph=True, mode="max-autotune")
    result = {"meta": {"torch": torch.__version__, "threads": torch.get_num_threads(), "shape": [H, I, E, K],
                       "date": time.strftime("%Y-%m-%d %H:%M:%S")}, "points": {}}
    for T in (int(t) for t in args.tokens.split(",")):
        inputs = [((torch.randn(T, H, generator=g)).bfloat16(),
                   torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]),
                   torch.rand(T, K, generator=g)) for _ in range(3)]
        times, outs = {name: [] for name in SETTINGS}, {}
        with torch.no_grad():
            for name, setting in SETTINGS.items():
                batched_mm.COMPILED_ORDERED_FROM_SLOTS_PER_EXPERT = setting
                outs[name] = compiled(*inputs[0])
            for r in range(args.rounds):
                order = list(SETTINGS.items())
                for name, setting in order if r % 2 == 0 else order[::-1]:
                    batched_mm.COMPILED_ORDERED_FROM_SLOTS_PER_EXPERT = setting
                    times[name].append(round(_median_ms(compiled, inputs, args.seconds), 3))
        point = {"same bits": torch.equal(*outs.values()), "rounds ms": times,
                 "median ms": {name: round(statistics.median(v), 3) for name, v in times.items()}}
        result["points"][f"T={T}"] = point
        print(f"T={T}", point, flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
