"""The GPU timeline of several triton forward calls in one captured program, torch and JAX (run on the lent GPU;
not collected by pytest):

    python tests/device_program_timeline.py --out DIR [--tokens 1,4] [--calls 3]

The benchmark's graphed_ms for JAX (a jitted function of three input sets' calls) read 0.045 ms a call at
qwen3-30b-a3b T=1 on an H100 against 0.033 for torch's CUDA graph of the same calls, with the same kernels taking
the same time in both (tests/device_results/nvidia-h100-triton-framework-kernels*.json). Here torch.profiler
(CUPTI sees XLA's launches too) records the kernels of one execution of each program: every kernel's start and
duration, and the idle time between consecutive kernels, per framework."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import moe_jax  # noqa: E402
import moe_torch  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2),
          "deepseek-v3": (7168, 2048, 256, 8)}
H, I, E, K = SHAPES["qwen3-30b-a3b"]


def inputs(T, n, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * H ** -0.5
    down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * I ** -0.5
    sets = []
    for _ in range(n):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1), K, -1)
        sets.append((x, idx.to(torch.int32), w.to(torch.bfloat16)))
    return gate_up, down, sets


def timeline(run, repeats=5) -> list[dict]:
    """Kernels of the last of ``repeats`` executions of ``run`` (each followed by a sync): name, start (us, from
    the first kernel of that execution), duration, idle before it."""
    for _ in range(3):
        run()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run()
            torch.cuda.synchronize()
    kernels = sorted(((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                      if ev.device_type.name == "CUDA"), key=lambda k: k[0])
    per_run = len(kernels) // repeats
    last = kernels[-per_run:]
    origin, previous_end, rows = last[0][0], None, []
    for start, end, name in last:
        rows.append({"kernel": name[:60], "start_us": round(start - origin, 2), "us": round(end - start, 2),
                     "idle_before_us": None if previous_end is None else round(start - previous_end, 2)})
        previous_end = end
    return rows


def summary(rows, calls):
    busy = sum(r["us"] for r in rows)
    idle = sum(r["idle_before_us"] or 0 for r in rows)
    return {"kernels": len(rows), "busy_us_per_call": round(busy / calls, 2),
            "idle_us_per_call": round(idle / calls, 2),
            "span_us_per_call": round((rows[-1]["start_us"] + rows[-1]["us"]) / calls, 2)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--config", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    args = p.parse_args()
    global H, I, E, K
    H, I, E, K = SHAPES[args.config]
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"config": args.config, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "jax": jax.__version__, "command": " ".join(sys.argv), "points": []}
    for T in map(int, args.tokens.split(",")):
        gate_up, down, sets = inputs(T, args.calls)

        def torch_program():
            with torch.no_grad():
                return [moe_torch.experts_forward(x, i, w, gate_up, down, implementation="triton", validate=False)
                        for x, i, w in sets]
        torch_program()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            torch_outs = torch_program()

        jax_sets = [tuple(jax.dlpack.from_dlpack(t.contiguous()) for t in s) for s in sets]
        jax_weights = [jax.dlpack.from_dlpack(t) for t in (gate_up, down)]

        def program(gate_up, down, *flat):
            return [moe_jax.experts_forward(*flat[3 * j:3 * j + 3], gate_up, down, implementation="triton",
                                            validate=False) for j in range(len(flat) // 3)]
        def chained(gate_up, down, *flat):  # the benchmark's graphed_ms program: one result, hidden states chained
            x = flat[0]
            for j in range(len(flat) // 3):
                x = moe_jax.experts_forward(x, *flat[3 * j + 1:3 * j + 3], gate_up, down, implementation="triton",
                                            validate=False)
            return x
        flat = [a for s in jax_sets for a in s]
        executable = jax.jit(program).lower(*jax_weights, *flat).compile()
        chain = jax.jit(chained).lower(*jax_weights, *flat).compile()
        jax_outs = executable(*jax_weights, *flat)
        graph.replay()
        torch.cuda.synchronize()
        same = all(np.array_equal(t.float().cpu().numpy(), np.asarray(j.astype(np.float32)))
                   for t, j in zip(torch_outs, jax_outs))
        point = {"T": T, "calls": args.calls, "bit_identical": same}
        for name, run in (("torch_cuda_graph", graph.replay),
                          ("jax_jitted", lambda: jax.block_until_ready(executable(*jax_weights, *flat))),
                          ("jax_jitted_chained", lambda: jax.block_until_ready(chain(*jax_weights, *flat)))):
            rows = timeline(run)
            point[name] = {"summary": summary(rows, args.calls), "rows": rows}
            print(T, name, point[name]["summary"], flush=True)
            for r in rows:
                print("   ", r, flush=True)
        hlo = executable.as_text()
        point["jax_hlo_ops"] = {op: hlo.count(f" {op}(") for op in ("custom-call", "fusion", "copy", "command_buffer",
                                                                      "convert", "bitcast")}
        print(T, point["jax_hlo_ops"], flush=True)
        results["points"].append(point)
        (args.out / "program_timeline.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
