"""A graph call's input copies, one multi-tensor copy per dtype against one copy per input (not collected by pytest):

    PYTHONPATH=. python tests/device_graph_copies.py --out DIR

qwen3-30b-a3b shape, bf16, decode graphs (inference: ``batched_mm``, ``grouped_mm``, ``triton`` at T = 1, 4) and
training graphs (``batched_mm``, ``grouped_mm`` at T = 1), ``moe_torch.graphs.FOREACH_COPIES`` on and off, three
interleaved rounds of device_decode_profile's timer (CUDA events around a call, host time up to its result, host time
until it returned); the outputs (and gradients) must be the same bits both ways. Writes DIR/graph-copies.json.
"""

from __future__ import annotations

import torch

import device_decode_profile as ddp
import moe_torch

NAMES = ("hidden_states", "top_k_weights", "gate_up_proj", "down_proj")


def main() -> None:
    folder = ddp.out_folder()
    device = torch.device("cuda")
    gate_up, down = ddp.qwen3_weights(device)
    gen = torch.Generator(device=device).manual_seed(2)
    checks, timings = [], {}
    paths = []
    for backend in ("batched_mm", "grouped_mm", "triton"):
        for T in (1, 4):
            paths.append((f"{backend} fwd T={T}", backend, T, False))
    for backend in ("batched_mm", "grouped_mm"):
        paths.append((f"{backend} fwd+bwd T=1", backend, 1, True))
    for name, backend, T, train in paths:
        x = torch.randn(T, ddp.H, device=device, generator=gen).bfloat16()
        w, idx = torch.topk(torch.softmax(torch.randn(T, ddp.E, device=device, generator=gen), -1), ddp.K, -1)
        tensors = {"hidden_states": x, "top_k_index": idx, "top_k_weights": w.bfloat16(), "gate_up_proj": gate_up,
                   "down_proj": down}
        if train:
            tensors = {n: t if n == "top_k_index" else t.detach().requires_grad_() for n, t in tensors.items()}
        dy = torch.randn(T, ddp.H, device=device, generator=gen).bfloat16()

        def call():
            if train:
                out = moe_torch.experts_forward(**tensors, implementation=backend, validate=False)
                return (out, *torch.autograd.grad(out, [tensors[n] for n in NAMES], dy))
            with torch.no_grad():
                return (moe_torch.experts_forward(**tensors, implementation=backend, validate=False),)
        results, rows = {}, {"foreach": [], "each": []}
        for _ in range(3):
            for label, flag in (("foreach", True), ("each", False)):
                moe_torch.graphs.FOREACH_COPIES = flag
                results[label] = call()
                rows[label].append(ddp.timed(call, rounds=1, calls=30))
        moe_torch.graphs.FOREACH_COPIES = True
        same = all(torch.equal(a, b) for a, b in zip(results["foreach"], results["each"], strict=True))
        checks.append({"name": f"{name}: the same bits both ways", "ok": same, "graphs": moe_torch.graphs.count()})
        timings[name] = {label: [sorted(r[i] for r in runs)[1] for i in range(3)] for label, runs in rows.items()}
        print(("PASS " if same else "FAIL ") + name, {k: [round(v, 4) for v in vals]
                                                      for k, vals in timings[name].items()}, flush=True)
    print(ddp.write_checks(folder / "graph-copies.json", "device_graph_copies.py",
                           "ms, median of three rounds: [CUDA events around a call, host up to its result, host "
                           "until the call returned]", checks, "timings_ms", timings)["summary"])


if __name__ == "__main__":
    main()
