"""batched_mm's training step on the lent H200 (not collected by pytest):

    python tests/device_batched_step.py --out FILE

qwen3-30b-a3b shape, bf16, T = 1, 4, 16: one training step (forward, then ``torch.autograd.grad`` of the hidden
states, routing weights and both weight tensors) through ``experts_forward`` (one autograd node,
``batched_mm._TrainingStep``), through the composed path (``batched_mm._composed_forward``: each step recorded by
autograd) and through transformers' ``batched_mm``, on the same inputs. Checks that the two paths give the same
bits (output and four gradients) and times each step synced, five interleaved rounds of 30 calls (median, ms).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import moe_torch
from bench.peers import transformers_peer
from moe_torch import base
from moe_torch.backends import batched_mm

E, H, I, K = 128, 2048, 768, 8  # qwen3-30b-a3b


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, device=device, generator=gen) / H ** 0.5).bfloat16().requires_grad_()
    down = (torch.randn(E, H, I, device=device, generator=gen) / I ** 0.5).bfloat16().requires_grad_()
    theirs = transformers_peer("batched_mm")(E, H, I)
    results = {}
    for tokens in (1, 4, 16):
        x = torch.randn(tokens, H, device=device, generator=gen).bfloat16().requires_grad_()
        w, idx = torch.topk(torch.softmax(torch.randn(tokens, E, device=device, generator=gen), -1), K, -1)
        w = w.bfloat16().requires_grad_()
        grad_out = torch.randn(tokens, H, device=device, generator=gen).bfloat16()
        paths = {
            "one_node": lambda: moe_torch.experts_forward(x, idx, w, gate_up, down, implementation="batched_mm",
                                                          validate=False),
            "composed": lambda: batched_mm._composed_forward(x, base.Slots(idx, E), w, gate_up, down, "silu",
                                                             None, None),
            "transformers": lambda: theirs(x, idx, w, gate_up, down)}

        def step(path):
            out = paths[path]()
            return (out, *torch.autograd.grad(out, (x, w, gate_up, down), grad_out))

        same = all(torch.equal(a, b) for a, b in zip(step("one_node"), step("composed")))
        samples = {path: [] for path in paths}
        for _ in range(5):
            for path in paths:
                for _ in range(5):
                    step(path)
                torch.cuda.synchronize()
                for _ in range(30):
                    start = time.perf_counter()
                    step(path)
                    torch.cuda.synchronize()
                    samples[path].append((time.perf_counter() - start) * 1e3)
        median = {path: sorted(v)[len(v) // 2] for path, v in samples.items()}
        results[tokens] = {"same_bits_one_node_composed": same, "median_ms": median}
        print(f"T={tokens} same bits: {same}", {p: round(v, 3) for p, v in median.items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
