"""Accelerator checks, run on the lent GPU (not collected by pytest on CPU):

    python tests/device_check.py --out results.json

Every torch backend on CUDA and every JAX backend on the GPU against every shared vector (forward and gradients,
the shared tolerance table); torch.compile entries of the spec on CUDA (and the cudagraph modes the spec leaves out
of grouped_mm, to record why); decode_mode on CUDA; unchecked out-of-range ids; grouped_mm's backward, bit-identical
run to run under torch.use_deterministic_algorithms; which JAX kernel ran. ``--native-dtypes-only``: whether
F.grouped_mm is exact enough in float32 and float16 on CUDA (every vector of those dtypes).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from moe_shared import load_spec, relative_l2  # noqa: E402
from moe_shared.vectors import load_cases  # noqa: E402
from support import DIFF_ARGS, random_case, record_outcome  # noqa: E402

SPEC = load_spec()
CASES = load_cases()


_record = record_outcome


QUICK = False  # --quick: bfloat16/float32 vectors, the declared bfloat16 compile entries, one undeclared


def torch_checks(results):
    import torch
    import moe_torch
    DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dev = torch.device("cuda")

    def tensors(arrays, dtype, grad=False):
        out = {}
        for n, a in arrays.items():
            t = torch.from_numpy(np.ascontiguousarray(a)).to(dev)
            out[n] = t if n == "top_k_index" else t.to(DT[dtype]).requires_grad_(grad)
        return out

    def vector(case, backend):
        ts = tensors(case.inputs, case.dtype, grad=True)
        out = moe_torch.experts_forward(**ts, implementation=backend, activation=case.activation)
        out.backward(torch.from_numpy(case.grad_output.astype(np.float32)).to(dev).to(DT[case.dtype]))
        errs = {"out": relative_l2(out.detach().float().cpu().numpy(), case.expected["out"])}
        for n, t in ts.items():
            if n in DIFF_ARGS:
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                errs[f"grad_{n}"] = relative_l2(g.float().cpu().numpy(), case.expected[f"grad_{n}"])
        worst = max(errs.values())
        if worst > SPEC.tolerance_for(case.dtype):
            raise AssertionError(f"worst relative L2 {worst:.3e} > {SPEC.tolerance_for(case.dtype)}: {errs}")
        return {"worst_rel_l2": worst}

    for backend in SPEC.backend_names("torch"):
        for case in CASES:
            _record(results, "torch-vector", f"{backend}/{case.name}", lambda c=case, b=backend: vector(c, b))

    def compiled(backend, mode, dtype, fullgraph):
        torch._dynamo.reset()
        ts = tensors(random_case(11, T=64, H=64, I=32, E=8, k=2, bias=True, empty_fraction=0.2)[0], dtype)
        fn = torch.compile(lambda **kw: moe_torch.experts_forward(**kw, implementation=backend),
                           fullgraph=fullgraph, mode=None if mode == "default" else mode)
        out = fn(**ts)
        out = fn(**ts)  # second call: cudagraph replay where the mode records graphs
        err = relative_l2(out.float().cpu().numpy(),
                          moe_torch.experts_forward(**ts, implementation=backend).float().cpu().numpy())
        if err > SPEC.tolerance_for(dtype):
            raise AssertionError(f"relative L2 {err:.3e} vs uncompiled")
        return {"rel_l2_vs_uncompiled": err}

    all_modes = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
    for name, b in SPEC.backends.items():
        c = b.frameworks.get("torch") and b.frameworks["torch"].compile
        if not c:
            continue
        for mode in all_modes:
            if QUICK and mode not in ("default", "reduce-overhead"):
                continue
            for dtype in (["bfloat16"] if QUICK else c.dtypes):
                kind = "torch-compile-declared" if mode in c.modes else "torch-compile-undeclared"
                _record(results, kind, f"{name}/{mode}/{dtype}/fullgraph={c.fullgraph}",
                        lambda n=name, m=mode, d=dtype, f=c.fullgraph: compiled(n, m, d, f))

    def decode():
        model = torch.nn.ModuleDict({"a": moe_torch.Experts(4, 16, 8, device=dev),
                                     "b": moe_torch.Experts(4, 16, 8, experts_implementation="eager", device=dev)})
        with moe_torch.decode_mode(model):
            inside = moe_torch.get_experts_implementation(model)
        after = moe_torch.get_experts_implementation(model)
        if inside != {"": None, "a": "batched_mm", "b": "eager"} or after["a"] != "grouped_mm":
            raise AssertionError(f"inside {inside}, after {after}")
        return {"inside": inside, "after": after}

    _record(results, "torch-decode", "decode_mode on cuda", decode)

    def unchecked_ids(backend):
        arrays = random_case(3, T=16, H=32, I=16, E=4, k=2, bias=True)[0]
        arrays["top_k_index"][2, 0] = 7
        arrays["top_k_index"][5, 1] = -4
        ts = tensors(arrays, "float32")
        out = moe_torch.experts_forward(**ts, implementation=backend)
        try:
            moe_torch.experts_forward(**ts, implementation=backend, validate=True)
            raise AssertionError("validate=True did not raise")
        except ValueError:
            pass
        arrays["top_k_index"][2, 0] = -1
        arrays["top_k_index"][5, 1] = -1
        expected = moe_torch.experts_forward(**tensors(arrays, "float32"), implementation=backend)
        torch.cuda.synchronize()
        return {"max_abs_diff": float((out - expected).abs().max())}

    for backend in SPEC.backend_names("torch"):
        _record(results, "torch-unchecked-ids", backend, lambda b=backend: unchecked_ids(b))

    def native_dtypes():
        import torch.nn.functional as F
        out = {}
        for name, dt in DT.items():
            a = torch.randn(64, 64, device=dev, dtype=dt)
            w = torch.randn(4, 64, 64, device=dev, dtype=dt)
            try:
                F.grouped_mm(a, w.transpose(1, 2), offs=torch.tensor([16, 32, 48, 64], device=dev, dtype=torch.int32))
                out[name] = "ok"
            except Exception as err:
                out[name] = f"{type(err).__name__}: {str(err)[:120]}"
        return out

    _record(results, "torch-grouped-mm-dtypes", "F.grouped_mm on cuda", native_dtypes)


def native_dtype_check(results, device: str = "cuda"):
    """Whether F.grouped_mm on CUDA is exact enough in float32 and float16 (what ``NATIVE_DTYPES`` allows it there):
    every vector of those dtypes through grouped_mm with the native op allowed for them, forward and gradients
    against the float64 reference within the tolerance table, and the op that ran."""
    import torch
    from moe_torch.backends import grouped_mm as backend
    import moe_torch
    DT = {"float32": torch.float32, "float16": torch.float16}
    dev = torch.device(device)
    allowed = backend.NATIVE_DTYPES[device]

    def check(inputs, grad_output, expected, dtype, activation="silu"):
        ts = {n: torch.from_numpy(np.ascontiguousarray(a)).to(dev) if n == "top_k_index" else
              torch.from_numpy(np.ascontiguousarray(a)).to(dev).to(DT[dtype]).requires_grad_()
              for n, a in inputs.items()}
        backend.NATIVE_DTYPES[device] = tuple({*allowed, DT[dtype]})
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = moe_torch.experts_forward(**ts, implementation="grouped_mm", activation=activation)
                out.backward(torch.from_numpy(grad_output.astype(np.float32)).to(dev).to(DT[dtype]))
        finally:
            backend.NATIVE_DTYPES[device] = allowed
        ops = {e.key for e in prof.key_averages()}
        errs = {"out": relative_l2(out.detach().float().cpu().numpy(), expected["out"])}
        for n, t in ts.items():
            if n in DIFF_ARGS:
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                errs[f"grad_{n}"] = relative_l2(g.float().cpu().numpy(), expected[f"grad_{n}"])
        detail = {"worst_rel_l2": max(errs.values()), "native": "aten::_grouped_mm" in ops,
                  "loop": "moe_torch::grouped_mm_loop" in ops}
        if detail["worst_rel_l2"] > SPEC.tolerance_for(dtype):
            raise AssertionError(detail | {"errors": errs})
        return detail

    def aligned(seed, dtype):  # shapes the native op takes in every dtype (16-byte aligned rows)
        from moe_shared import reference
        arrays, dy = random_case(seed, T=300, H=64, I=32, E=8, k=2, bias=True, empty_fraction=0.1)
        expected = {"out": reference.experts_forward(**arrays)}
        expected |= {f"grad_{n}": g for n, g in reference.experts_backward(**arrays, grad_output=dy).items()}
        return check(arrays, dy, expected, dtype)

    for case in CASES:
        if case.dtype in DT:
            _record(results, "torch-native-dtype", f"grouped_mm/{case.name}",
                    lambda c=case: check(c.inputs, c.grad_output, c.expected, c.dtype, c.activation))
    for dtype in DT:
        _record(results, "torch-native-dtype", f"grouped_mm/{dtype}-aligned-random",
                lambda d=dtype: aligned(5, d))


def deterministic_backward_check(results):
    """grouped_mm forward and backward three times on one bf16 problem under torch.use_deterministic_algorithms: the
    output and every gradient must have the same bits each time."""
    import torch
    import moe_torch
    dev = torch.device("cuda")
    arrays, dy = random_case(21, T=512, H=256, I=128, E=16, k=4, bias=True, empty_fraction=0.1)

    def once():
        ts = {n: torch.from_numpy(np.ascontiguousarray(a)).to(dev) for n, a in arrays.items()}
        ts = {n: t if n == "top_k_index" else t.to(torch.bfloat16).requires_grad_() for n, t in ts.items()}
        out = moe_torch.experts_forward(**ts, implementation="grouped_mm")
        out.backward(torch.from_numpy(dy).to(dev).to(torch.bfloat16))
        return {"out": out.detach()} | {f"grad_{n}": t.grad for n, t in ts.items() if n in DIFF_ARGS}

    def check():
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            first, *others = [once() for _ in range(3)]
        finally:
            torch.use_deterministic_algorithms(before)
        differ = sorted({n for run in others for n, t in run.items() if not torch.equal(t, first[n])})
        if differ:
            raise AssertionError(f"bits differ between runs: {differ}")
        return {"runs": 3, "bit_identical": sorted(first)}

    _record(results, "torch-deterministic-backward", "grouped_mm bfloat16 T=512 H=256 I=128 E=16 k=4", check)


def jax_checks(results):
    import jax
    import jax.numpy as jnp
    import moe_jax
    DT = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

    def vector(case, backend):
        arrays = {n: jnp.asarray(a) if n == "top_k_index" else jnp.asarray(a).astype(DT[case.dtype])
                  for n, a in case.inputs.items()}
        names = [n for n in DIFF_ARGS if n in arrays]

        def f(*diff):
            return moe_jax.experts_forward(**(arrays | dict(zip(names, diff))), implementation=backend,
                                           activation=case.activation)

        f = f if backend == "eager" else jax.jit(f)
        out, vjp = jax.vjp(f, *(arrays[n] for n in names))
        grads = vjp(jnp.asarray(case.grad_output).astype(DT[case.dtype]))
        errs = {"out": relative_l2(np.asarray(out.astype(jnp.float32)), case.expected["out"])}
        errs |= {f"grad_{n}": relative_l2(np.asarray(g.astype(jnp.float32)), case.expected[f"grad_{n}"])
                 for n, g in zip(names, grads)}
        worst = max(errs.values())
        if worst > SPEC.tolerance_for(case.dtype):
            raise AssertionError(f"worst relative L2 {worst:.3e}: {errs}")
        return {"worst_rel_l2": worst, "platform": jax.default_backend()}

    for backend in SPEC.backend_names("jax"):
        if QUICK and backend not in ("grouped_mm", "batched_mm"):
            continue
        for case in CASES:
            if QUICK and case.dtype != "bfloat16":
                continue
            _record(results, "jax-vector", f"{backend}/{case.name}", lambda c=case, b=backend: vector(c, b))

    def kernel():
        arrays = {n: jnp.asarray(a) for n, a in random_case(2, T=8, H=16, I=8, E=4, k=2, bias=False)[0].items()}
        arrays = {n: a if n == "top_k_index" else a.astype(jnp.bfloat16) for n, a in arrays.items()}
        hlo = jax.jit(lambda a: moe_jax.experts_forward(**a, implementation="grouped_mm")).lower(arrays).compile()
        text = hlo.as_text()
        return {"while_loop": " while(" in text, "ragged_dot_ops": text.count("ragged-dot")}

    _record(results, "jax-kernel", "grouped_mm on gpu", kernel)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--native-dtypes-only", action="store_true",
                        help="only F.grouped_mm in float32 and float16 against the vectors (torch)")
    args = parser.parse_args()
    global QUICK
    QUICK = args.quick
    results = []
    meta = {"python": platform.python_version()}
    if args.native_dtypes_only:
        import torch
        meta |= {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
        native_dtype_check(results)
    elif "torch" in args.frameworks:
        import torch
        meta |= {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
        torch_checks(results)
        deterministic_backward_check(results)
    if "jax" in args.frameworks and not args.native_dtypes_only:
        import jax
        meta |= {"jax": jax.__version__, "jax_devices": [str(d) for d in jax.devices()]}
        jax_checks(results)
    summary = {}
    for r in results:
        s = summary.setdefault(r["kind"], {"passed": 0, "failed": 0})
        s["passed" if r["ok"] else "failed"] += 1
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "results": results}, indent=1))
    print(json.dumps(meta))
    for kind, s in summary.items():
        print(f"{kind:28s} passed {s['passed']:4d} failed {s['failed']:4d}")
    for r in results:
        if not r["ok"]:
            print("FAIL", r["kind"], r["name"], r["detail"][:300])


if __name__ == "__main__":
    main()
