"""Backend ``deepgemm`` on the GPU (run on the lent H200; not collected by pytest), in under 4 minutes:

    python tests/device_deepgemm_check.py --out DIR

Correctness: every bf16 shared vector, zero-padded to H and I multiples of 64 (the same problem: no vector meets
the kernels' K % 64 as it is, which must raise ValueError), and random bf16 problems (H=512, I=256, E=8, k=2,
T = 1, 64, 300, -1 slots, biases, every activation) through ``deepgemm`` in torch and in JAX against the float64
reference within the spec's tolerance; torch and JAX bit-identical; two torch runs bit-identical; N-major weights
(the nn kernel); torch.compile(fullgraph=True) in the spec's modes (and reduce-overhead, reported, not claimed).
Timing: ``triton.testing.do_bench`` medians of the bf16 inference forward on deepseek-v3 and qwen3-30b-a3b at T=64
and 4096 for torch deepgemm, grouped_mm and triton, and JAX deepgemm (jitted, host-timed). Writes
``DIR/deepgemm.json`` and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and DeepGEMM allocate beside XLA

from moe_shared import load_spec, reference, relative_l2, requirements  # noqa: E402
from moe_shared.vectors import load_cases  # noqa: E402
from support import padded_arrays, random_case, record_outcome  # noqa: E402

SPEC = load_spec()
TOL = SPEC.tolerance_for("bfloat16")
SHAPES = {"deepseek-v3": (7168, 2048, 256, 8), "qwen3-30b-a3b": (2048, 768, 128, 8)}
RANDOM = [(1, "silu", False), (64, "gelu", True), (300, "silu", True), (300, "relu", False)]
STARTED = time.perf_counter()


def record(results, kind, name, fn, budget_s):
    if time.perf_counter() - STARTED > budget_s:
        results.append({"kind": kind, "name": name, "ok": False, "detail": "skipped: out of time"})
        return
    record_outcome(results, kind, name, fn)


def torch_run(arrays, activation, n_major=False):
    import torch
    import moe_torch
    ts = {n: torch.from_numpy(np.ascontiguousarray(a)).cuda() if n == "top_k_index" else
          torch.from_numpy(np.ascontiguousarray(a)).cuda().to(torch.bfloat16) for n, a in arrays.items()}
    if n_major:
        ts |= {n: ts[n].mT.contiguous().mT for n in ("gate_up_proj", "down_proj")}
    with torch.no_grad():
        return moe_torch.experts_forward(**ts, implementation="deepgemm", activation=activation).float().cpu().numpy()


def jax_run(arrays, activation):
    import jax
    import jax.numpy as jnp
    import moe_jax
    values = {n: jnp.asarray(a) if n == "top_k_index" else jnp.asarray(a).astype(jnp.bfloat16)
              for n, a in arrays.items()}
    f = jax.jit(lambda v: moe_jax.experts_forward(**v, implementation="deepgemm", activation=activation))
    return np.asarray(f(values).astype(jnp.float32))


def check(arrays, activation, expected, columns=None):
    """torch and JAX against ``expected`` [T, columns]; bit-identical to each other and from run to run."""
    ours, again, theirs = torch_run(arrays, activation), torch_run(arrays, activation), jax_run(arrays, activation)
    ours, again, theirs = (r[:, :columns] for r in (ours, again, theirs))
    detail = {"torch": relative_l2(ours, expected), "jax": relative_l2(theirs, expected),
              "torch_jax_identical": bool(np.array_equal(ours, theirs)),
              "repeat_identical": bool(np.array_equal(ours, again))}
    if max(detail["torch"], detail["jax"]) > TOL or not detail["repeat_identical"]:
        raise AssertionError(detail)
    if not detail["torch_jax_identical"]:
        raise AssertionError(detail | {"max_abs_diff": float(np.abs(ours - theirs).max())})
    return detail


def check_vector(case):
    import torch
    import moe_torch
    E, H, I = case.inputs["down_proj"].shape
    ts = {n: torch.from_numpy(a).cuda() if n == "top_k_index" else torch.from_numpy(a).cuda().to(torch.bfloat16)
          for n, a in case.inputs.items()}
    try:
        moe_torch.experts_forward(**ts, implementation="deepgemm", activation=case.activation)
        raise AssertionError(f"H={H}, I={I} did not raise")
    except ValueError as err:
        refused = str(err)
    return check(padded_arrays(case.inputs, 64), case.activation, case.expected["out"], H) | {"unpadded": refused}


def correctness(results, budget_s):
    for case in load_cases():
        if case.dtype == "bfloat16":
            record(results, "vector", case.name, lambda c=case: check_vector(c), budget_s)
    for T, activation, bias in RANDOM:
        arrays, _ = random_case(T, T=T, H=512, I=256, E=8, k=2, bias=bias, empty_fraction=0.1)
        expected = reference.experts_forward(**arrays, activation=activation)
        record(results, "random", f"T={T} {activation} bias={bias}",
               lambda a=arrays, act=activation, e=expected: check(a, act, e), budget_s)
    arrays, _ = random_case(7, T=64, H=512, I=256, E=8, k=2, bias=True, empty_fraction=0.1)

    def n_major():
        strided, plain = torch_run(arrays, "silu", n_major=True), torch_run(arrays, "silu")
        err = relative_l2(strided, reference.experts_forward(**arrays))
        if err > TOL:
            raise AssertionError(err)
        return {"rel_l2": err, "identical_to_k_major": bool(np.array_equal(strided, plain))}

    record(results, "n-major", "transposed weights, nn kernel", n_major, budget_s)


def compiled(results, budget_s):
    import torch
    import moe_torch
    arrays, _ = random_case(8, T=256, H=512, I=256, E=8, k=2, bias=True, empty_fraction=0.1)
    ts = {n: torch.from_numpy(a).cuda() if n == "top_k_index" else torch.from_numpy(a).cuda().to(torch.bfloat16)
          for n, a in arrays.items()}

    def run(mode):
        torch._dynamo.reset()
        fn = torch.compile(lambda **kw: moe_torch.experts_forward(**kw, implementation="deepgemm"), fullgraph=True,
                           mode=None if mode == "default" else mode)
        with torch.no_grad():
            for _ in range(3):  # cudagraph modes record on a later call
                out = fn(**ts)
            expected = moe_torch.experts_forward(**ts, implementation="deepgemm")
        detail = {"equal_to_eager": bool(torch.equal(out, expected)),
                  "rel_l2": relative_l2(out.float().cpu().numpy(), reference.experts_forward(**arrays))}
        if detail["rel_l2"] > TOL:
            raise AssertionError(detail)
        return detail

    claimed = SPEC.backends["deepgemm"].support("torch").compile.modes
    for mode in (*claimed, "reduce-overhead"):
        record(results, "compile" if mode in claimed else "compile-probe", mode, lambda m=mode: run(m), budget_s)


def floor_ms(H, I, E, k, T, hit):
    flops = 2 * T * k * 3 * H * I
    return max(flops / 790e12, (hit * 3 * H * I * 2 + 2 * T * H * 2) / 4.3e12) * 1e3


def timings(results, budget_s):
    import jax
    import torch
    import triton.testing
    import moe_jax
    import moe_torch
    for shape, (H, I, E, k) in SHAPES.items():
        g = torch.Generator("cuda").manual_seed(0)
        gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * H ** -0.5
        down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * I ** -0.5
        for T in (64, 4096):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
            w, idx = torch.topk(torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1), k, -1)
            w, idx = w.to(torch.bfloat16), idx.to(torch.int32)
            hit = int(torch.unique(idx).numel())
            args = (x, idx, w, gate_up, down)

            def torch_series(backend, a=args):
                with torch.no_grad():
                    return triton.testing.do_bench(lambda: moe_torch.experts_forward(*a, implementation=backend),
                                                   warmup=25, rep=100, return_mode="median")

            def jax_series(a=args):
                values = [jax.dlpack.from_dlpack(t) for t in a]  # the same buffers, no copy
                f = jax.jit(lambda *v: moe_jax.experts_forward(*v, implementation="deepgemm"))
                for _ in range(3):
                    f(*values).block_until_ready()
                times = []
                for _ in range(20):
                    start = time.perf_counter()
                    f(*values).block_until_ready()
                    times.append((time.perf_counter() - start) * 1e3)
                return float(np.median(times))

            for label, fn in (("torch deepgemm", lambda: torch_series("deepgemm")),
                              ("torch grouped_mm", lambda: torch_series("grouped_mm")),
                              ("torch triton", lambda: torch_series("triton")), ("jax deepgemm", jax_series)):
                def timed(fn=fn, T=T):
                    ms = fn()
                    return {"ms": ms, "floor_fraction": floor_ms(H, I, E, k, T, hit) / ms, "hit_experts": hit}

                record(results, "timing", f"{shape} T={T} {label}", timed, budget_s)
        del gate_up, down
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default="correctness,compile,timing")
    p.add_argument("--budget-s", type=float, default=225, help="later checks are skipped (and recorded) after this")
    args = p.parse_args()
    import jax
    import torch
    import triton
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "jax": jax.__version__, "triton": triton.__version__,
            "sgl-deep-gemm": requirements.installed_version("sgl-deep-gemm"),
            "apache-tvm-ffi": requirements.installed_version("apache-tvm-ffi"),
            "device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability()}
    try:
        toolkit = requirements.find_cuda_toolkit("deepgemm")
        meta["nvcc"] = [str(toolkit.nvcc), toolkit.found_by, requirements.nvcc_version(toolkit.nvcc)]
    except RuntimeError as err:
        meta["nvcc"] = str(err)
    results = []
    parts = {"correctness": correctness, "compile": compiled, "timing": timings}
    for part in args.parts.split(","):
        parts[part](results, args.budget_s)
    meta["seconds"] = round(time.perf_counter() - STARTED, 1)
    (args.out / "deepgemm.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    report(meta, results)


def report(meta, results):
    print(json.dumps(meta, default=str))
    checks = [r for r in results if r["kind"] != "timing"]
    print(f"checks: {sum(r['ok'] for r in checks)} passed, {sum(not r['ok'] for r in checks)} failed")
    for r in checks:
        if not r["ok"] or r["kind"] in ("compile", "compile-probe", "n-major"):
            print("OK  " if r["ok"] else "FAIL", r["kind"], r["name"], str(r["detail"])[:300])
    series = ("torch deepgemm", "torch grouped_mm", "torch triton", "jax deepgemm")
    print(f"\n{'config':16s} {'T':>5s} " + " ".join(f"{s:>17s}" for s in series))
    rows = {}
    for r in results:
        if r["kind"] == "timing":
            shape, T, label = r["name"].split(" ", 2)
            rows.setdefault((shape, T), {})[label] = (f"{r['detail']['ms']:.3f} ({r['detail']['floor_fraction']:.2f})"
                                                      if r["ok"] else "failed")
    for (shape, T), cells in rows.items():
        print(f"{shape:16s} {T[2:]:>5s} " + " ".join(f"{cells.get(s, '-'):>17s}" for s in series))
    print("ms (fraction of the roofline floor: 790 TFLOP/s, 4.3 TB/s)")


if __name__ == "__main__":
    main()
