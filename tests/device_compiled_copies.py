"""Why a compiled training step copies: CUDA-graph input copies of a compiled (cudagraph) training step (not
collected by pytest):

    PYTHONPATH=. python tests/device_compiled_copies.py --out DIR [--mode reduce-overhead]

qwen3-30b-a3b shape, bf16, T=1, batched_mm ours and transformers', weights handed over as plain tensors that take
gradients (as the benchmark does), as ``nn.Parameter``s (as a model holds them) and as plain tensors marked static
(``torch._dynamo.mark_static_address``). For each: the step's time (CUDA events, synced), the device copies
(count, us) and inductor's count of the graph inputs it copies at every replay
(``cudagraph_recorded_non_static_inputs``). Writes DIR/compiled-copies.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch._dynamo.utils import counters

import device_decode_profile as ddp
import moe_torch
from bench.peers import transformers_peer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", default="reduce-overhead")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    gate_up, down = ddp.qwen3_weights(device)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, ddp.H, device=device, generator=gen).bfloat16().requires_grad_()
    w, idx = torch.topk(torch.softmax(torch.randn(1, ddp.E, device=device, generator=gen), -1), ddp.K, -1)
    w = w.bfloat16().requires_grad_()
    dy = torch.randn(1, ddp.H, device=device, generator=gen).bfloat16()
    theirs = transformers_peer("batched_mm")(ddp.E, ddp.H, ddp.I)

    def ours(*a):
        return moe_torch.experts_forward(*a, implementation="batched_mm", validate=False)

    def weights(kind):
        if kind == "parameter":
            return torch.nn.Parameter(gate_up.clone()), torch.nn.Parameter(down.clone())
        pair = gate_up.clone().requires_grad_(), down.clone().requires_grad_()
        if kind == "static":
            for t in pair:
                torch._dynamo.mark_static_address(t)
        return pair

    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "mode": args.mode, "runs": {}}
    for who, forward in (("ours", ours), ("transformers", theirs)):
        for kind in ("plain", "parameter", "static"):
            torch._dynamo.reset()
            counters.clear()
            wg, wd = weights(kind)
            compiled = torch.compile(forward, fullgraph=True, mode=args.mode)

            def step():
                out = compiled(x, idx, w, wg, wd)
                return torch.autograd.grad(out, [x, w, wg, wd], dy)
            ms, host_ms, launch_ms = ddp.timed(step, rounds=3, calls=10)
            prof = ddp.profiled(step)
            copies = [k for k in prof["kernels"] if k["name"].startswith("Memcpy")]
            run = {"ms": round(ms, 4), "host_ms": round(host_ms, 4), "launch_ms": round(launch_ms, 4),
                   "copies": copies, "kernel_us": prof["kernel_us"],
                   "non_static_inputs": counters["inductor"]["cudagraph_recorded_non_static_inputs"],
                   "inductor_counters": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}}
            results["runs"][f"{who} {kind}"] = run
            print(f"{who:12s} {kind:9s} {ms:7.3f} ms copies {copies} non-static inputs {run['non_static_inputs']} "
                  f"{run['inductor_counters']}", flush=True)
            (args.out / "compiled-copies.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
