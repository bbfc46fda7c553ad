"""Where the host's time of one uncompiled torch ``triton`` forward goes, step by step (run on the device; not
collected by pytest):

    python tests/device_torch_host_steps.py --out DIR

For each point, after warm-up: the call's issue time with the GPU idle before it (a device sync first) and issued
back to back; then the same call taken apart as ``moe_torch.backends.triton._inference`` runs it (the problem, the
plan, the inputs, each plan step's buffers and its launch, the cast), each piece timed on the host, the GPU idle
before each call. Medians over the calls. Writes ``DIR/torch-host-steps.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from device_triton_check import _point  # noqa: E402  (the benchmark's inputs, cached per point)

POINTS = (("qwen3-30b-a3b", 8), ("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 1024), ("qwen3-30b-a3b", 4096),
          ("mixtral-8x7b", 4096))


def _us(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e6, 1)


def measure(shape: str, T: int, calls: int) -> dict:
    import torch
    import moe_torch
    from moe_shared.kernels import plan as plans
    from moe_torch.backends import triton as backend

    (gate_up, down), (x, idx, w, _) = _point(shape, T)

    def call():
        return moe_torch.experts_forward(x, idx, w, gate_up, down, implementation="triton", validate=False)

    with torch.no_grad():
        for _ in range(5):
            call()
        torch.cuda.synchronize()
        idle = []
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            idle.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        issued = []
        for _ in range(20):
            t0 = time.perf_counter()
            call()
            issued.append(time.perf_counter() - t0)
        torch.cuda.synchronize()

        pieces: dict[str, list[float]] = {}

        def timed(name, fn):
            t0 = time.perf_counter()
            result = fn()
            pieces.setdefault(name, []).append(time.perf_counter() - t0)
            return result

        dtypes = None
        for _ in range(calls):
            torch.cuda.synchronize()
            start = time.perf_counter()
            problem = timed("problem_of", lambda: backend.problem_of(x, idx, gate_up, down, None, None, "silu"))
            plan = timed("forward_plan", lambda: plans.forward_plan(problem))
            env = timed("inputs", lambda: backend._inputs(x, idx, w, gate_up, down, None, None))
            dtypes = timed("dtypes", lambda: backend._DTYPE_ROLES | backend._dtypes(env))
            kernels = backend._kernels()
            where = timed("launch_place", lambda: backend._launch_place(x.device))
            for i, step in enumerate(plan.steps):
                outputs = timed(f"{i}:{step.kernel}:buffers",
                                lambda step=step: backend.step_outputs(step, dtypes, x.device))
                args = [env[a] if isinstance(a, str) else a for a in step.inputs] + outputs
                timed(f"{i}:{step.kernel}:launch",
                      lambda step=step, args=args: backend._launch(getattr(kernels, step.kernel), step, args, where))
                env.update((b.name, t) for b, t in zip(step.outputs, outputs))
            timed("cast", lambda: env[plan.output].to(x.dtype))
            pieces.setdefault("pieces_total", []).append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return {"call_issue_us_gpu_idle": _us(idle), "call_issue_us_back_to_back": _us(issued),
            "steps": len(plan.steps), "tma": problem.tma,
            "pieces_us": {name: _us(v) for name, v in pieces.items()}}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    import torch
    import triton
    results = {"meta": {"torch": torch.__version__, "triton": triton.__version__,
                        "device": torch.cuda.get_device_name()}, "points": {}}
    for shape, T in POINTS:
        found = measure(shape, T, args.calls)
        results["points"][f"{shape} T={T}"] = found
        print(f"{shape} T={T}: issue {found['call_issue_us_gpu_idle']} us idle, "
              f"{found['call_issue_us_back_to_back']} back to back; {found['pieces_us']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "torch-host-steps.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
