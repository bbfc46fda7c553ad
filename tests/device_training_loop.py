"""A training loop on the GPU with training graphs on (the default) and off (not collected by pytest):

    PYTHONPATH=. python tests/device_training_loop.py --out DIR

``moe_torch.Experts`` at the qwen3-30b-a3b shape in bfloat16, for ``batched_mm`` and ``grouped_mm``: six optimizer
steps (SGD with momentum, updating the weights in place) on inputs that take gradients, T alternating between 4 and
1 (two signatures), the last two steps accumulating two micro-batches each. With ``MOE_TORCH_TRAINING_GRAPHS=auto``
the graphs read the weights where the optimizer updated them: every loss, the final weights and the inputs'
gradients must be the bits of the same loop with the setting ``off``; graphs must have been captured in the first
and none in the second. Also the median step time both ways. Writes DIR/training-loop.json.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

import device_decode_profile as ddp
import moe_torch

STEPS = 6


def loop(backend: str, setting: str, device) -> dict:
    os.environ[moe_torch.graphs.TRAINING_VARIABLE] = setting
    moe_torch.graphs.release()
    torch.manual_seed(0)
    module = moe_torch.Experts(ddp.E, ddp.H, ddp.I, experts_implementation=backend, device=device,
                               dtype=torch.bfloat16)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-2, momentum=0.9)
    gen = torch.Generator(device=device).manual_seed(1)
    losses, input_grads, times = [], [], []
    for step in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(2 if step >= STEPS - 2 else 1):
            T = 4 if step % 2 == 0 else 1
            x = torch.randn(T, ddp.H, device=device, generator=gen).bfloat16().requires_grad_()
            w, idx = torch.topk(torch.softmax(torch.randn(T, ddp.E, device=device, generator=gen), -1), ddp.K, -1)
            loss = module(x, idx, w.bfloat16()).float().square().mean()
            loss.backward()
            losses.append(loss.detach())
            input_grads.append(x.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return {"losses": losses, "input_grads": input_grads, "weights": [p.detach().clone() for p in module.parameters()],
            "graphs": moe_torch.graphs.count(), "step_ms": statistics.median(times[2:]), "each_step_ms": times}


def main() -> None:
    folder = ddp.out_folder()
    device = torch.device("cuda")
    checks, timings = [], {}
    for backend in ("batched_mm", "grouped_mm"):
        graphed, plain = loop(backend, "auto", device), loop(backend, "off", device)
        same = all(torch.equal(a, b) for key in ("losses", "input_grads", "weights")
                   for a, b in zip(graphed[key], plain[key], strict=True))
        ok = same and graphed["graphs"] > 0 and plain["graphs"] == 0
        checks.append({"name": f"{backend}: {STEPS} optimizer steps, graphs on and off, the same bits", "ok": ok,
                       "same_bits": same, "graphs_on": graphed["graphs"], "graphs_off": plain["graphs"],
                       "losses": [float(v) for v in graphed["losses"]]})
        timings[backend] = {"graphs": graphed["step_ms"], "plain": plain["step_ms"],
                            "graphs_each_step": graphed["each_step_ms"], "plain_each_step": plain["each_step_ms"]}
        print(("PASS " if ok else "FAIL ") + backend, checks[-1], timings[backend], flush=True)
    os.environ.pop(moe_torch.graphs.TRAINING_VARIABLE, None)
    print(ddp.write_checks(folder / "training-loop.json", "device_training_loop.py",
                           "ms: median wall time of an optimizer step from the third on (synced), and each step's", checks, "step_ms", timings)["summary"])


if __name__ == "__main__":
    main()
