"""Decode-size calls on the GPU, ours against transformers', kernel by kernel (not collected by pytest):

    PYTHONPATH=. python tests/device_decode_profile.py --out DIR [--tokens 1,4,16,64] [--paths NAME,NAME]

qwen3-30b-a3b shape, bf16. For each T, each path is timed one call at a time, synced (CUDA events around the call,
median of 5 rounds of 30 calls, the host time of the call, and the host time until it returned), then profiled once
(torch.profiler: each CUDA kernel's name, count and device time, how many aten ops the call ran, and the host ops
by self time). Decode graphs (moe_torch.graphs) apply to ours as to any call. Paths:
- inference (``torch.no_grad``): moe_torch ``batched_mm`` and ``grouped_mm`` (``experts_forward``, validate off, as
  the benchmark calls them) and transformers' ``batched_mm`` and ``grouped_mm`` (``bench.peers``, the same weights);
- batched_mm's first projection alone, in the forms it could take: each token's k gathered matrices as one
  [k*N, K] matrix times the token's row (the form used today at one chunk), one [N, K] matrix per slot times the
  slot's row (transformers' form), and at T=1 one ``F.linear`` on the gathered [k*N, K] matrix;
- training (forward, then the gradients of the hidden states, routing weights and both weight tensors), ours and
  transformers' ``batched_mm`` and ``grouped_mm``; and compiled (``torch.compile(fullgraph=True, mode=--compile-mode)``
  around the experts call, compiled when the path is first chosen), ``... compiled``.
Writes DIR/decode-profile.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

import moe_torch
from bench.peers import transformers_peer

E, H, I, K = 128, 2048, 768, 8  # qwen3-30b-a3b


def timed(call, rounds: int = 5, calls: int = 30) -> tuple[float, float, float]:
    """Medians over one call at a time: ms between CUDA events around the call, host ms up to its result, and host ms
    until the call returned (its launches; the rest of a host-bound call is the GPU finishing what was queued)."""
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    device, host, launch = [], [], []
    for _ in range(rounds):
        for _ in range(calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            call()
            launch.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            host.append((time.perf_counter() - t0) * 1e3)
            device.append(start.elapsed_time(end))
    return statistics.median(device), statistics.median(host), statistics.median(launch)


def profiled(call) -> dict:
    """One call under torch.profiler: its CUDA kernels (name, count, device us) and its aten op count."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    host: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    ops = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels[event.name[:120]]
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
        else:
            ops += event.name.startswith("aten::")
            entry = host[event.name[:120]]
            entry[0] += 1
            entry[1] += event.self_cpu_time_total
    listed = sorted(({"name": n, "count": c, "us": round(us, 1)} for n, (c, us) in kernels.items()),
                    key=lambda k: -k["us"])
    host_top = sorted(({"name": n, "count": c, "self_us": round(us, 1)} for n, (c, us) in host.items()),
                      key=lambda k: -k["self_us"])[:15]
    return {"kernels": listed, "kernel_count": sum(k["count"] for k in listed),
            "kernel_us": round(sum(k["us"] for k in listed), 1), "aten_ops": ops, "host_self_top": host_top}


def qwen3_weights(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The qwen3-30b-a3b shape's gate/up and down weights in bfloat16, from a fixed seed."""
    gen = torch.Generator(device=device).manual_seed(0)
    return ((torch.randn(E, 2 * I, H, device=device, generator=gen) / H ** 0.5).bfloat16(),
            (torch.randn(E, H, I, device=device, generator=gen) / I ** 0.5).bfloat16())


def recorder(checks: list[dict]):
    """check(name, ok, **detail): appends the check to ``checks`` and prints it (PASS or FAIL)."""
    def check(name: str, ok: bool, **detail) -> None:
        checks.append({"name": name, "ok": bool(ok), **detail})
        print(("PASS " if ok else "FAIL ") + name, detail or "", flush=True)
    return check


def write_checks(path: Path, script: str, units: str, checks: list[dict], timings_name: str, timings: dict) -> dict:
    """Write (and return) a device script's result: versions, the command, the checks and their summary, the
    timings under ``timings_name``."""
    result = {"meta": {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "command": f"PYTHONPATH=. python tests/{script} --out DIR", "units": units},
              "summary": {"passed": sum(c["ok"] for c in checks), "failed": sum(not c["ok"] for c in checks)},
              "checks": checks, timings_name: timings}
    path.write_text(json.dumps(result, indent=1))
    return result


def out_folder() -> Path:
    """The folder of ``--out`` (the only argument of the scripts beside this one), made."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", default="1,4,16,64")
    parser.add_argument("--paths", default="", help="comma-separated path names to run (default: all uncompiled)")
    parser.add_argument("--compile-mode", default="max-autotune")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    gate_up, down = qwen3_weights(device)
    gen = torch.Generator(device=device).manual_seed(1)
    theirs = {name: transformers_peer(name)(E, H, I) for name in ("batched_mm", "grouped_mm")}
    results = {"versions": {"torch": torch.__version__, "device": torch.cuda.get_device_name()}, "points": {}}
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, H, device=device, generator=gen).bfloat16()
        w, idx = torch.topk(torch.softmax(torch.randn(tokens, E, device=device, generator=gen), -1), K, -1)
        w = w.bfloat16()
        ids = idx.reshape(-1)
        grad_out = torch.randn(tokens, H, device=device, generator=gen).bfloat16()

        def ours(backend):
            return lambda: moe_torch.experts_forward(x, idx, w, gate_up, down, implementation=backend,
                                                     validate=False)

        def inference(call):
            def run():
                with torch.no_grad():
                    return call()
            return run

        leaves = [t.detach().requires_grad_() for t in (x, w, gate_up, down)]

        def training(forward):
            def run():
                out = forward(leaves[0], idx, leaves[1], leaves[2], leaves[3])
                return torch.autograd.grad(out, leaves, grad_out)
            return run

        paths = {
            "ours batched_mm": inference(ours("batched_mm")),
            "transformers batched_mm": inference(lambda: theirs["batched_mm"](x, idx, w, gate_up, down)),
            "ours grouped_mm": inference(ours("grouped_mm")),
            "transformers grouped_mm": inference(lambda: theirs["grouped_mm"](x, idx, w, gate_up, down)),
            "first projection, k matrices as one": inference(
                lambda: torch.bmm(gate_up[ids].reshape(tokens, K * 2 * I, H), x.unsqueeze(2))),
            "first projection, one matrix per slot": inference(
                lambda: torch.bmm(gate_up[ids], x.repeat_interleave(K, 0).unsqueeze(2))),
            "train ours batched_mm": training(
                lambda *a: moe_torch.experts_forward(*a, implementation="batched_mm", validate=False)),
            "train transformers batched_mm": training(theirs["batched_mm"]),
            "train ours grouped_mm": training(
                lambda *a: moe_torch.experts_forward(*a, implementation="grouped_mm", validate=False)),
            "train transformers grouped_mm": training(theirs["grouped_mm"]),
        }
        if tokens == 1:
            paths["first projection, F.linear on k matrices"] = inference(
                lambda: F.linear(x, gate_up[ids].reshape(K * 2 * I, H)))
        uncompiled = list(paths)
        for backend in ("batched_mm", "grouped_mm"):
            for who, forward in (("ours", lambda *a, b=backend: moe_torch.experts_forward(
                    *a, implementation=b, validate=False)), ("transformers", theirs[backend])):
                paths[f"train {who} {backend} compiled"] = training(
                    torch.compile(forward, fullgraph=True, mode=args.compile_mode))
        point = {}
        chosen = [name for name in args.paths.split(",") if name] or uncompiled
        for name, call in ((name, paths[name]) for name in chosen):
            ms, host_ms, launch_ms = timed(call)
            point[name] = {"ms": round(ms, 4), "host_ms": round(host_ms, 4), "launch_ms": round(launch_ms, 4),
                           **profiled(call)}
            top = ", ".join(f"{k['name'][:40]} x{k['count']} {k['us']}us" for k in point[name]["kernels"][:4])
            kernels, ops = point[name]["kernel_count"], point[name]["aten_ops"]
            print(f"T={tokens:3d} {name:42s} {ms:8.3f} ms (host {host_ms:7.3f}, launched {launch_ms:7.3f}) kernels "
                  f"{kernels:3d} = {point[name]['kernel_us']:8.1f} us, aten {ops:3d} | {top}", flush=True)
            print("    host self:", ", ".join(f"{h['name'][:50]} x{h['count']} {h['self_us']}us"
                                             for h in point[name]["host_self_top"][:8]), flush=True)
        results["points"][tokens] = point
        (args.out / "decode-profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    main()
