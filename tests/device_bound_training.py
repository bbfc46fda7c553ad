"""Eager torch ``triton`` training through bound plans (``moe_torch.backends.triton._EagerTraining``) on the device
(not collected by pytest):

    python tests/device_bound_training.py --out DIR

Checks, per point: the output and every gradient (x, routing weights, both weights) of bound steps bit-identical
to the plan path's (binding switched off: the code before), at the step that binds and the one after; and two
forwards with their backwards in the other order (the second forward bound, its backward binding from views of
the forward's workspace, the first's backward bound on its own residuals). Timing: the benchmark's forward+backward
(``moe_torch.experts_forward`` then ``torch.autograd.grad``), several input sets in turn, ``plan`` and ``bound``
alternating by round: alone (the GPU idle before it, the host clock to a device sync, as the benchmark's ``ms``)
and back to back (per call), medians. Writes ``DIR/bound-training.json``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from device_bound_plans import _sets, _weights  # noqa: E402  (the benchmark's kind of inputs)

POINTS = {"qwen3-30b-a3b": (1, 4, 16, 64, 1024, 4096), "mixtral-8x7b": (1, 64), "deepseek-v3": (1, 64)}


@contextmanager
def binding(on: bool):
    """Bound plans on, or off (every key then stays on the plan path, as before them)."""
    from moe_torch.backends import triton as backend
    saved = backend._bind
    backend._BOUND.clear()
    if not on:
        backend._bind = lambda *args, **kwargs: None
    try:
        yield
    finally:
        backend._bind = saved
        backend._BOUND.clear()


def _step(x, idx, w, gate_up, down, dout):
    import moe_torch
    leaves = [t.detach().requires_grad_(True) for t in (x, w, gate_up, down)]
    out = moe_torch.experts_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], implementation="triton",
                                    validate=False)
    return out, leaves, dout


def _grads(out, leaves, dout):
    import torch
    return [out.detach()] + list(torch.autograd.grad(out, leaves, dout))


def check(shape: str, T: int) -> dict:
    """Each run's output and gradients against the plan path's, compared as they come (deepseek-v3's weight
    gradients are 21 GiB a step: two sets at a time at most)."""
    import torch
    gate_up, down = _weights(shape)
    x, idx, w = _sets(shape, T)[0]
    dout = torch.randn_like(x)
    with binding(False):
        want = _grads(*_step(x, idx, w, gate_up, down, dout))

    def same(got):
        return all(torch.equal(a, b) for a, b in zip(want, got, strict=True))

    result = {}
    with binding(True):
        result["binding step"] = same(_grads(*_step(x, idx, w, gate_up, down, dout)))
        result["bound step"] = same(_grads(*_step(x, idx, w, gate_up, down, dout)))
    with binding(True):
        early, late = _step(x, idx, w, gate_up, down, dout), _step(x, idx, w, gate_up, down, dout)
        result["backwards reversed: second"] = same(_grads(*late))
        result["backwards reversed: first"] = same(_grads(*early))
    return result


def timings(shape: str, T: int, rounds: int = 6, calls: int = 8) -> dict:
    import torch
    gate_up, down = _weights(shape)
    sets = [(*s, torch.randn_like(s[0])) for s in _sets(shape, T)]
    alone = {"plan": [], "bound": []}
    back = {"plan": [], "bound": []}
    for r in range(rounds):
        for variant in (("plan", "bound") if r % 2 == 0 else ("bound", "plan")):
            with binding(variant == "bound"):
                for s in sets:
                    _grads(*_step(*s[:3], gate_up, down, s[3]))
                torch.cuda.synchronize()
                for i in range(calls):
                    s = sets[i % len(sets)]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    _grads(*_step(*s[:3], gate_up, down, s[3]))
                    torch.cuda.synchronize()
                    alone[variant].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in range(calls):
                    s = sets[i % len(sets)]
                    _grads(*_step(*s[:3], gate_up, down, s[3]))
                torch.cuda.synchronize()
                back[variant].append((time.perf_counter() - t0) / calls)
    return {f"{variant} {kind}_ms": round(statistics.median(values[variant]) * 1e3, 4)
            for kind, values in (("alone", alone), ("back_to_back", back)) for variant in ("plan", "bound")}


def main():
    import torch
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", help="shape:T pairs (comma-separated) instead of POINTS")
    args = parser.parse_args()
    points = POINTS
    if args.points:
        points = {}
        for item in args.points.split(","):
            shape, _, T = item.partition(":")
            points.setdefault(shape, []).append(int(T))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": {"torch": torch.__version__, "triton": __import__("triton").__version__,
                       "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "command": "python tests/device_bound_training.py --out DIR"},
              "checks": {}, "timings": {}}
    try:
        for shape, tokens in points.items():
            for T in tokens:
                name = f"{shape} T={T}"
                result["checks"][name] = check(shape, T)
                result["timings"][name] = timings(shape, T)
                print(name, result["checks"][name], result["timings"][name], flush=True)
                torch.cuda.empty_cache()
    finally:
        result["passed"] = all(all(c.values()) for c in result["checks"].values())
        (args.out / "bound-training.json").write_text(json.dumps(result, indent=1))
    print("all bit-identical:", result["passed"])


if __name__ == "__main__":
    main()
