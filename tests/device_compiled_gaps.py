"""Device check: where the GPU idles inside one compiled training call (qwen3-30b-a3b T=64, grouped_mm and
transformers' grouped_mm, max-autotune-no-cudagraphs): each kernel's start and end under torch.profiler, the gaps
between consecutive kernels of a call, and the host ops running while the GPU waits. Writes JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import torch

from bench.configs import get_configs
from bench.inputs import make_sets, make_weights
from bench.runners import TorchRunner

MODE = "max-autotune-no-cudagraphs"


def main(out: str) -> None:
    cfg = get_configs("qwen3-30b-a3b")[0]
    device = torch.device("cuda")
    runner = TorchRunner(device)
    weights = make_weights(cfg, torch.bfloat16, device, 0)
    runner.load(weights, make_sets(cfg, 64, torch.bfloat16, device, 0, 3))
    result = {}
    for backend in ("grouped_mm", "transformers:grouped_mm"):
        call = runner.build(backend, "fwd+bwd", MODE)
        for i in range(6):
            call(i % 3)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(5):
                with torch.profiler.record_function(f"call{i}"):
                    call(i % 3)
                torch.cuda.synchronize()
        events = prof.events()
        kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        calls = sorted((e for e in events if e.name.startswith("call")), key=lambda e: e.time_range.start)
        per_call = []
        for c in calls:
            ks = [k for k in kernels if c.time_range.start <= k.time_range.start <= c.time_range.end + 5000]
            gaps = [(ks[j + 1].time_range.start - ks[j].time_range.end, ks[j].name[:60], ks[j + 1].name[:60])
                    for j in range(len(ks) - 1)]
            busy = sum(k.time_range.end - k.time_range.start for k in ks)
            span = ks[-1].time_range.end - ks[0].time_range.start if ks else 0
            per_call.append({"kernels": len(ks), "busy_us": busy, "span_us": span,
                             "big_gaps": [g for g in gaps if g[0] > 10]})
        host_ops = sorted(((e.key, e.cpu_time_total) for e in prof.key_averages() if e.cpu_time_total > 50),
                          key=lambda r: -r[1])[:25]
        result[backend] = {"calls": per_call, "host_ops_us_total": host_ops}
        c = per_call[-1]
        print(f"{backend}: kernels {c['kernels']} busy {c['busy_us']:.0f} us span {c['span_us']:.0f} us")
        for g in c["big_gaps"]:
            print(f"   gap {g[0]:.0f} us after {g[1]} before {g[2]}")
    json.dump(result, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
