"""Where the host's time of one uncompiled torch ``triton`` forward+backward goes (run on the device; not collected
by pytest):

    python tests/device_training_host.py --out DIR

For each point, the GPU idle before each timed piece (a device sync first), medians over the calls, in us: the
public call (``moe_torch.experts_forward`` then ``torch.autograd.grad`` of x, the routing weights and both
weights, as the benchmark calls it), its forward alone, the training plan's forward and the backward plan run
directly (``_training_forward``, ``_backward_gradients``: no autograd), an autograd.Function of the same inputs
that launches nothing (forward: one empty output; backward: preallocated gradients: the engine's and the
Function's own cost), and torch.empty on the GPU (one buffer: what each plan buffer costs). Writes
``DIR/training-host.json``.
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

POINTS = (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 4096))


def measure(shape: str, T: int, calls: int) -> dict:
    import torch
    import moe_torch
    from moe_shared.kernels import plan as plans
    from moe_torch.backends import triton as backend

    (gate_up, down), (x, idx, w, dout) = _point(shape, T)
    leaves = [t.detach().requires_grad_(True) for t in (x, w, gate_up, down)]
    grads = [torch.empty_like(t) for t in leaves]

    def public():
        out = moe_torch.experts_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], implementation="triton",
                                        validate=False)
        return torch.autograd.grad(out, leaves, dout)

    def forward_only():
        return moe_torch.experts_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], implementation="triton",
                                         validate=False)

    args = (x, idx, w, gate_up, down, None, None)
    residuals = backend._training_forward(*args, "silu")[1:]

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, gate_up, down):
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, g):
            return tuple(grads)

    def engine():
        out = Nothing.apply(*leaves)
        return torch.autograd.grad(out, leaves, dout)

    pieces = {"public fwd+bwd": public, "public fwd (grad enabled)": forward_only,
              "training plan forward": lambda: backend._training_forward(*args, "silu"),
              "backward plan": lambda: backend._backward_gradients(dout, *args, residuals, "silu"),
              "autograd.Function launching nothing, fwd+bwd": engine,
              "torch.empty [T, H]": lambda: torch.empty(T, x.shape[1], dtype=x.dtype, device=x.device)}
    times: dict[str, list[float]] = {name: [] for name in pieces}
    for _ in range(5):
        for fn in pieces.values():
            fn()
    for _ in range(calls):
        for name, fn in pieces.items():  # interleaved: each piece sees the same machine state
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    problem = backend.problem_of(x, idx, gate_up, down, None, None, "silu")
    return {"us": {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()},
            "steps": {"forward": len(plans.forward_plan(problem, training=True).steps),
                      "backward": len(plans.backward_plan(problem).steps)},
            "buffers": {"forward": len(plans.forward_plan(problem, training=True).buffers),
                        "backward": len(plans.backward_plan(problem).buffers)}}


def main():
    import torch
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "command": "python tests/device_training_host.py --out DIR"},
              "points": {}}
    for shape, T in POINTS:
        result["points"][f"{shape} T={T}"] = point = measure(shape, T, args.calls)
        print(shape, T, json.dumps(point), flush=True)
    (args.out / "training-host.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
