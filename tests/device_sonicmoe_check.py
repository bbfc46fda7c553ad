"""Backend ``sonicmoe`` on the GPU (run on the lent H200; not collected by pytest):

    python tests/device_sonicmoe_check.py --out DIR [--parts correctness,compile] [--budget-s 300]

Correctness, forward and every gradient, in torch and in JAX: every bf16 SwiGLU shared vector, zero-padded to H and
I multiples of 8, or of 32 for a vector with biases (the same problem; biases need I >= 32; the gelu and relu vectors
must raise ValueError), and random problems (T = 1,
64, 300, 2048; -1 slots, out-of-range ids, idle experts, biases) against the float64 reference within the spec's
tolerance; torch and JAX bit-identical; two torch runs bit-identical; idle experts' weight gradients exactly zero;
our output next to SonicMoE's own layer function (``moe_general_routing_inputs``) on the same routing; the shared
Triton routing next to SonicMoE's own routing step.
Compile: torch.compile(fullgraph=True) in the spec's modes for inference and training (reduce-overhead among them;
a mode the spec leaves out is probed and reported, not claimed; a torch.cuda.graph capture is probed too). Writes ``DIR/sonicmoe.json`` and prints a summary.
quack autotunes each GEMM at the first call of a shape (minutes for each new shape): with ``--quack-configs first``
(the default) every quack GEMM runs its first config valid on the device instead, which checks the same kernels'
numbers in a fraction of the time; ``--quack-configs tuned`` keeps quack's autotuning.
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
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and SonicMoE allocate beside XLA
os.environ.setdefault("QUACK_CACHE_AUTOTUNING", "1")  # a later run on the same machine reuses quack's tuning

from moe_shared import load_spec, reference, relative_l2, requirements  # noqa: E402
from moe_shared.vectors import load_cases  # noqa: E402
from support import DIFF_ARGS, padded_arrays, random_case, record_outcome, unpadded_gradients  # noqa: E402

SPEC = load_spec()
TOL = SPEC.tolerance_for("bfloat16")
STARTED = time.perf_counter()
BIAS_MIN_I = SPEC.backends["sonicmoe"].support("torch").details["biases"]["min_I"]
RANDOM = [(1, 4, False), (64, 8, True), (300, 8, True), (2048, 16, False)]  # T, E, bias (H=256, I=128, k=2)


CHECKPOINT: list[Path] = []  # where each outcome is written as soon as it is known (a timeout loses none)


def record(results, kind, name, fn, budget_s):
    if time.perf_counter() - STARTED > budget_s:
        results.append({"kind": kind, "name": name, "ok": False, "detail": "skipped: out of time"})
    else:
        record_outcome(results, kind, name, fn)
    last = results[-1]
    print("OK  " if last["ok"] else "FAIL", kind, name, f"{last.get('s', '')}s", str(last["detail"])[:300], flush=True)
    for path in CHECKPOINT:
        path.write_text(json.dumps({"results": results}, indent=1, default=str))


def torch_inputs(arrays, requires_grad):
    import torch
    return {n: torch.from_numpy(np.ascontiguousarray(a)).cuda() if n == "top_k_index" else
            torch.from_numpy(np.ascontiguousarray(a)).cuda().to(torch.bfloat16).requires_grad_(requires_grad)
            for n, a in arrays.items()}


def torch_run(arrays, grad_output):
    import torch
    import moe_torch
    ts = torch_inputs(arrays, True)
    out = moe_torch.experts_forward(**ts, implementation="sonicmoe", validate=False)
    out.backward(torch.from_numpy(grad_output).cuda().to(torch.bfloat16))
    with torch.no_grad():
        inference = moe_torch.experts_forward(**ts, implementation="sonicmoe", validate=False)
    return ({"out": out.detach().float().cpu().numpy()} |
            {n: ts[n].grad.float().cpu().numpy() for n in DIFF_ARGS if n in ts},
            inference.float().cpu().numpy())


def jax_run(arrays, grad_output):
    import jax
    import jax.numpy as jnp
    import moe_jax
    js = {n: jnp.asarray(a) if n == "top_k_index" else jnp.asarray(a).astype(jnp.bfloat16) for n, a in arrays.items()}
    names = [n for n in DIFF_ARGS if n in js]

    def f(*diff):
        return moe_jax.experts_forward(**(js | dict(zip(names, diff))), implementation="sonicmoe", validate=False)

    out, vjp = jax.jit(lambda *d: jax.vjp(f, *d))(*(js[n] for n in names))
    grads = jax.jit(vjp)(jnp.asarray(grad_output).astype(jnp.bfloat16))
    inference = jax.jit(lambda v: moe_jax.experts_forward(**v, implementation="sonicmoe", validate=False))(js)
    to_np = lambda a: np.asarray(a.astype(jnp.float32))  # noqa: E731
    return {"out": to_np(out)} | {n: to_np(g) for n, g in zip(names, grads)}, to_np(inference)


def check(arrays, grad_output, expected: dict, cut=lambda r: r):
    """Forward and gradients of torch and JAX against ``expected`` ("out" and argument names); bit-identical to
    each other, the inference forward to the training one, and torch from run to run."""
    (ours, ours_inf), (again, _), (theirs, theirs_inf) = (torch_run(arrays, grad_output),
                                                          torch_run(arrays, grad_output), jax_run(arrays, grad_output))
    ours, again, theirs = cut(ours), cut(again), cut(theirs)
    errs = {f"{fw} {n}": relative_l2(r[n], expected[n]) for fw, r in (("torch", ours), ("jax", theirs)) for n in r}
    identical = {n: bool(np.array_equal(ours[n], theirs[n])) for n in ours}
    detail = {"max_rel_l2": max(errs.values()), "worst": max(errs, key=errs.get),
              "torch_jax_identical": all(identical.values()),
              "repeat_identical": all(np.array_equal(ours[n], again[n]) for n in ours),
              "inference_identical": bool(np.array_equal(cut({"out": ours_inf})["out"], ours["out"])
                                          and np.array_equal(theirs_inf, ours_inf))}
    if detail["max_rel_l2"] > TOL or not (detail["repeat_identical"] and detail["torch_jax_identical"]):
        raise AssertionError(detail | {"errors": errs, "identical": identical})
    return detail


def check_vector(case):
    import moe_torch
    E, H, I = case.inputs["down_proj"].shape
    expected = {"out": case.expected["out"]} | {n: case.expected[f"grad_{n}"] for n in DIFF_ARGS
                                                if f"grad_{n}" in case.expected}
    if case.activation != "silu":
        try:
            moe_torch.experts_forward(**torch_inputs(case.inputs, False), implementation="sonicmoe",
                                      activation=case.activation)
        except ValueError as err:
            return {"refused": str(err)}
        raise AssertionError(f"activation {case.activation} did not raise")
    padded = padded_arrays(case.inputs, BIAS_MIN_I if "gate_up_bias" in case.inputs else 8)
    H2 = padded["down_proj"].shape[1]
    grad_output = np.pad(case.grad_output, [(0, 0), (0, H2 - H)])

    def cut(r):
        grads = unpadded_gradients({n: v for n, v in r.items() if n != "out"}, H, I) if len(r) > 1 else {}
        return {"out": r["out"][:, :H]} | grads

    return check(padded, grad_output, expected, cut) | {"padded_to": [H2, padded["down_proj"].shape[2]]}


def check_random(T, E, bias):
    arrays, grad_output = random_case(T + E, T=T, H=256, I=128, E=E, k=2, bias=bias, empty_fraction=0.1)
    idle = E // 2
    if T > 1:
        arrays["top_k_index"] = np.where(arrays["top_k_index"] == idle, -1, arrays["top_k_index"])  # idle expert
        arrays["top_k_index"][::11, 1] = E + 3  # unchecked out-of-range ids: empty slots
    cleaned = dict(arrays, top_k_index=np.where(arrays["top_k_index"] >= E, -1, arrays["top_k_index"]))
    expected = {"out": reference.experts_forward(**cleaned)} | reference.experts_backward(**cleaned,
                                                                                          grad_output=grad_output)
    detail = check(arrays, grad_output, expected)
    if T == 1:
        return detail
    grads, _ = torch_run(arrays, grad_output)
    detail["idle_expert_grads_zero"] = bool(not grads["gate_up_proj"][idle].any() and
                                            not grads["down_proj"][idle].any())
    if not detail["idle_expert_grads_zero"]:
        raise AssertionError(detail)
    return detail


def upstream():
    """Our forward against SonicMoE's own ``moe_general_routing_inputs`` on the same routing (k=2, no empty slots)."""
    import torch
    import moe_torch
    import sonicmoe
    from sonicmoe.enums import ActivationType
    arrays, _ = random_case(5, T=512, H=512, I=256, E=8, k=2, bias=False)
    ts = torch_inputs(arrays, False)
    with torch.no_grad():
        ours = moe_torch.experts_forward(**ts, implementation="sonicmoe")
        T, k = ts["top_k_index"].shape
        token = torch.arange(T * k, device="cuda", dtype=torch.int32) // k
        theirs, _ = sonicmoe.moe_general_routing_inputs(
            ts["hidden_states"], ts["top_k_weights"].float().reshape(-1), token,
            ts["top_k_index"].reshape(-1).to(torch.int32), ts["gate_up_proj"].permute(1, 2, 0), None,
            ts["down_proj"].permute(1, 2, 0), None, 8, torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU,
            is_inference_mode_enabled=True, concat_layout=True)
    ours, theirs = ours.float().cpu().numpy(), theirs.float().cpu().numpy()
    expected = reference.experts_forward(**arrays)
    return {"ours_vs_theirs_rel_l2": relative_l2(ours, theirs.astype(np.float64)),
            "identical": bool(np.array_equal(ours, theirs)), "ours_rel_l2": relative_l2(ours, expected),
            "theirs_rel_l2": relative_l2(theirs, expected)}


def routing(T, k, E):
    """The shared Triton routing (both bindings) against SonicMoE's own routing step on the same ids, every empty or
    out-of-range id made expert 0 for SonicMoE's: the offsets must match, and the metadata must be what SonicMoE's
    step means (``fake_sonicmoe.routing_reference``: the stable order); whether SonicMoE's order within an expert
    is that same stable one is recorded."""
    import jax
    import jax.numpy as jnp
    import torch
    import fake_sonicmoe
    from moe_jax.backends import sonicmoe as jax_sonic
    from moe_torch.backends import sonicmoe as torch_sonic
    from sonicmoe.functional.triton_kernels import TC_topk_router_metadata_triton
    g = torch.Generator("cuda").manual_seed(T)
    ids = torch.randint(0, E, (T, k), device="cuda", dtype=torch.int32, generator=g)
    ids[::3, 0] = -1
    ids[1::5, -1] = E + 1
    w = torch.rand(T, k, device="cuda", generator=g).to(torch.bfloat16)
    ours = torch_sonic._routing(ids, w, E)
    from_jax = jax.jit(lambda i, v: jax_sonic._routing(i, v, E))(jnp.from_dlpack(ids), jnp.from_dlpack(w))
    expected = fake_sonicmoe.routing_reference(ids.cpu(), w.cpu(), E)
    theirs = {n: torch.empty_like(ours[n]) for n in ("offsets", "x_gather", "s_scatter", "s_reverse")}
    TC_topk_router_metadata_triton(torch.where((ids >= 0) & (ids < E), ids, 0), E, torch.empty(E, device="cuda",
                                   dtype=torch.int32), theirs["offsets"], theirs["x_gather"], theirs["s_scatter"],
                                   theirs["s_reverse"])
    detail = {"offsets_match_sonicmoe": bool(torch.equal(ours["offsets"], theirs["offsets"])),
              "order_matches_sonicmoe": {n: bool(torch.equal(ours[n], theirs[n])) for n in theirs},
              "matches_reference": {n: bool(torch.equal(ours[n].cpu(), expected[n].to(ours[n].dtype)))
                                    for n in expected},
              "jax_identical": {n: bool(np.array_equal(np.asarray(from_jax[n]), ours[n].cpu().numpy()))
                                for n in ours}}
    if not (detail["offsets_match_sonicmoe"] and all(detail["matches_reference"].values())
            and all(detail["jax_identical"].values())):
        raise AssertionError(detail)
    return detail


def correctness(results, budget_s):
    for T, k, E in ((37, 3, 5), (4096, 8, 128)):
        record(results, "routing", f"T={T} k={k} E={E}", lambda t=T, kk=k, e=E: routing(t, kk, e), budget_s)
    record(results, "upstream", "moe_general_routing_inputs", upstream, budget_s)
    for case in load_cases():
        if case.dtype == "bfloat16":
            record(results, "vector", case.name, lambda c=case: check_vector(c), budget_s)
    for T, E, bias in RANDOM:
        record(results, "random", f"T={T} E={E} bias={bias}", lambda t=T, e=E, b=bias: check_random(t, e, b),
               budget_s)


def compiled(results, budget_s):
    import torch
    import moe_torch
    # the shape of a random correctness case (T=300, E=8, biases): when both parts run, its GEMMs are tuned already
    arrays, grad_output = random_case(8, T=300, H=256, I=128, E=8, k=2, bias=True, empty_fraction=0.1)
    dout = torch.from_numpy(grad_output).cuda().to(torch.bfloat16)

    def eager(training):
        ts = torch_inputs(arrays, training)
        with torch.set_grad_enabled(training):
            out = moe_torch.experts_forward(**ts, implementation="sonicmoe")
        if training:
            out.backward(dout)
        return out.detach(), [ts[n].grad for n in DIFF_ARGS if n in ts and training]

    def run(mode, training):
        torch._dynamo.reset()
        fn = torch.compile(lambda **kw: moe_torch.experts_forward(**kw, implementation="sonicmoe"), fullgraph=True,
                           mode=None if mode == "default" else mode)
        for _ in range(3):  # cudagraph modes record on a later call
            ts = torch_inputs(arrays, training)
            with torch.set_grad_enabled(training):
                out = fn(**ts)
            if training:
                out.backward(dout)
        want, want_grads = eager(training)
        grads = [ts[n].grad for n in DIFF_ARGS if n in ts and training]
        same = bool(torch.equal(out.detach(), want)) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
        if not same:
            raise AssertionError("compiled result differs from eager")
        return {"identical_to_eager": same}

    claimed = SPEC.backends["sonicmoe"].support("torch").compile.modes

    def modes(training):
        for mode in ("default", "max-autotune-no-cudagraphs", "reduce-overhead"):
            kind = "compile" if mode in claimed else "compile-probe"
            record(results, kind, f"{mode} {'training' if training else 'inference'}",
                   lambda m=mode: run(m, training), budget_s)

    def graph():
        ts = torch_inputs(arrays, False)
        with torch.no_grad():
            want = moe_torch.experts_forward(**ts, implementation="sonicmoe")
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = moe_torch.experts_forward(**ts, implementation="sonicmoe")
            g.replay()
            torch.cuda.synchronize()
        return {"identical": bool(torch.equal(out, want))}

    modes(False)
    record(results, "compile-probe", "torch.cuda.graph capture (inference)", graph, budget_s)
    modes(True)  # last: the backward's GEMMs tune for minutes at a new shape


def pin_first_quack_configs():
    """Every quack autotuner runs only its first config that passes its own pruning for the device."""
    from quack import autotuner
    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", default="correctness,compile")
    p.add_argument("--budget-s", type=float, default=300, help="later checks are skipped (and recorded) after this")
    p.add_argument("--quack-configs", choices=("first", "tuned"), default="first")
    args = p.parse_args()
    if args.quack_configs == "first":
        pin_first_quack_configs()
    import jax
    import torch
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "jax": jax.__version__,
            **{d: requirements.installed_version(d) for d in ("sonic-moe", "quack-kernels", "nvidia-cutlass-dsl",
                                                              "apache-tvm-ffi", "torch-c-dlpack-ext", "triton")},
            "device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
            "quack_configs": args.quack_configs}
    results = []
    CHECKPOINT.append(args.out / "sonicmoe-partial.json")
    parts = {"correctness": correctness, "compile": compiled}
    for part in args.parts.split(","):
        parts[part](results, args.budget_s)
    meta["seconds"] = round(time.perf_counter() - STARTED, 1)
    (args.out / "sonicmoe.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    print(json.dumps(meta, default=str))
    print(f"checks: {sum(r['ok'] for r in results)} passed, {sum(not r['ok'] for r in results)} failed")


if __name__ == "__main__":
    main()
