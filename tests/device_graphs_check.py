"""Decode graphs on the GPU (moe_torch.graphs; not collected by pytest):

    PYTHONPATH=. python tests/device_graphs_check.py --out DIR

qwen3-30b-a3b shape, bf16, inference, for each backend the spec declares graphs for (batched_mm, grouped_mm and,
where triton is installed, triton) and T = 1, 4, 8, 16, 64 (graphs where the backend's bound allows: every T here
with the bounds of 2026-12-06; beyond a bound, checked that nothing is captured):
- bits: three calls on different inputs (a quarter of the slots -1 in the last) through the graph equal the plain
  call (``MOE_TORCH_GRAPHS=off``) on the same inputs, under ``torch.no_grad`` and under ``torch.inference_mode``;
  one graph captured per (backend, T) within the bound, none beyond; after an in-place update of the down weights
  the graph's output equals the plain call's on the updated weights;
- a capture of the caller's own around the call (``torch.cuda.graph``) replays the plain call's bits and leaves the
  decode graphs alone;
- time: the call with and without its graph and transformers' same-named backend (batched_mm, grouped_mm) one call
  at
  a time, synced (CUDA events around the call, median of 5 rounds of 30 calls; and the host time of the call);
- memory: what the captures reserved (``torch.cuda.memory_reserved``) and the graphs kept.
Writes DIR/graphs-check.json; prints each check and a table.
"""

from __future__ import annotations

import json
import os
import time

import torch

import device_decode_profile  # the script beside this one (sys.path[0])
import moe_torch
from bench.peers import transformers_peer
from moe_shared.spec import load_spec

E, H, I, K = device_decode_profile.E, device_decode_profile.H, device_decode_profile.I, device_decode_profile.K


def plain(call):
    os.environ[moe_torch.graphs.VARIABLE] = "off"
    try:
        return call()
    finally:
        os.environ[moe_torch.graphs.VARIABLE] = "auto"


def timed(call) -> tuple[float, float]:
    """(median ms between CUDA events around one call, median host ms up to its result): device_decode_profile's."""
    return device_decode_profile.timed(call)[:2]


def main() -> None:
    folder = device_decode_profile.out_folder()
    device = torch.device("cuda")
    gate_up, down = device_decode_profile.qwen3_weights(device)
    spec = load_spec()
    backends = [name for name in spec.backend_names("torch") if "cuda" in spec.backends[name].frameworks["torch"].graphs
                and moe_torch.available_backends("cuda").get(name) is None]
    expert_mib = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size() / 2**20
    theirs = {name: transformers_peer(name)(E, H, I) for name in ("batched_mm", "grouped_mm")}
    checks, timings = [], {}

    check = device_decode_profile.recorder(checks)

    def inputs(T: int, seed: int, empties: bool = False):
        g = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(T, H, device=device, generator=g).bfloat16()
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device, generator=g), -1), K, -1)
        if empties:
            idx = idx.masked_fill(torch.rand(T, K, device=device, generator=g) < 0.25, -1)
        return x, idx, w.bfloat16()

    reserved_before = torch.cuda.memory_reserved()
    for backend in backends:
        for T in (1, 4, 8, 16, 64):
            graphed = T * K * expert_mib <= spec.backends[backend].frameworks["torch"].graphs["cuda"]

            def ours(x, idx, w, b=backend):
                return moe_torch.experts_forward(x, idx, w, gate_up, down, implementation=b)
            before = moe_torch.graphs.count()
            for context in (torch.no_grad, torch.inference_mode):
                same = []
                for seed in range(3):
                    args_ = inputs(T, seed, empties=seed == 2)
                    with context():
                        want = plain(lambda: ours(*args_))
                        got = ours(*args_)
                    same.append(torch.equal(got, want))
                check(f"{backend} T={T} {context.__name__}: graph bits == plain bits on 3 inputs", all(same),
                      same=same)
            check(f"{backend} T={T}: {'one graph' if graphed else 'no graph'} captured",
                  moe_torch.graphs.count() == before + graphed, graphs=moe_torch.graphs.count() - before)
            args_ = inputs(T, 7)
            with torch.no_grad():
                down.mul_(1.5)
                want, got = plain(lambda: ours(*args_)), ours(*args_)
                down.div_(1.5)
            check(f"{backend} T={T}: in-place weight update read at replay", torch.equal(got, want))
            with torch.no_grad():
                timings[f"{backend} T={T}"] = {
                    "graph": timed(lambda: ours(*args_)), "plain": timed(lambda: plain(lambda: ours(*args_)))}
                if backend in theirs:
                    timings[f"{backend} T={T}"]["transformers"] = timed(
                        lambda: theirs[backend](*args_, gate_up, down))
            t = timings[f"{backend} T={T}"]
            print(f"{backend:11s} T={T}: " + ", ".join(f"{k} {v[0]:.3f} ms (host {v[1]:.3f})" for k, v in t.items()),
                  flush=True)
    reserved_after = torch.cuda.memory_reserved()

    # a capture of the caller's: our call inside it runs plainly (no nested capture) and replays correctly
    for backend in backends:
        static = inputs(4, 11)
        with torch.no_grad():
            want = plain(lambda: moe_torch.experts_forward(*static, gate_up, down, implementation=backend))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                moe_torch.experts_forward(*static, gate_up, down, implementation=backend)
            torch.cuda.current_stream().wait_stream(side)
            before = moe_torch.graphs.count()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = moe_torch.experts_forward(*static, gate_up, down, implementation=backend)
            graph.replay()
            torch.cuda.synchronize()
        check(f"{backend}: inside the caller's capture, the replay equals the plain call",
              torch.equal(out, want) and moe_torch.graphs.count() == before)

    kept = moe_torch.graphs.count()
    moe_torch.graphs.release()
    result = {
        "meta": {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "backends": backends,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S")},
        "summary": {"passed": sum(c["ok"] for c in checks), "failed": sum(not c["ok"] for c in checks)},
        "checks": checks,
        "timings_ms_device_host": timings,
        "memory": {"reserved_by_captures_gib": (reserved_after - reserved_before) / 2**30, "graphs_kept": kept,
                   "reserved_after_release_gib": torch.cuda.memory_reserved() / 2**30},
    }
    (folder / "graphs-check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"]), json.dumps(result["memory"]))


if __name__ == "__main__":
    main()
