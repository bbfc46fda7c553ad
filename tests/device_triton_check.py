"""Backend ``triton`` on the GPU (run on the lent H200; not collected by pytest):

    python tests/device_triton_check.py --out DIR --parts vectors,graphs
    python tests/device_triton_check.py --out DIR --parts tune --configs-out /tmp/moe-configs
    XLA_FLAGS=--xla_gpu_graph_min_graph_size=2 python tests/device_triton_check.py --out DIR --parts graphed

``vectors``: every shared vector through ``triton`` in torch and JAX, forward and every gradient, within the
tolerance table; torch and JAX outputs and gradients bit-identical; two runs bit-identical (split over worker
processes, which also compile in parallel). ``graphs``: CUDA-graph capture and replay in torch; torch.compile
(fullgraph) in every mode, inference and training; JAX grouped_mm on the Triton kernel; which kernels ran.
``steps``: each step of the forward and backward plans timed alone at model shapes, and the GEMM steps under
variant tiles (``--variant-kinds``). ``descriptors``: TMA weight and row loads against pointer loads, torch and
JAX.
``tails``: short tiles for the experts' last blocks (SHORT_TAILS) against the reference, torch vs JAX.
``profile``: the public call timed as the benchmark does and under torch.profiler (each kernel's time per call);
``host``: where the host's time per torch call goes (cProfile). ``launch``: cached kernels launched through
triton's C launcher give the bits of its launch wrapper. ``decode-threshold``: the slot count up to which
the decode kernels beat the sorted path, per shape, with the current tiles (the table with them written to
``--configs-out``). ``jax-profile``: the JAX call timed on
the host (single, back to back, issue time) and its HLO op counts. ``framework-kernels``: the inference forward in
torch and in JAX on the same inputs, each GPU kernel's time per call in each (one profiler sees both), and the
ptxas versions on the machine (set TRITON_PTXAS_PATH to assemble torch's kernels with another).
``own-launcher``: moe_jax's Triton launcher (``moe_triton_launch``) against jaxlib's and torch: bits and time per
call.
``large``: JAX forward+backward at 16384 and 65536 tokens (qwen3-30b-a3b): no
out-of-memory, time and peak memory.
``--merge-steps RESULTS...`` (no GPU): the fastest variant of each step into the tile-config table.
``tune``: times candidate tile configs per kernel and shape (compiled in parallel first), writes the best as
``<configs-out>/nvidia-h200.json`` (the format of shared/kernels/configs) and the decode threshold per shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from moe_shared import load_spec, relative_l2  # noqa: E402
from moe_shared.kernels import plan as plans  # noqa: E402
from moe_shared.vectors import load_cases  # noqa: E402
from support import DIFF_ARGS, random_case, record_outcome  # noqa: E402

SPEC = load_spec()
CASES = load_cases()
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2),
          "deepseek-v3": (7168, 2048, 256, 8)}


record = record_outcome


# --- vectors ------------------------------------------------------------------------------------------------------

def torch_vector(case, training=True):
    import torch
    import moe_torch
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[case.dtype]
    ts = {n: torch.from_numpy(np.ascontiguousarray(a)).cuda() if n == "top_k_index" else
          torch.from_numpy(np.ascontiguousarray(a)).cuda().to(dt).requires_grad_(training)
          for n, a in case.inputs.items()}
    out = moe_torch.experts_forward(**ts, implementation="triton", activation=case.activation)
    result = {"out": out.detach().float().cpu().numpy()}
    if training:
        grad = torch.from_numpy(case.grad_output.astype(np.float32)).cuda().to(dt)
        out.backward(grad)
        result |= {f"grad_{n}": t.grad.float().cpu().numpy() for n, t in ts.items() if n in DIFF_ARGS}
    return result


def jax_vector(case, training=True):
    import jax
    import jax.numpy as jnp
    import moe_jax
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[case.dtype]
    values = {n: jnp.asarray(a) if n == "top_k_index" else jnp.asarray(a).astype(dt) for n, a in case.inputs.items()}
    names = [n for n in DIFF_ARGS if n in values]

    def f(*diff):
        return moe_jax.experts_forward(**(values | dict(zip(names, diff))), implementation="triton",
                                       activation=case.activation)

    if not training:
        return {"out": np.asarray(jax.jit(f)(*(values[n] for n in names)).astype(jnp.float32))}
    out, vjp = jax.vjp(jax.jit(f), *(values[n] for n in names))
    grads = jax.jit(vjp)(jnp.asarray(case.grad_output.astype(np.float32)).astype(dt))
    result = {"out": np.asarray(out.astype(jnp.float32))}
    return result | {f"grad_{n}": np.asarray(g.astype(jnp.float32)) for n, g in zip(names, grads)}


def check_vector(case):
    tol = SPEC.tolerance_for(case.dtype)
    detail = {}
    for framework, run in (("torch", torch_vector), ("jax", jax_vector)):
        res = run(case)
        errs = {n: relative_l2(v, case.expected[n]) for n, v in res.items()}
        detail[framework] = max(errs.values())
        if detail[framework] > tol:
            raise AssertionError(f"{framework}: {errs} > {tol}")
        detail[f"{framework}_result"] = res
        inference = run(case, training=False)["out"]
        err = relative_l2(inference, case.expected["out"])
        if err > tol:
            raise AssertionError(f"{framework} inference: {err} > {tol}")
        detail[f"{framework}_inference"] = inference
    torch_res, jax_res = detail.pop("torch_result"), detail.pop("jax_result")
    detail["bit_identical"] = {n: bool(np.array_equal(torch_res[n], jax_res[n])) for n in torch_res}
    detail["bit_identical"]["inference"] = bool(np.array_equal(detail.pop("torch_inference"),
                                                               detail.pop("jax_inference")))
    again = torch_vector(case)
    detail["repeat_identical"] = all(np.array_equal(again[n], torch_res[n]) for n in again)
    if not all(detail["bit_identical"].values()) or not detail["repeat_identical"]:
        raise AssertionError(f"not bit-identical: {detail}")
    return detail


def vectors_worker(index, count, out):
    results = []
    for case in CASES[index::count]:
        record(results, "vector", case.name, lambda c=case: check_vector(c))
    Path(out).write_text(json.dumps(results))


def parallel(part, count, out_dir, extra=()):
    """Run ``--worker part`` in ``count`` processes (the Triton compiles happen in parallel); their results."""
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", part, "--index", str(i), "--count", str(count),
                               "--worker-out", str(out_dir / f"{part}-{i}.json"), *extra]) for i in range(count)]
    for p in procs:
        p.wait()
    results = []
    for i in range(count):
        path = out_dir / f"{part}-{i}.json"
        results += json.loads(path.read_text()) if path.exists() else [
            {"kind": part, "name": f"worker {i}", "ok": False, "detail": "worker wrote nothing"}]
    return results


# --- graphs and compile -------------------------------------------------------------------------------------------

def graph_checks(results):
    import torch
    import moe_torch

    def inputs(seed, T=256, dtype=torch.bfloat16, grad=False, bias=True):
        arrays = random_case(seed, T=T, H=256, I=128, E=16, k=4, bias=bias, empty_fraction=0.1)[0]
        return {n: torch.from_numpy(a).cuda() if n == "top_k_index" else
                torch.from_numpy(a).cuda().to(dtype).requires_grad_(grad) for n, a in arrays.items()}

    def cuda_graph():
        static = inputs(1)
        fresh = inputs(2)
        f = lambda: moe_torch.experts_forward(**static, implementation="triton")
        f()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = f()
        for name, t in fresh.items():
            static[name].copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        expected = moe_torch.experts_forward(**fresh, implementation="triton")
        return {"replay_equals_eager": bool(torch.equal(out, expected))}

    record(results, "cuda-graph", "capture and replay (inference)", cuda_graph)

    def compiled(mode, dtype, training):
        torch._dynamo.reset()
        ts = inputs(3, dtype=dtype, grad=training)
        fn = torch.compile(lambda **kw: moe_torch.experts_forward(**kw, implementation="triton"), fullgraph=True,
                           mode=None if mode == "default" else mode)
        for _ in range(3):  # the cudagraph modes record on a later call
            out = fn(**ts)
        expected = moe_torch.experts_forward(**ts, implementation="triton")
        detail = {"out_equal": bool(torch.equal(out, expected))}
        if training:
            g = torch.randn_like(out)
            grads = torch.autograd.grad(out, [ts["hidden_states"], ts["gate_up_proj"]], g)
            want = torch.autograd.grad(expected, [ts["hidden_states"], ts["gate_up_proj"]], g)
            detail["grads_equal"] = all(bool(torch.equal(a, b)) for a, b in zip(grads, want))
        if not all(detail.values()):
            raise AssertionError(detail)
        return detail

    support = SPEC.backends["triton"].support("torch").compile
    for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        for dtype in support.dtypes:
            for training in (False, True):
                record(results, "torch-compile", f"{mode}/{dtype}/{'train' if training else 'inference'}",
                       lambda m=mode, d=dtype, t=training: compiled(m, getattr(torch, d), t))

    def jax_grouped_mm():
        import jax
        import jax.numpy as jnp
        import moe_jax
        worst = 0.0
        for case in CASES:
            if case.dtype != "bfloat16":
                continue
            values = {n: jnp.asarray(a) if n == "top_k_index" else jnp.asarray(a).astype(jnp.bfloat16)
                      for n, a in case.inputs.items()}
            names = [n for n in DIFF_ARGS if n in values]
            f = jax.jit(lambda *d: moe_jax.experts_forward(**(values | dict(zip(names, d))),
                                                           implementation="grouped_mm", activation=case.activation))
            out, vjp = jax.vjp(f, *(values[n] for n in names))
            grads = vjp(jnp.asarray(case.grad_output.astype(np.float32)).astype(jnp.bfloat16))
            errs = [relative_l2(np.asarray(out.astype(jnp.float32)), case.expected["out"])]
            errs += [relative_l2(np.asarray(g.astype(jnp.float32)), case.expected[f"grad_{n}"])
                     for n, g in zip(names, grads)]
            worst = max(worst, *errs)
        text = f.lower(*(values[n] for n in names)).compile().as_text()
        if worst > SPEC.tolerance_for("bfloat16"):
            raise AssertionError(f"worst {worst}")
        return {"worst_rel_l2": worst, "triton_calls_in_hlo": text.count("moe_triton_launch"),
                "ragged_dot_in_hlo": text.count("ragged-dot")}

    record(results, "jax-grouped-mm", "grouped_mm on the Triton kernel (bf16 vectors)", jax_grouped_mm)

    def torch_profile():
        from torch.profiler import ProfilerActivity, profile
        ts = inputs(4)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            moe_torch.experts_forward(**ts, implementation="triton")
            torch.cuda.synchronize()
        return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})

    record(results, "kernels-ran", "torch triton forward T=256", torch_profile)


# --- tuning -------------------------------------------------------------------------------------------------------

C = plans.TileConfig
ROW_CANDIDATES = {
    "large": [C(128, 128, 64, 8, 3), C(128, 128, 64, 8, 3, 8), C(128, 128, 64, 8, 4, 8), C(64, 128, 64, 4, 4, 8),
              C(128, 256, 64, 8, 3, 8), C(128, 128, 32, 4, 4)],
    "mid": [C(64, 128, 64, 4, 3), C(64, 64, 64, 4, 4), C(32, 128, 64, 4, 4), C(64, 128, 64, 8, 3),
            C(32, 64, 128, 4, 3)],
    "small": [C(16, 64, 128, 4, 3), C(16, 128, 64, 4, 4), C(16, 64, 64, 4, 4), C(16, 32, 128, 4, 4),
              C(32, 64, 64, 4, 4)],
}
WGRAD_CANDIDATES = [C(64, 128, 128, 8, 3), C(32, 128, 128, 8, 3), C(64, 128, 64, 4, 3), C(64, 64, 128, 4, 4),
                    C(128, 128, 128, 8, 2)]
DECODE_CANDIDATES = [C(1, 32, 256, 4, 2), C(1, 16, 256, 4, 2), C(1, 64, 128, 4, 2), C(1, 16, 512, 4, 2),
                     C(1, 32, 128, 2, 2)]
FORWARD_TOKENS = (64, 1024, 8192)
BACKWARD_TOKENS = (8192,)
DECODE_TOKENS = (1, 2, 4)


def _rows_class(slots, E):
    rows = slots / E
    return "large" if rows >= 128 else "mid" if rows >= 32 else "small"


def tune_jobs():
    """(shape, T, kernel, N, K, candidate, mode) for every timing of the tuning."""
    jobs = []
    for shape, (H, I, E, k) in SHAPES.items():
        for T in FORWARD_TOKENS:
            for kernel, N, K in (("gate_up", I, H), ("down", H, I)):
                for c in ROW_CANDIDATES[_rows_class(T * k, E)]:
                    if kernel == "gate_up" and c.BN > 128:
                        continue
                    jobs.append((shape, T, kernel, N, K, c, "fwd"))
        for T in BACKWARD_TOKENS:
            for kernel, N, K in (("dgrad_down", I, H), ("dgrad_up", H, 2 * I)):
                for c in ROW_CANDIDATES[_rows_class(T * k, E)]:
                    jobs.append((shape, T, kernel, N, K, c, "bwd"))
            for N, K in ((H, I), (2 * I, H)):
                for c in WGRAD_CANDIDATES:
                    jobs.append((shape, T, "wgrad", N, K, c, "bwd"))
        for T in DECODE_TOKENS:
            for kernel_n, kernel_k in ((I, H), (H, I)):
                for c in DECODE_CANDIDATES:
                    jobs.append((shape, T, "decode", kernel_n, kernel_k, c, "decode"))
    return jobs


_STATE = {}


def _point(shape, T):
    """Weights and inputs of one shape and token count (cached), as the benchmark makes them."""
    import torch
    key = (shape, T)
    if key not in _STATE:
        H, I, E, k = SHAPES[shape]
        g = torch.Generator("cuda").manual_seed(zlib.crc32(repr(key).encode()))
        if shape not in _STATE:
            _STATE[shape] = (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * H**-0.5,
                             torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * I**-0.5)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(T, E, device="cuda", generator=g)
        w, idx = torch.topk(torch.softmax(logits, -1), k, -1)
        _STATE[key] = (x, idx, w.to(torch.bfloat16), torch.randn(T, H, device="cuda", dtype=torch.bfloat16,
                                                                 generator=g))
    return _STATE[shape], _STATE[key]


def _jax_point(shape, T) -> list:
    """``_point``'s inputs as JAX arrays (DLPack, no copies): x, ids (int32), routing weights, gate_up, down, dout."""
    import jax
    import torch
    (gate_up, down), (x, idx, w, dout) = _point(shape, T)
    return [jax.dlpack.from_dlpack(t.contiguous()) for t in (x, idx.to(torch.int32), w, gate_up, down, dout)]


def _callable(shape, T, mode):
    """The call the timing measures: the inference forward (sorted path, or the decode kernels), or the backward
    plan alone (from the residuals of one training forward)."""
    from moe_torch.backends import triton as backend
    (gate_up, down), (x, idx, w, dout) = _point(shape, T)
    problem = backend.problem_of(x, idx, gate_up, down, None, None, "silu")
    env = backend._inputs(x, idx, w, gate_up, down, None, None)
    if mode == "bwd":
        forward = plans.forward_plan(problem, training=True)
        base = backend.run_plan(forward, dict(env))
        env = env | {n: base[n] for n in forward.residuals} | {"dout": dout}
        plan = plans.backward_plan(problem)
    else:
        plan = _forward_with_decode_limit(problem, 1 << 30 if mode == "decode" else 0)
    return lambda: backend.run_plan(plan, dict(env))


def _forward_with_decode_limit(problem, limit):
    saved = plans.decode_max_slots
    plans.decode_max_slots = lambda device, p: limit
    try:
        plans.forward_plan.cache_clear()
        return plans.forward_plan(problem)
    finally:
        plans.decode_max_slots = saved
        plans.forward_plan.cache_clear()


def _with_candidate(job):
    shape, T, kernel, N, K, c, mode = job
    plans.OVERRIDES.clear()
    plans.OVERRIDES[kernel, N, K, SHAPES[shape][2]] = c
    plans.clear_caches()
    return _callable(shape, T, mode)


def tune_worker(index, count, out):
    import torch
    done = []
    for job in tune_jobs()[index::count]:
        try:
            _with_candidate(job)()
            torch.cuda.synchronize()
            done.append(True)
        except Exception:
            done.append(False)
    Path(out).write_text(json.dumps([{"kind": "tune-warm", "name": f"worker {index}", "ok": True,
                                      "detail": {"compiled": sum(done), "failed": done.count(False)}}]))


def _alone_ms(fn, calls: int) -> list[float]:
    """ms of each of ``calls`` calls of ``fn`` made alone: CUDA events from before its host work to the end of its
    device work, a sync before each (what the benchmark's ``ms`` and an eager decode step pay)."""
    import torch
    alone = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        alone.append(start.elapsed_time(end))
    return alone


def _alone_and_back_to_back_ms(fn, calls=30):
    """Median ms of ``fn`` called alone (``_alone_ms``) and ms per call of ``calls`` calls issued back to back (what
    CUDA graphs and a model's layers in a row see)."""
    import statistics
    import torch
    for _ in range(5):
        fn()
    alone = _alone_ms(fn, calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return statistics.median(alone), start.elapsed_time(end) / calls


def decode_thresholds(timings, tokens=(1, 2, 4, 8, 16)):
    """The decode threshold per shape ("HxIxE" -> slots): the largest slot count up to which the decode kernels
    beat the sorted path at every measured T both called alone (as the benchmark times a call: host-bound at these
    sizes) and back to back (device time); every timing appended to ``timings``."""
    decode = {}
    for shape, (H, I, E, k) in SHAPES.items():
        limit = 0
        for T in tokens:
            d, d_stream = _alone_and_back_to_back_ms(_callable(shape, T, "decode"))
            s, s_stream = _alone_and_back_to_back_ms(_callable(shape, T, "fwd"))
            timings.append({"shape": shape, "T": T, "decode_ms": d, "sorted_ms": s,
                            "decode_back_to_back_ms": d_stream, "sorted_back_to_back_ms": s_stream})
            if d < s and d_stream < s_stream and limit == (T // 2) * k:
                limit = T * k
        decode[f"{H}x{I}x{E}"] = limit
    return decode


def tune(results, configs_out: Path):
    import torch
    from triton.testing import do_bench
    timings = []
    for job in tune_jobs():
        shape, T, kernel, N, K, c, mode = job
        try:
            fn = _with_candidate(job)
            ms = do_bench(fn, warmup=5, rep=30)
            timings.append({"shape": shape, "T": T, "kernel": kernel, "N": N, "K": K, "E": SHAPES[shape][2],
                            "slots": T * SHAPES[shape][3], "config": c.__dict__, "ms": ms, "mode": mode})
        except Exception as err:
            timings.append({"shape": shape, "T": T, "kernel": kernel, "N": N, "K": K, "config": c.__dict__,
                            "error": f"{type(err).__name__}: {err}"[:300]})
        torch.cuda.synchronize()
    plans.OVERRIDES.clear()
    plans.clear_caches()
    best = {}
    for t in timings:
        if "ms" not in t:
            continue
        key = (t["kernel"], t["N"], t["K"], t["E"], t["slots"])
        if key not in best or t["ms"] < best[key]["ms"]:
            best[key] = t
    decode = decode_thresholds(timings)
    # the atomic combine (deterministic=False) against the deterministic one, inference forward
    for shape in SHAPES:
        for T in (64, 4096):
            (gate_up, down), (x, idx, w, _) = _point(shape, T)
            from moe_torch.backends import triton as backend
            with torch.no_grad():
                times = {d: do_bench(lambda d=d: backend.experts_forward(x, idx, w, gate_up, down, deterministic=d),
                                     warmup=5, rep=30) for d in (True, False)}
            timings.append({"shape": shape, "T": T, "deterministic_ms": times[True], "atomic_ms": times[False]})
    table = {
        "device": torch.cuda.get_device_name(),
        "measured_with": {"torch": torch.__version__, "triton": __import__("triton").__version__},
        "note": "written by tests/device_triton_check.py --parts tune: the fastest candidate per kernel, shape and "
                "slot count (triton.testing.do_bench median of the whole forward or backward plan)",
        "decode_max_slots": decode | {"default": 16},
        "configs": [{"kernel": t["kernel"], "N": t["N"], "K": t["K"], "E": t["E"], "slots": t["slots"],
                     "config": t["config"], "ms": round(t["ms"], 5)} for t in best.values()],
    }
    configs_out.mkdir(parents=True, exist_ok=True)
    (configs_out / f"{plans.device_file_name(table['device'])}.json").write_text(json.dumps(table, indent=1))
    results.append({"kind": "tune", "name": "tile configs", "ok": True,
                    "detail": {"entries": len(best), "decode_max_slots": decode, "timings": timings}})


# --- per-step timings and variants ------------------------------------------------------------------------------

STEP_POINTS = (("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 4096), ("deepseek-v3", 4096),
               ("qwen3-30b-a3b", 1), ("mixtral-8x7b", 1), ("deepseek-v3", 1), ("qwen3-30b-a3b", 8))
DECODE_STEP_TOKENS = 8  # points up to this many tokens time the decode plan; the others the forward and backward
STEP_VARIANTS = [C(128, 128, 64, 8, 3, 1), C(128, 128, 64, 8, 3, 8), C(128, 128, 64, 8, 4, 8),
                 C(128, 256, 64, 8, 3, 8), C(128, 64, 64, 4, 4, 8), C(128, 128, 32, 8, 5, 8), C(64, 128, 64, 4, 4, 8),
                 # the weight tiles through tensor descriptors (TMA) instead of masked pointers
                 C(128, 128, 64, 8, 3, 8, True), C(128, 128, 64, 8, 4, 8, True), C(128, 256, 64, 8, 3, 8, True),
                 C(64, 128, 64, 4, 4, 8, True), C(128, 64, 64, 4, 4, 8, True),
                 # and the K loop warp-specialized (loading and multiplying warps apart; 4 warps with warp
                 # specialization failed to compile on triton 3.6: PassManager::run failed)
                 C(128, 128, 64, 8, 3, 8, True, True), C(128, 256, 64, 8, 3, 8, True, True),
                 C(128, 128, 64, 8, 3, 8, False, True),
                 # 64-row blocks: at T=4096 deepseek-v3's experts take 128 rows on average and qwen3's 256, so
                 # 128-row blocks leave a third (a fifth) of the tile rows padding
                 C(64, 128, 64, 8, 4, 8), C(64, 256, 64, 8, 3, 8), C(64, 128, 128, 4, 3, 8),
                 C(64, 256, 64, 8, 3, 8, True),
                 # a few dozen rows per expert over large weights (mixtral-8x7b T=256: 64): the expert's row blocks
                 # taken together (GROUP_M), or one block per expert, so that each weight tile leaves HBM once
                 C(64, 64, 128, 4, 4, 8), C(32, 128, 64, 4, 4, 8), C(32, 64, 128, 4, 4, 8),
                 C(128, 128, 64, 8, 4, 8, SHORT_TAILS=1)]
WGRAD_STEP_VARIANTS = [C(64, 128, 128, 8, 3), C(32, 128, 128, 8, 3), C(64, 128, 64, 4, 3), C(64, 128, 128, 8, 4),
                       C(128, 128, 128, 8, 2), C(64, 256, 64, 8, 3), C(64, 128, 64, 4, 4),
                       # (rows per step, N, K): fewer rows per step make an expert's few hundred rows a loop long
                       # enough to pipeline, and larger output tiles read each row fewer times
                       C(32, 128, 128, 8, 4), C(32, 128, 256, 8, 3), C(32, 256, 128, 8, 3), C(16, 128, 128, 4, 4),
                       # the whole row steps through tensor descriptors (TMA), the last partial one through pointers
                       *(C(*c, TMA=True) for c in ((64, 128, 128, 8, 3), (64, 128, 128, 8, 4), (32, 128, 128, 8, 4),
                                                   (16, 128, 128, 4, 4), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3),
                                                   (128, 128, 64, 8, 3), (128, 128, 128, 8, 2)))]
# both operands through tensor descriptors: the row tiles (A_TMA; at inference the gate/up GEMM then reads x gathered
# into sorted order by a step before it, whose time is added to its own) and the weight tiles
ROW_TMA_STEP_VARIANTS = [C(*c, TMA=True, WARP_SPECIALIZE=ws, SHORT_TAILS=1, A_TMA=True) for c, ws in (
    ((128, 128, 64, 8, 3, 8), False), ((128, 128, 64, 8, 4, 8), False), ((128, 256, 64, 8, 3, 8), False),
    ((128, 128, 64, 8, 3, 8), True), ((128, 256, 64, 8, 3, 8), True), ((64, 128, 64, 4, 4, 8), False),
    ((64, 256, 64, 8, 3, 8), False), ((128, 128, 128, 8, 3, 8), False), ((64, 128, 128, 8, 3, 8), False))] + [
    # persistent: one or two programs per SM of the H200 (132), each looping over the output tiles
    C(*c, TMA=True, SHORT_TAILS=1, A_TMA=True, PROGRAMS=p) for c, p in (
        ((128, 128, 64, 8, 3, 8), 132), ((128, 128, 64, 8, 3, 8), 264), ((128, 256, 64, 8, 3, 8), 132))]
# Persistent weight-gradient programs (132, 264 or 396 programs, one flat loop over their tiles' row steps) were
# slower than one program per tile for every step and shape (tests/device_results/nvidia-h200-triton-steps-wgrad-
# persistent.json), so the kernel has no such mode.
# Warp-specialized (triton's Hopper pass splits the K loop into TMA-loading and multiplying warps): it applies only
# at 4 warps (at 8 the same code comes out as without it) and only without a reduction over the experts ahead of
# the loop, hence the block table; both operands through descriptors (the pass fails on pointer-loaded rows).
WS_STEP_VARIANTS = [C(*c, TMA=True, A_TMA=True, WARP_SPECIALIZE=True, BLOCK_TABLE=True, SHORT_TAILS=t, PROGRAMS=p)
                    for c, t, p in (((128, 128, 64, 4, 3, 8), 1, 0), ((128, 128, 64, 4, 4, 8), 1, 0),
                                    ((128, 64, 64, 4, 4, 8), 1, 0), ((64, 128, 64, 4, 4, 8), 0, 0),
                                    ((128, 128, 64, 4, 3, 8), 0, 132), ((128, 64, 64, 4, 4, 8), 0, 132))]
# 256-row blocks over 16 warps (four warpgroups): per K step twice the multiplies of a 128-row tile for one more
# row tile's bytes, where the rows per expert fill them (qwen3-30b-a3b from T=4096, mixtral-8x7b from T=1024). On
# the H100 none beat a step's own config (tests/device_results/nvidia-h100-triton-steps-wide.json): gate/up's two
# 256x128 accumulators starve 16 warps of registers (3-8 ms against 0.49 at qwen3 T=4096).
WIDE_STEP_VARIANTS = [C(256, 128, 64, 16, 3, 8), C(256, 128, 64, 16, 3, 8, SHORT_TAILS=1),
                      C(256, 128, 64, 16, 3, 8, True), C(256, 128, 32, 16, 4, 8), C(256, 64, 64, 8, 3, 8),
                      C(256, 64, 64, 8, 4, 8, SHORT_TAILS=1), C(256, 64, 64, 16, 4, 8), C(256, 64, 64, 8, 3, 8, True),
                      C(256, 256, 64, 16, 3, 8), C(256, 128, 64, 16, 4, 8), C(256, 128, 64, 8, 3, 8)]
VARIANT_TOKENS = 4096
# GEMV tiles of the decode kernels (BM unused): wider loads and more warps keep more bytes in flight per SM
DECODE_STEP_VARIANTS = [C(1, 16, 256, 4, 2), C(1, 32, 256, 4, 2), C(1, 16, 512, 4, 2), C(1, 16, 512, 8, 2),
                        C(1, 32, 512, 8, 2), C(1, 16, 1024, 8, 2), C(1, 8, 1024, 8, 2), C(1, 8, 512, 4, 2),
                        C(1, 32, 256, 8, 3), C(1, 64, 256, 8, 2), C(1, 16, 256, 4, 3), C(1, 8, 2048, 8, 2),
                        # the down kernel's [k, BN, BK] blocks: narrower tiles keep them in registers
                        C(1, 4, 256, 4, 2), C(1, 4, 512, 4, 2), C(1, 8, 256, 8, 2), C(1, 4, 1024, 8, 2),
                        C(1, 2, 1024, 4, 2), C(1, 8, 128, 4, 3), C(1, 16, 128, 8, 2),
                        # and the down kernel one or two experts' tiles at a time
                        *(C(1, bn, bk, w, 2, EXPERTS_TOGETHER=j) for j in (1, 2)
                          for bn, bk, w in ((2, 1024, 4), (8, 2048, 8), (16, 512, 8), (4, 256, 4)))]
# The decode kernels' products through tl.dot (a slot's row as the first of 16, its weight loads pipelined over
# num_stages) and the down projection per slot with the combine kernel after it were no faster than these tiles at
# any decode point on the H100 (tests/device_results/nvidia-h100-triton-decode-mma.json), so the kernels have no
# such modes.
# kind -> (kernels, the candidates given the step's own config, the token counts it runs at: None for every point)
VARIANTS = {
    "gemm": (("grouped_gemm_kernel",), lambda own: STEP_VARIANTS, (VARIANT_TOKENS,)),
    "wgrad": (("grouped_wgrad_kernel",), lambda own: WGRAD_STEP_VARIANTS, (VARIANT_TOKENS,)),
    # the step's own config with shorter tiles for the experts' last blocks (0: as it is, timed in the same run)
    # the step's own config with its row tiles through tensor descriptors, then ROW_TMA_STEP_VARIANTS
    "rows": (("grouped_gemm_kernel",), lambda own: [replace(own, TMA=True, A_TMA=True), *ROW_TMA_STEP_VARIANTS],
             None),
    "tails": (("grouped_gemm_kernel",), lambda own: [replace(own, SHORT_TAILS=n) for n in range(4)], None),
    "wide": (("grouped_gemm_kernel",), lambda own: WIDE_STEP_VARIANTS, None),
    # the step's own config with a block table (its cost alone), then WS_STEP_VARIANTS
    "ws": (("grouped_gemm_kernel",), lambda own: [replace(own, BLOCK_TABLE=True), *WS_STEP_VARIANTS], None),
    "decode": (("decode_gate_up_kernel", "decode_down_combine_kernel"), lambda own: [own, *DECODE_STEP_VARIANTS],
               None),
}


def _labelled_steps(problem, which):
    """(label, step) of a plan's GEMM steps: the tile-config kernel names, in plan order."""
    if which == "bwd":
        plan = plans.backward_plan(problem)
        labels = iter(("dgrad_down", "dgrad_up", "wgrad_down", "wgrad_gate_up"))
    elif which == "decode":
        plan = _forward_with_decode_limit(problem, 1 << 30)
        return plan, [({"decode_gate_up_kernel": "decode_gate_up", "decode_down_combine_kernel": "decode_down"}[
            s.kernel], s) for s in plan.steps]
    else:
        plan = _forward_with_decode_limit(problem, 0)
        labels = iter(("gate_up", "down"))
    return plan, [(next(labels) if s.kernel in ("grouped_gemm_kernel", "grouped_wgrad_kernel") else s.kernel, s)
                  for s in plan.steps]


def _step_flops(step, S):
    c = step.constants
    if step.kernel == "grouped_gemm_kernel":
        return 2 * S * c["N"] * c["K"] * (2 if c["EPILOGUE"] == plans.GATED_FORWARD else 1)
    if step.kernel == "grouped_wgrad_kernel":
        return 2 * S * c["N"] * c["K"]
    return 0


def step_timings(results, variant_kinds=("gemm", "wgrad"), tokens=None, points=STEP_POINTS, which_plans=None,
                 variants_at_every_point=False):
    """Each step of the inference forward and of the backward (at decode sizes: of the decode plan) timed alone
    (do_bench median), then the GEMM or GEMV steps under the variants of ``variant_kinds``: where the time goes,
    and which tiles to take. ``tokens``: only the points of these token counts. ``points``: (shape, T) pairs.
    ``which_plans``: only these plans ("fwd", "bwd", "decode"). ``variants_at_every_point``: the GEMM variants at
    every point, not only at VARIANT_TOKENS."""
    import torch
    from triton.testing import do_bench
    import triton
    from moe_torch.backends import triton as backend
    kernels = backend._kernels()
    triton.set_allocator(backend._descriptor_workspace)  # run_plan sets it too; the steps here launch without it

    def launcher(step, env):
        args = [env[a] if isinstance(a, str) else a for a in step.inputs]
        outs = [env[b.name] if b.name in env else env.setdefault(b.name, torch.empty(
            b.shape, dtype=backend._dtypes(env)[b.dtype] if b.dtype in backend._dtypes(env) else torch.float32,
            device="cuda")) for b in step.outputs]
        fn = getattr(kernels, step.kernel)
        return lambda: fn[(step.grid,)](*args, *outs, num_warps=step.num_warps, num_stages=step.num_stages,
                                        **step.constants)

    for shape, T in points:
        if tokens is not None and T not in tokens:
            continue
        H, I = SHAPES[shape][:2]
        (gate_up, down), (x, idx, w, dout) = _point(shape, T)
        problem = backend.problem_of(x, idx, gate_up, down, None, None, "silu")
        base = backend._inputs(x, idx, w, gate_up, down, None, None)
        training = backend.run_plan(plans.forward_plan(problem, training=True), dict(base))
        routed = int(training["starts"][-1])
        if T <= DECODE_STEP_TOKENS:
            runs = {"decode": lambda: backend.run_plan(_forward_with_decode_limit(problem, 1 << 30), dict(base))}
        else:
            runs = {"fwd": lambda: backend.run_plan(_forward_with_decode_limit(problem, 0), dict(base)),
                    "bwd": lambda: backend.run_plan(plans.backward_plan(problem), dict(training) | {"dout": dout})}
        envs = {which: run() for which, run in runs.items() if which_plans is None or which in which_plans}
        if "fwd" in envs:  # for the gate/up variants that read x in sorted order
            envs["fwd"].setdefault("x_sorted", training["x_sorted"])
        for which in envs:
            def measure(label, step, env=envs[which], plan=None, tables=()):
                written = [t for t in tables if t.outputs[0].name in step.inputs]
                for table in written:  # a block table the variant's plan writes for this step: made first
                    launcher(table, env)()
                ms = do_bench(launcher(step, env), warmup=5, rep=40)
                flops = _step_flops(step, routed)
                c = step.constants
                out = {"shape": shape, "T": T, "plan": which, "step": label, "ms": round(ms, 4),
                       "tflops": round(flops / ms / 1e9, 1) if flops else None,
                       "config": [c.get("BM", c.get("BR")), c.get("BN"), c.get("BK"), step.num_warps,
                                  step.num_stages, c.get("GROUP_M"), c.get("B_DESC", c.get("DESC")),
                                  c.get("WARP_SPECIALIZE"), c.get("SHORT_TAILS"), c.get("A_DESC"),
                                  c.get("PROGRAMS"), c.get("JB"), c.get("BLOCK_TABLE")]}
                gathers = [g for g in (plan.steps if plan else ()) if g.kernel == "gather_rows_kernel"
                           and g.outputs[0].name == step.inputs[0]]
                if gathers:  # a gather this plan adds for this step alone: its time is the step's too
                    out["gather_ms"] = round(do_bench(launcher(gathers[0], env), warmup=5, rep=40), 4)
                    out["ms"] = round(ms + out["gather_ms"], 4)
                if written:  # and so is the time of writing its block table
                    out["table_ms"] = round(sum(do_bench(launcher(t, env), warmup=5, rep=40) for t in written), 4)
                    out["ms"] = round(out["ms"] + out["table_ms"], 4)
                return out

            plan, labelled = _labelled_steps(problem, which)
            record(results, "steps", f"{shape} T={T} {which}",
                   lambda lab=labelled, m=measure: [m(label, step) for label, step in lab])
            for (label, step), kind in itertools.product(labelled, variant_kinds):
                kernels_of_kind, candidates_of, kind_tokens = VARIANTS[kind]
                if step.kernel not in kernels_of_kind or (kind_tokens is not None and T not in kind_tokens
                                                          and not variants_at_every_point):
                    continue
                key, N, K = STEP_KEYS[label](H, I)
                candidates = candidates_of(plans.tile_config(problem.device, key, N, K, problem.E, problem.S))

                def variants(label=label, key=(key, N, K, problem.E), m=measure, candidates=candidates):
                    out = []
                    for v in candidates:
                        plans.OVERRIDES.clear()
                        plans.OVERRIDES[key] = v
                        plans.clear_caches()
                        plan, labelled_now = _labelled_steps(problem, which)
                        step = dict(labelled_now)[label]
                        try:
                            out.append(m(label, step, plan=plan if which == "fwd" else None,
                                         tables=[t for t in plan.steps if t.kernel == "route_blocks_kernel"]))
                        except Exception as err:
                            out.append({"config": list(v.__dict__.values()), "error": str(err)[:200]})
                    plans.OVERRIDES.clear()
                    plans.clear_caches()
                    return out

                record(results, "step-variants", f"{shape} T={T} {label} ({kind})", variants)
        torch.cuda.empty_cache()


def _step_points(text: str) -> tuple[tuple[str, int], ...]:
    points = []
    for item in text.split(","):
        shape, _, tokens = item.partition(":")
        if shape not in SHAPES or not tokens.isdigit():
            raise SystemExit(f"expected shape:T pairs with a shape of {sorted(SHAPES)}, got {item!r}")
        points.append((shape, int(tokens)))
    return tuple(points)


# the (kernel, N, K) of each labelled GEMM step of a shape (H, I): the keys of the tile-config table
STEP_KEYS = {"gate_up": lambda H, I: ("gate_up", I, H), "down": lambda H, I: ("down", H, I),
             "dgrad_down": lambda H, I: ("dgrad_down", I, H), "dgrad_up": lambda H, I: ("dgrad_up", H, 2 * I),
             "wgrad_down": lambda H, I: ("wgrad", H, I), "wgrad_gate_up": lambda H, I: ("wgrad", 2 * I, H),
             "decode_gate_up": lambda H, I: ("decode", I, H), "decode_down": lambda H, I: ("decode", H, I)}
CONFIG_FIELDS = ("BM", "BN", "BK", "num_warps", "num_stages", "GROUP_M", "TMA", "WARP_SPECIALIZE", "SHORT_TAILS",
                 "A_TMA", "PROGRAMS", "EXPERTS_TOGETHER", "BLOCK_TABLE")


MERGE_MARGIN = 0.05  # a variant replaces the step's own config only when this much faster (run-to-run noise)


def merge_step_variants(result_files, table_path: Path) -> list[dict]:
    """Write the fastest measured variant of each GEMM step (``--parts steps`` results) into the tile-config table
    as a ``"timed": "step alone"`` entry, replacing the entry of the same kernel, shape and slot count, where it
    beats the config the step ran with (timed alone in the same results) by MERGE_MARGIN. Returns the entries
    written."""
    best, own = {}, {}
    for path in result_files:
        for r in json.loads(Path(path).read_text())["results"]:
            if r["kind"] == "steps" and isinstance(r["detail"], list):
                for t in r["detail"]:
                    if t.get("ms") is not None and t["step"] in STEP_KEYS:
                        H, I, E, k = SHAPES[t["shape"]]
                        own[(*STEP_KEYS[t["step"]](H, I), E, t["T"] * k)] = t["ms"]
            if r["kind"] != "step-variants":
                continue
            for t in r["detail"]:
                if t.get("ms") is None:
                    continue
                H, I, E, k = SHAPES[t["shape"]]
                kernel, N, K = STEP_KEYS[t["step"]](H, I)
                key = (kernel, N, K, E, t["T"] * k)
                if key not in best or t["ms"] < best[key]["ms"]:
                    best[key] = t | {"source": Path(path).name}
    written = []
    for (kernel, N, K, E, slots), t in best.items():
        if (kernel, N, K, E, slots) in own and t["ms"] > own[kernel, N, K, E, slots] * (1 - MERGE_MARGIN):
            continue
        config = dict(zip(CONFIG_FIELDS, t["config"]))
        config = {f: v for f, v in config.items() if v is not None}
        for flag in ("TMA", "A_TMA", "BLOCK_TABLE"):
            if flag in config:
                config[flag] = bool(config[flag])
        written.append({"kernel": kernel, "N": N, "K": K, "E": E, "slots": slots, "config": config, "ms": t["ms"],
                        "timed": "step alone", "source": t["source"]})
    table = json.loads(table_path.read_text())
    keys = {(w["kernel"], w["N"], w["K"], w["E"], w["slots"]) for w in written}
    table["configs"] = [c for c in table["configs"]
                        if (c["kernel"], c["N"], c["K"], c["E"], c["slots"]) not in keys] + written
    table_path.write_text(json.dumps(table, indent=1) + "\n")
    return written


# --- where a whole call's time goes --------------------------------------------------------------------------------

PROFILE_POINTS = (("qwen3-30b-a3b", 4096), ("mixtral-8x7b", 4096), ("deepseek-v3", 4096))


def profile_calls(results):
    """The public torch call (``moe_torch.experts_forward``, implementation="triton"), forward at inference and
    forward+backward, timed as the benchmark times it (CUDA events around one call, and 20 calls back to back, with
    the host's time to issue each) and under torch.profiler: each kernel's mean time per call, so the sum of the
    kernels can be set against the call."""
    import torch
    import moe_torch
    from torch.profiler import ProfilerActivity, profile

    def run(shape, T, mode):
        (gate_up, down), (x, idx, w, dout) = _point(shape, T)
        leaves = [t.detach().requires_grad_(mode == "fwd+bwd") for t in (x, w, gate_up, down)]

        def call():
            if mode == "fwd":
                with torch.no_grad():
                    return moe_torch.experts_forward(x, idx, w, gate_up, down, implementation="triton",
                                                     validate=False)
            out = moe_torch.experts_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3],
                                            implementation="triton", validate=False)
            return torch.autograd.grad(out, leaves, dout)

        for _ in range(3):
            call()
        single = _alone_ms(call, 10)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host = []
        for _ in range(20):
            t0 = time.perf_counter()
            call()
            host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        stream = start.elapsed_time(end) / 20
        calls = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        kernels = {}
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" and ev.count:
                kernels[ev.key] = {"ms_per_call": round(ev.device_time_total / calls / 1e3, 4),
                                   "launches_per_call": ev.count / calls}
        total = sum(v["ms_per_call"] for v in kernels.values())
        return {"call_ms_median": round(float(np.median(single)), 4), "stream_ms": round(stream, 4),
                "host_ms_median": round(float(np.median(host)), 4),
                "kernels_ms": round(total, 4),
                "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["ms_per_call"]))}

    for (shape, T), mode in itertools.product(PROFILE_POINTS, ("fwd", "fwd+bwd")):
        record(results, "profile", f"{shape} T={T} {mode}", lambda shape=shape, T=T, mode=mode: run(shape, T, mode))
    torch.cuda.empty_cache()


def host_profile(results, points=(("qwen3-30b-a3b", 1), ("mixtral-8x7b", 1), ("qwen3-30b-a3b", 4096)),
                 modes=("fwd",), calls=300):
    """Where the host's time per torch call goes (eager; the inference forward, or with ``fwd+bwd`` the forward and
    every gradient): cProfile over ``calls`` calls, the functions with the most own time, per call."""
    import cProfile
    import pstats
    import torch
    import moe_torch

    def run(shape, T, mode):
        (gate_up, down), (x, idx, w, dout) = _point(shape, T)
        training = mode == "fwd+bwd"
        leaves = [t.detach().requires_grad_(training) for t in (x, w, gate_up, down)]

        def call():
            with torch.set_grad_enabled(training):
                out = moe_torch.experts_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3],
                                                implementation="triton", validate=False)
                return torch.autograd.grad(out, leaves, dout) if training else out

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        host = (time.perf_counter() - t0) / calls * 1e3
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(profiler).stats
        rows = sorted(((v[2], v[3], v[0], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in stats.items()),
                      reverse=True)[:25]
        return {"host_ms_per_call": round(host, 4),
                "top_own_time_us_per_call": [{"fn": name, "own_us": round(own / calls * 1e6, 2),
                                              "cum_us": round(cum / calls * 1e6, 2), "calls": n / calls}
                                             for own, cum, n, name in rows]}

    for (shape, T), mode in itertools.product(points, modes):
        record(results, "host-profile", f"{shape} T={T} {mode}",
               lambda shape=shape, T=T, mode=mode: run(shape, T, mode))


def jax_profile_calls(results):
    """The JAX calls of ``profile_calls``, timed on the host (``jax_call_times``), under this process's XLA_FLAGS."""
    for (shape, T), mode in itertools.product(PROFILE_POINTS, ("fwd", "fwd+bwd")):
        record(results, "jax-profile", f"{shape} T={T} {mode}",
               lambda shape=shape, T=T, mode=mode: jax_call_times(shape, T, mode))
    record(results, "jax-profile", "a one-element jitted add (JAX's own latency per call)", jax_call_times)


def _clock(call, wait):
    """Single calls (wall, to ``wait(result)`` returning), 20 back to back, and the time to issue one."""
    for _ in range(3):
        wait(call())
    single = []
    for _ in range(10):
        t0 = time.perf_counter()
        wait(call())
        single.append((time.perf_counter() - t0) * 1e3)
    host, outs = [], []
    t0 = time.perf_counter()
    for _ in range(20):
        t1 = time.perf_counter()
        outs.append(call())
        host.append((time.perf_counter() - t1) * 1e3)
    wait(outs)
    stream = (time.perf_counter() - t0) * 1e3 / 20
    return {"call_ms_median": round(float(np.median(single)), 4), "stream_ms": round(stream, 4),
            "host_ms_median": round(float(np.median(host)), 4)}


def jax_call_times(shape=None, T=None, mode=None):
    """The JAX call of the benchmark (moe_jax.experts_forward, implementation="triton", jitted; fwd+bwd returns
    the output and waits for the whole call) timed on the host, through ``jax.jit`` and through the compiled
    executable the benchmark calls; without a shape, a one-element add: JAX's own time per call."""
    import jax
    import jax.numpy as jnp
    import moe_jax
    if shape is None:
        one, add = jnp.ones((1,), jnp.float32), jax.jit(lambda a: a + 1)
        return _clock(lambda: add(one), jax.block_until_ready)
    arrays = _jax_point(shape, T)

    def forward(x, idx, w, gate_up, down):
        return moe_jax.experts_forward(x, idx, w, gate_up, down, implementation="triton", validate=False)

    def forward_backward(x, idx, w, gate_up, down, g):
        out, vjp = jax.vjp(lambda x, w, gate_up, down: forward(x, idx, w, gate_up, down), x, w, gate_up, down)
        return out, vjp(g)

    fn, args = (forward, arrays[:5]) if mode == "fwd" else (forward_backward, arrays)
    jitted = jax.jit(fn)
    executable = jitted.lower(*args).compile()
    pick = (lambda r: r) if mode == "fwd" else (lambda r: r[0])
    hlo = executable.as_text()
    return {"jit": _clock(lambda: pick(jitted(*args)), jax.block_until_ready),
            "executable": _clock(lambda: pick(executable(*args)), jax.block_until_ready),
            "hlo_ops": {op: hlo.count(f" {op}(") for op in ("custom-call", "fusion", "copy", "command_buffer")},
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


FRAMEWORK_POINTS = (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 2), ("qwen3-30b-a3b", 8), ("mixtral-8x7b", 1),
                    ("mixtral-8x7b", 2), ("deepseek-v3", 1), ("qwen3-30b-a3b", 4096), ("mixtral-8x7b", 4096))


def _device_kernels(run, calls: int = 10) -> dict:
    """Each GPU kernel ``run`` ran under torch.profiler (CUPTI sees every kernel of the process, XLA's launches
    included): name -> device ms per call and launches per call."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(calls)
    kernels = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            k = kernels.setdefault(ev.name, [0.0, 0])
            k[0] += ev.time_range.elapsed_us() / 1e3
            k[1] += 1
    return {name: {"ms_per_call": round(ms / calls, 4), "launches_per_call": n / calls}
            for name, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])}


def framework_kernels(results, points=FRAMEWORK_POINTS, modes=("fwd",)):
    """Torch's and JAX's ``triton`` call on the same inputs, the inference forward (``fwd``) or the forward and
    every gradient (``fwd+bwd``, as the benchmark calls them): each GPU kernel's device time per call in each
    framework (one profiler sees both), the call alone and back to back (host clock, as ``_clock``), and which
    ptxas each side's kernels were assembled by (triton's own for torch; jaxlib assembles the PTX it is given with
    XLA's)."""
    import jax
    import torch
    import moe_jax
    import moe_torch

    def ptxas_versions():
        import shutil
        import subprocess
        from triton.backends.nvidia import compiler as nvidia
        found = {"triton": nvidia.get_ptxas(90).path, "PATH": shutil.which("ptxas"),
                 "/usr/local/cuda": "/usr/local/cuda/bin/ptxas"}
        for root in map(Path, sys.path):
            for candidate in root.glob("nvidia/*/bin/ptxas"):
                found[str(candidate.parent.parent.relative_to(root))] = str(candidate)
        versions = {}
        for name, path in found.items():
            if path and Path(path).exists():
                out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip()
                versions[name] = {"path": path, "version": out.splitlines()[-1] if out else ""}
        return {"ptxas": versions, "TRITON_PTXAS_PATH": os.environ.get("TRITON_PTXAS_PATH", ""),
                "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}

    record(results, "framework-kernels", "ptxas", ptxas_versions)

    def jax_forward_backward(x, idx, w, gate_up, down, dout):
        def forward(x, w, gate_up, down):
            return moe_jax.experts_forward(x, idx, w, gate_up, down, implementation="triton", validate=False)
        out, vjp = jax.vjp(forward, x, w, gate_up, down)
        return out, vjp(dout)

    def run(shape, T, mode):
        (gate_up, down), (x, idx, w, dout) = _point(shape, T)
        training = mode == "fwd+bwd"
        arrays = _jax_point(shape, T)[:6 if training else 5]
        if training:  # the output and the gradients (returning the output alone would let XLA drop the backward)
            jitted = jax.jit(jax_forward_backward)
        else:
            jitted = jax.jit(lambda *a: moe_jax.experts_forward(*a, implementation="triton", validate=False))
        output = (lambda result: result[0]) if training else (lambda result: result)
        leaves = [t.detach().requires_grad_(training) for t in (x, w, gate_up, down)]

        def torch_call():
            with torch.set_grad_enabled(training):
                out = moe_torch.experts_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3],
                                                implementation="triton", validate=False)
                if training:
                    torch.autograd.grad(out, leaves, dout)
                return out.detach()

        def torch_calls(n):
            for _ in range(n):
                torch_call()
            torch.cuda.synchronize()

        def jax_calls(n):
            jax.block_until_ready([jitted(*arrays) for _ in range(n)])

        same = bool(np.array_equal(torch_call().float().cpu().numpy(),
                                   np.asarray(output(jitted(*arrays)).astype(np.float32))))
        detail = {"bit_identical": same}
        for name, calls, clock in (("torch", torch_calls, _clock_torch(torch_call)),
                                   ("jax", jax_calls, _clock(lambda: jitted(*arrays), jax.block_until_ready))):
            calls(3)
            kernels = _device_kernels(calls)
            detail[name] = clock | {"kernels_ms": round(sum(v["ms_per_call"] for v in kernels.values()), 4),
                                    "kernels": kernels}
        return detail

    for (shape, T), mode in itertools.product(points, modes):
        record(results, "framework-kernels", f"{shape} T={T} {mode}",
               lambda shape=shape, T=T, mode=mode: run(shape, T, mode))
    torch.cuda.empty_cache()


LAUNCHER_POINTS = (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 4), ("qwen3-30b-a3b", 64), ("qwen3-30b-a3b", 256),
                   ("qwen3-30b-a3b", 1024), ("qwen3-30b-a3b", 4096), ("mixtral-8x7b", 64), ("mixtral-8x7b", 4096),
                   ("deepseek-v3", 4096))


def _clock_torch(call):
    """``_clock`` for a torch call on CUDA: waiting is a device synchronisation."""
    import torch
    return _clock(call, lambda result: torch.cuda.synchronize())


def torch_call_times(shape, T, mode):
    """The torch call of the benchmark (moe_torch.experts_forward, implementation="triton"; fwd+bwd with every
    gradient) on the host's clock."""
    import torch
    import moe_torch
    (gate_up, down), (x, idx, w, dout) = _point(shape, T)
    leaves = [t.detach().requires_grad_(mode != "fwd") for t in (x, w, gate_up, down)]

    def call():
        out = moe_torch.experts_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], implementation="triton",
                                        validate=False)
        if mode != "fwd":
            return torch.autograd.grad(out, leaves, dout)
        return out

    if mode == "fwd":
        with torch.no_grad():
            return _clock_torch(call)
    return _clock_torch(call)


def launcher_timings(results):
    """The JAX call with tensor descriptors where the tiles ask (its default launcher) and with pointer loads only
    (what jax_triton's launch allowed), and the torch call, alternating, each on the host's clock."""
    from moe_jax.backends import triton as jax_backend
    launchers = {"xla": jax_backend.XLA_LAUNCHER,
                 "pointers": replace(jax_backend.XLA_LAUNCHER, tensor_descriptors=False)}
    for (shape, T), mode in itertools.product(LAUNCHER_POINTS, ("fwd", "fwd+bwd")):
        def run(shape=shape, T=T, mode=mode):
            out = {}
            for round_ in range(2):
                for name, launcher in launchers.items():
                    with jax_backend.use_launcher(launcher):
                        out.setdefault(name, []).append(jax_call_times(shape, T, mode)["executable"])
                out.setdefault("torch", []).append(torch_call_times(shape, T, mode))
            best = {name: {key: min(r[key] for r in rounds) for key in ("call_ms_median", "stream_ms")}
                    for name, rounds in out.items()}
            best["jax/torch call"] = {name: round(best[name]["call_ms_median"] / best["torch"]["call_ms_median"], 3)
                                      for name in launchers}
            best["jax/torch stream"] = {name: round(best[name]["stream_ms"] / best["torch"]["stream_ms"], 3)
                                        for name in launchers}
            return best
        record(results, "launchers", f"{shape} T={T} {mode}", run)


OWN_LAUNCH_POINTS = (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 8), ("qwen3-30b-a3b", 64), ("mixtral-8x7b", 1),
                     ("deepseek-v3", 1), ("qwen3-30b-a3b", 4096), ("mixtral-8x7b", 4096))


def _jax_results(shape, T, mode) -> list:
    """The JAX call's output (and for fwd+bwd its gradients) as bits on the host, under the current launcher."""
    import jax
    import moe_jax
    x, idx, w, gate_up, down, dout = _jax_point(shape, T)

    def forward(x, w, gate_up, down):
        return moe_jax.experts_forward(x, idx, w, gate_up, down, implementation="triton", validate=False)

    if mode == "fwd":
        arrays = [jax.jit(forward)(x, w, gate_up, down)]
    else:
        out, vjp = jax.vjp(forward, x, w, gate_up, down)
        arrays = [out, *vjp(dout)]
    return [_host_bits(a) for a in arrays]


def _host_bits(array) -> np.ndarray:
    """A JAX array's bits on the host, as unsigned integers: no program of its own runs on the device (a float32
    copy of deepseek-v3's weight gradients did not fit on an 80 GiB card)."""
    import jax
    host = np.asarray(jax.device_get(array))
    return host.view(f"u{host.dtype.itemsize}")


def own_launcher(results, points=OWN_LAUNCH_POINTS, modes=("fwd", "fwd+bwd")):
    """moe_jax's own Triton launcher (``XLA_LAUNCHER``: the XLA FFI target ``moe_triton_launch``, triton's cubin)
    against jaxlib's (``JAXLIB_LAUNCHER``, the PTX in each call's opaque string) and the torch call: the same bits
    from both launchers, and each call's time on the host's clock (``jax_call_times``), two alternating rounds,
    the best of each; then what the launcher answers to a kernel id it never gave."""
    import jax
    import jax.numpy as jnp
    from moe_jax import triton_call
    from moe_jax.backends import triton as jax_backend
    launchers = {"moe": jax_backend.XLA_LAUNCHER, "graphed": jax_backend.GRAPHED_LAUNCHER,
                 "jaxlib": jax_backend.JAXLIB_LAUNCHER}

    def run(shape, T, mode):
        outputs = {}
        for name, launcher in launchers.items():
            with jax_backend.use_launcher(launcher):
                outputs[name] = _jax_results(shape, T, mode)
        detail = {"bit_identical": [bool(np.array_equal(a, b)) for name in launchers if name != "moe"
                                    for a, b in zip(outputs["moe"], outputs[name])]}
        if not all(detail["bit_identical"]):
            raise AssertionError(f"the launchers disagree: {detail}")
        rounds = {}
        for _ in range(2):
            for name, launcher in launchers.items():
                with jax_backend.use_launcher(launcher):
                    rounds.setdefault(name, []).append(jax_call_times(shape, T, mode))
            rounds.setdefault("torch", []).append({"executable": torch_call_times(shape, T, mode)})
        keys = ("call_ms_median", "stream_ms", "host_ms_median")
        best = {name: {way: {key: min(r[way][key] for r in runs) for key in keys}
                       for way in runs[0] if way in ("jit", "executable")} for name, runs in rounds.items()}
        torch_best = best["torch"]["executable"]
        for name in launchers:
            best[name]["jax/torch"] = {way: {key: round(best[name][way][key] / torch_best[key], 3)
                                             for key in ("call_ms_median", "stream_ms")}
                                       for way in ("jit", "executable")}
        return detail | best

    for (shape, T), mode in itertools.product(points, modes):
        record(results, "own-launcher", f"{shape} T={T} {mode}",
               lambda shape=shape, T=T, mode=mode: run(shape, T, mode))
    record(results, "own-launcher", "a one-element jitted add (JAX's own time per call)", jax_call_times)

    def unknown_id():
        triton_call._launcher_library()
        call = jax.ffi.ffi_call(triton_call.LAUNCH_TARGET, jax.ShapeDtypeStruct((4,), jnp.float32))
        try:
            jax.block_until_ready(call(jnp.zeros(4), kernel=np.int64(1 << 40), grid=np.int64(1),
                                       parameters=np.array([0, 0, 1, 0], np.int64)))
        except Exception as error:  # XLA's error type differs between versions
            if "expected an id from moe_triton_register" not in str(error):
                raise
            return {"error": str(error)[:400]}
        raise AssertionError("an unknown kernel id was launched")

    record(results, "own-launcher", "an unknown kernel id is refused", unknown_id)


GRAPHED_POINTS = (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 64), ("mixtral-8x7b", 1), ("qwen3-30b-a3b", 4096))


def graphed_replays(results, points=GRAPHED_POINTS, modes=("fwd", "fwd+bwd"), rounds=4):
    """``GRAPHED_LAUNCHER`` (calls XLA may trace into CUDA graphs) against ``XLA_LAUNCHER``, each one compiled
    executable: three input sets (other tokens, experts, routing weights and output gradients) called in turn for
    ``rounds`` rounds, each set also as fresh copies (new buffer addresses). Every output must have the bits of
    the direct launcher's for its set: a replayed or re-traced graph never hands back a stale result. Run it with
    ``XLA_FLAGS=--xla_gpu_graph_min_graph_size=2``: at XLA's default (5) the decode programs (2 to 4 launches) form
    no graph, and the part fails saying that nothing was captured."""
    import jax
    import jax.numpy as jnp
    import moe_jax
    from moe_jax import triton_call
    from moe_jax.backends import triton as jax_backend

    def program(mode):  # new functions each time: jax.jit's trace cache would hand back the other launcher's
        def forward(x, idx, w, gate_up, down):
            return moe_jax.experts_forward(x, idx, w, gate_up, down, implementation="triton", validate=False)

        def forward_backward(x, idx, w, gate_up, down, g):
            out, vjp = jax.vjp(lambda x, w, gate_up, down: forward(x, idx, w, gate_up, down), x, w, gate_up, down)
            return out, vjp(g)

        return forward if mode == "fwd" else forward_backward

    def other_set(arrays, shift, E):
        x, idx, w, gate_up, down, dout = arrays
        return [jnp.roll(x, shift, axis=0) * 0.5, (idx + shift) % E, jnp.flip(w, axis=1), gate_up, down, -dout]

    def run(shape, T, mode):
        base = _jax_point(shape, T)
        sets = [base] + [other_set(base, shift, SHAPES[shape][2]) for shift in (1, 2)]
        count = 5 if mode == "fwd" else 6
        executables = {}
        for name, launcher in (("direct", jax_backend.XLA_LAUNCHER), ("graphed", jax_backend.GRAPHED_LAUNCHER)):
            with jax_backend.use_launcher(launcher):
                lowered = jax.jit(program(mode)).lower(*sets[0][:count])
            targets = {t: lowered.as_text().count(f"@{t}(") for t in ("moe_triton_launch", "moe_triton_launch_graphed")}
            if (targets["moe_triton_launch_graphed"] > 0) != (name == "graphed"):
                raise AssertionError(f"the {name} program's custom calls: {targets}")
            executables[name] = lowered.compile()

        def outputs(executable, arrays):
            return [_host_bits(a) for a in jax.tree.leaves(executable(*arrays[:count]))]

        expected = [outputs(executables["direct"], arrays) for arrays in sets]
        before = triton_call.captured_launches()  # the graphed target's alone
        calls, mismatches = 0, []
        for round_ in range(rounds):
            for i, arrays in enumerate(sets):
                for fresh in (False, True):
                    given = [jnp.array(a, copy=True) for a in arrays] if fresh else arrays
                    got = outputs(executables["graphed"], given)
                    calls += 1
                    same = [bool(np.array_equal(a, b)) for a, b in zip(got, expected[i])]
                    if not all(same):
                        mismatches.append({"round": round_, "set": i, "fresh": fresh, "same": same})
        captured = triton_call.captured_launches() - before
        if mismatches or any(np.array_equal(expected[0][0], e[0]) for e in expected[1:]):
            raise AssertionError(f"graphed calls differ from direct ones (or the sets do not differ): {mismatches}")
        if not captured:
            raise AssertionError("no graphed launch was captured into a CUDA graph (XLA_FLAGS: "
                                 f"{os.environ.get('XLA_FLAGS', '')!r})")
        return {"calls": calls, "outputs_per_call": len(expected[0]), "all_bit_identical": True,
                "launches_captured": captured, "xla_flags": os.environ.get("XLA_FLAGS", "")}

    for (shape, T), mode in itertools.product(points, modes):
        record(results, "graphed", f"{shape} T={T} {mode}", lambda shape=shape, T=T, mode=mode: run(shape, T, mode))


# --- JAX training at large token counts -------------------------------------------------------------------------

def large_jax_training(results, tokens=(16384, 65536)):
    """JAX triton forward+backward (every gradient) on qwen3-30b-a3b at large T, jitted: no out-of-memory, the
    time per call and the device's peak memory."""
    import jax
    import jax.numpy as jnp
    import moe_jax
    H, I, E, k = SHAPES["qwen3-30b-a3b"]
    key = jax.random.PRNGKey(0)
    kw, kd = jax.random.split(key)
    gate_up = (jax.random.normal(kw, (E, 2 * I, H), jnp.float32) * H**-0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(kd, (E, H, I), jnp.float32) * I**-0.5).astype(jnp.bfloat16)

    def loss(x, w, gate_up, down, idx, g):
        out = moe_jax.experts_forward(x, idx, w, gate_up, down, implementation="triton")
        return jnp.sum(out.astype(jnp.float32) * g)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    for T in tokens:
        def run(T=T):
            kx, kl, kg = jax.random.split(jax.random.fold_in(key, T), 3)
            x = jax.random.normal(kx, (T, H), jnp.bfloat16)
            w, idx = jax.lax.top_k(jax.nn.softmax(jax.random.normal(kl, (T, E))), k)
            g = jax.random.normal(kg, (T, H), jnp.float32)
            args = (x, w.astype(jnp.bfloat16), gate_up, down, idx.astype(jnp.int32), g)
            jax.block_until_ready(step(*args))
            start = time.perf_counter()
            for _ in range(3):
                out = step(*args)
            jax.block_until_ready(out)
            stats = jax.devices()[0].memory_stats() or {}
            return {"ms": round((time.perf_counter() - start) / 3 * 1e3, 3),
                    "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
                    "finite": bool(all(jnp.isfinite(v).all() for v in jax.tree_util.tree_leaves(out)))}

        record(results, "jax-large-training", f"qwen3-30b-a3b T={T} fwd+bwd", run)


# --- short tiles for the experts' last blocks -------------------------------------------------------------------

def _last_tile_height(count, BM, short_tails):
    rows, height = count % BM or BM, BM
    while short_tails and height // 2 >= rows:
        height, short_tails = height // 2, short_tails - 1
    return height


def tail_checks(results):
    """SHORT_TAILS on the GPU, where the 16- and 32-row tiles multiply with mma.sync and the 64- and 128-row ones
    with wgmma: a case whose experts end in blocks of every height, forward (training and inference) and every
    gradient with BM 128 and SHORT_TAILS 3, against the float64 reference within the tolerance table, torch and
    JAX bit-identical, and whether the bits equal those of full 128-row tiles."""
    import ml_dtypes
    from moe_shared import reference
    rng = np.random.default_rng(31)
    T, H, I, E, k = 700, 256, 128, 8, 2
    arrays, grad_output = random_case(31, T=T, H=H, I=I, E=E, k=k, bias=True)
    p = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.04, 0.01])
    arrays["top_k_index"] = np.stack([rng.choice(E, size=k, replace=False, p=p) for _ in range(T)]).astype(np.int32)
    rounded = {n: a if n == "top_k_index" else a.astype(ml_dtypes.bfloat16).astype(np.float64)
               for n, a in arrays.items()}
    grad_output = grad_output.astype(ml_dtypes.bfloat16).astype(np.float64)
    named = {n: rounded[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")}
    biases = {"gate_up_bias": rounded["gate_up_bias"], "down_bias": rounded["down_bias"]}
    expected = {"out": reference.experts_forward(**named, **biases)}
    expected |= {f"grad_{n}": g for n, g in
                 reference.experts_backward(**named, grad_output=grad_output, **biases).items()}
    case = type("Case", (), {"inputs": rounded, "grad_output": grad_output, "dtype": "bfloat16",
                             "activation": "silu", "expected": expected})
    counts = np.bincount(arrays["top_k_index"].ravel(), minlength=E)
    heights = sorted({_last_tile_height(int(c), 128, 3) for c in counts if c})
    shapes = (("gate_up", I, H), ("down", H, I), ("dgrad_down", I, H), ("dgrad_up", H, 2 * I))

    def configure(tails):
        plans.OVERRIDES.clear()
        for kernel, N, K in shapes:
            plans.OVERRIDES[kernel, N, K, E] = C(128, 64, 64, 8, 3, 8, SHORT_TAILS=tails)
        plans.clear_caches()

    def run():
        configure(0)
        full = torch_vector(case)
        configure(3)
        detail = check_vector(case)
        short = torch_vector(case)
        detail["same_bits_as_full_tiles"] = {n: bool(np.array_equal(short[n], full[n])) for n in full}
        detail["last_block_heights"] = heights
        detail["counts"] = counts.tolist()
        return detail

    try:
        record(results, "short-tails", "BM 128, SHORT_TAILS 3 vs the reference, torch vs JAX, vs full tiles", run)
    finally:
        plans.OVERRIDES.clear()
        plans.clear_caches()


# --- weight tiles through tensor descriptors ------------------------------------------------------------------

def _both_ways(run):
    """A vector runner's training result and its inference output (as "inference")."""
    return lambda case: run(case) | {"inference": run(case, training=False)["out"]}


def descriptor_checks(results):
    """The grouped GEMMs with TMA loads of the weight and row tiles (forward, backward and inference) and the weight
    gradients with TMA row loads, against the pointer loads on the same inputs: the same bits in torch; and in JAX,
    through its default launcher (jaxlib's, with the kernels' global scratch), the bits of torch and of pointer
    loads."""
    import jax
    import torch
    from moe_jax.backends import triton as jax_backend
    from moe_torch.backends import triton as torch_backend
    arrays, grad_output = random_case(21, T=300, H=256, I=128, E=8, k=2, bias=True, empty_fraction=0.1)
    shapes = (("gate_up", 128, 256), ("down", 256, 128), ("dgrad_down", 128, 256), ("dgrad_up", 256, 256),
              ("wgrad", 256, 128), ("wgrad", 256, 256))

    def configure(tma):
        plans.OVERRIDES.clear()
        for kernel, N, K in shapes:
            plans.OVERRIDES[kernel, N, K, 8] = C(64, 64, 64, 4, 3, 1, tma, A_TMA=tma)
        plans.clear_caches()

    case = type("Case", (), {"inputs": arrays, "grad_output": grad_output, "dtype": "bfloat16",
                             "activation": "silu"})
    torch_run, jax_run = _both_ways(torch_vector), _both_ways(jax_vector)

    def torch_bits():
        configure(False)
        plain = torch_run(case)
        configure(True)
        described = torch_run(case)
        x, ids, gate_up, down = (torch.empty(s, device="cuda", dtype=torch.bfloat16)
                                 for s in ((300, 256), (300, 2), (8, 256, 256), (8, 256, 128)))
        problem = torch_backend.problem_of(x, ids, gate_up, down, None, None, "silu")
        steps = (plans.forward_plan(problem, training=True).steps + plans.backward_plan(problem).steps
                 + plans.forward_plan(problem).steps)
        codes = ([(st.constants["B_DESC"], st.constants["A_DESC"]) for st in steps
                  if st.kernel == "grouped_gemm_kernel"]
                 + [st.constants["DESC"] for st in steps if st.kernel == "grouped_wgrad_kernel"])
        same = all(np.array_equal(plain[n], described[n]) for n in plain)
        if not same or not all(all(c) if isinstance(c, tuple) else c for c in codes):
            raise AssertionError({"same": same, "codes": codes})
        return {"identical_to_pointer_loads": same, "codes": codes}

    def jax_bits():
        configure(True)
        described = jax_run(case)  # the default launcher gives the kernels their global scratch
        with jax_backend.use_launcher(replace(jax_backend.XLA_LAUNCHER, tensor_descriptors=False)):
            plain = jax_run(case)
        want = torch_run(case)
        same = {n: bool(np.array_equal(want[n], described[n])) for n in want}
        same_as_pointers = all(np.array_equal(plain[n], described[n]) for n in plain)
        if not all(same.values()) or not same_as_pointers:
            raise AssertionError({"identical_to_torch": same, "identical_to_pointer_loads": same_as_pointers})
        return {"identical_to_torch": True, "identical_to_pointer_loads": True, "jaxlib": jax.__version__}

    try:
        record(results, "descriptors", "torch: TMA weight and row loads vs pointer loads", torch_bits)
        record(results, "descriptors", "jax: TMA weight and row loads (XLA_LAUNCHER, global scratch) vs torch",
               jax_bits)
    finally:
        plans.OVERRIDES.clear()
        plans.clear_caches()


def direct_launch_checks(results):
    """Eager torch calls launch each step's cached kernel through triton's C launcher (``_direct_launch``): the
    same bits as through triton's launch wrapper (the C launcher switched off), for inference (decode and sorted
    paths) and training (output and every gradient), and the C launcher taken for every kernel, those building
    tensor descriptors on the device too (their global scratch comes from torch's allocator). CUDA graphs are off
    for these calls (a replay launches nothing from Python)."""
    import os
    import torch
    import moe_torch
    from moe_torch.backends import triton as backend

    def run(shape, T, training):
        (gate_up, down), (x, idx, w, dout) = _point(shape, T)
        leaves = [t.detach().requires_grad_(training) for t in (x, w, gate_up, down)]
        out = moe_torch.experts_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3], implementation="triton")
        if not training:
            return [out.float().cpu()]
        out.backward(dout)
        return [out.float().cpu()] + [t.grad.float().cpu() for t in leaves]

    saved = backend._direct_launch

    def counting(compiled):
        direct = saved(compiled)
        if direct is None:
            launches["wrapper-kernels"] += 1
            return None

        def counted(*args):
            launches["c-launcher"] += 1
            direct(*args)
        return counted

    def check(shape, T, training):
        backend._LAUNCHED.clear()
        backend._direct_launch = counting
        launches["wrapper-kernels"] = 0
        settings = {v: os.environ.get(v) for v in ("MOE_TORCH_GRAPHS", "MOE_TORCH_TRAINING_GRAPHS")}
        os.environ.update(dict.fromkeys(settings, "off"))
        try:
            run(shape, T, training)  # compiles and caches
            launches["c-launcher"] = 0
            direct = run(shape, T, training)
            used, wrapper_kernels = launches["c-launcher"], launches["wrapper-kernels"]
            backend._LAUNCHED.clear()
            backend._direct_launch = lambda compiled: None
            run(shape, T, training)
            wrapped = run(shape, T, training)
        finally:
            backend._direct_launch = saved
            backend._LAUNCHED.clear()
            for variable, value in settings.items():
                if value is None:
                    del os.environ[variable]
                else:
                    os.environ[variable] = value
        same = all(torch.equal(a, b) for a, b in zip(direct, wrapped))
        found = {"identical": same, "c_launcher_launches": used, "kernels_left_to_the_wrapper": wrapper_kernels}
        if not same or not used or wrapper_kernels:
            raise AssertionError(found)
        return found

    launches = {"c-launcher": 0, "wrapper-kernels": 0}

    for shape, T, training in (("qwen3-30b-a3b", 1, False), ("qwen3-30b-a3b", 4096, False),
                               ("mixtral-8x7b", 64, True), ("qwen3-30b-a3b", 256, True)):
        mode = "fwd+bwd" if training else "fwd"
        record(results, "direct-launch", f"{shape} T={T} {mode}: C launcher vs triton's wrapper",
               lambda a=(shape, T, training): check(*a))


def _decode_threshold_part(results, configs_out: Path):
    """The decode thresholds with the current tiles, and the current table with them written to
    ``<configs_out>/<device>.json`` (for ``MOE_EXPERTS_TRITON_CONFIGS`` in the same session, and to commit)."""
    import torch
    timings = []

    def thresholds():
        decode = decode_thresholds(timings)
        name = f"{plans.device_file_name(torch.cuda.get_device_name())}.json"
        table = json.loads((Path(os.environ.get(plans.CONFIG_DIR_VARIABLE, plans.CONFIG_DIR)) / name).read_text())
        table["decode_max_slots"] = decode | {"default": table["decode_max_slots"].get("default", 16)}
        configs_out.mkdir(parents=True, exist_ok=True)
        (configs_out / name).write_text(json.dumps(table, indent=1) + "\n")
        return {"decode_max_slots": decode, "timings": timings}

    record(results, "decode-threshold", "decode kernels against the sorted path, inference forward", thresholds)


def _tune_part(results, args):
    t0 = time.perf_counter()
    results += parallel("tune", args.workers, args.out)
    results[-1]["detail"]["warm_s"] = round(time.perf_counter() - t0, 1)
    tune(results, args.configs_out)


PARTS = {
    "vectors": lambda results, args: results.extend(parallel("vectors", args.workers, args.out)),
    "graphs": lambda results, args: graph_checks(results),
    "descriptors": lambda results, args: descriptor_checks(results),
    "tails": lambda results, args: tail_checks(results),
    "large": lambda results, args: large_jax_training(results),
    "profile": lambda results, args: profile_calls(results),
    "jax-profile": lambda results, args: jax_profile_calls(results),
    "launchers": lambda results, args: launcher_timings(results),
    "framework-kernels": lambda results, args: framework_kernels(
        results, *((_step_points(args.framework_points), tuple(args.framework_modes.split(",")))
                   if args.framework_points else ())),
    "graphed": lambda results, args: graphed_replays(results),
    "own-launcher": lambda results, args: own_launcher(
        results, *((_step_points(args.launcher_points),) if args.launcher_points else ())),
    "host": lambda results, args: host_profile(
        results, *((_step_points(args.framework_points), tuple(args.framework_modes.split(",")))
                   if args.framework_points else ())),
    "launch": lambda results, args: direct_launch_checks(results),
    "decode-threshold": lambda results, args: _decode_threshold_part(results, args.configs_out),
    "steps": lambda results, args: step_timings(
        results, tuple(args.variant_kinds.split(",")),
        args.step_tokens and {int(t) for t in args.step_tokens.split(",")},
        _step_points(args.step_points) if args.step_points else STEP_POINTS,
        args.step_plans and set(args.step_plans.split(",")), variants_at_every_point=bool(args.step_points)),
    "tune": _tune_part,
}
"""--parts name -> what it runs (results, args), in the order they run."""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--parts", default="vectors,graphs")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--configs-out", type=Path, default=Path("/tmp/moe-configs"))
    p.add_argument("--variant-kinds", default="gemm,wgrad", help="steps part: which GEMM kinds get variants")
    p.add_argument("--step-tokens", help="steps part: only the points of these token counts (comma-separated)")
    p.add_argument("--step-points", help="steps part: shape:T pairs instead of STEP_POINTS (comma-separated), "
                                         "their GEMM steps under variants at any T")
    p.add_argument("--step-plans", help="steps part: only these plans (fwd, bwd, decode; comma-separated)")
    p.add_argument("--framework-points", help="framework-kernels and host parts: shape:T pairs instead of their "
                                              "default points")
    p.add_argument("--framework-modes", default="fwd", help="with --framework-points: fwd, fwd+bwd (comma-separated)")
    p.add_argument("--launcher-points", help="own-launcher part: shape:T pairs instead of OWN_LAUNCH_POINTS")
    p.add_argument("--merge-steps", nargs="+", type=Path, metavar="RESULTS",
                   help="no GPU: write the fastest step variants of these --parts steps results into --table")
    p.add_argument("--table", type=Path, default=Path(plans.CONFIG_DIR) / "nvidia-h200.json")
    p.add_argument("--worker")
    p.add_argument("--index", type=int)
    p.add_argument("--count", type=int)
    p.add_argument("--worker-out")
    args = p.parse_args()
    if args.merge_steps:
        for w in merge_step_variants(args.merge_steps, args.table):
            print(w["kernel"], w["N"], w["K"], w["E"], w["slots"], w["config"], w["ms"])
        return
    if args.worker:
        {"vectors": vectors_worker, "tune": tune_worker}[args.worker](args.index, args.count, args.worker_out)
        return
    parts = args.parts.split(",")
    for part in parts:
        if part not in PARTS:
            raise SystemExit(f"--parts: expected names from {sorted(PARTS)}, got {part!r}")
    import torch
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    meta = {"torch": torch.__version__, "triton": __import__("triton").__version__,
            "jax": __import__("jax").__version__, "device": torch.cuda.get_device_name()}
    started = time.perf_counter()
    # a run stopped by SIGTERM (a `timeout` around it) still writes what it measured
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"stopped by SIGTERM after {len(results)} results"))
    try:
        for part, run in PARTS.items():  # in this order, whatever the order asked
            if part in parts:
                run(results, args)
    finally:
        meta["seconds"] = round(time.perf_counter() - started, 1)
        summary = {}
        for r in results:
            s = summary.setdefault(r["kind"], {"passed": 0, "failed": 0})
            s["passed" if r["ok"] else "failed"] += 1
        (args.out / f"triton-{'-'.join(parts)}.json").write_text(
            json.dumps({"meta": meta, "summary": summary, "results": results}, indent=1, default=str))
    print(json.dumps(meta))
    for kind, s in summary.items():
        print(f"{kind:20s} passed {s['passed']:4d} failed {s['failed']:4d}")
    for r in results:
        if not r["ok"]:
            print("FAIL", r["kind"], r["name"], r["detail"][:400])
        elif r["kind"] == "profile":
            d = r["detail"]
            print(r["name"], "call", d["call_ms_median"], "stream", d["stream_ms"], "host", d["host_ms_median"],
                  "kernels", d["kernels_ms"])
            for name, v in list(d["kernels"].items())[:8]:
                print("   ", v["ms_per_call"], v["launches_per_call"], name[:90])
        elif r["kind"] in ("cuda-graph", "jax-grouped-mm", "kernels-ran", "tune-warm", "jax-large-training",
                           "descriptors", "direct-launch", "graphed"):
            print("OK", r["kind"], r["name"], str(r["detail"])[:300])
        elif r["kind"] == "decode-threshold":
            print(r["detail"]["decode_max_slots"])
            for t in r["detail"]["timings"]:
                print("   ", t)
        elif r["kind"] == "host-profile":
            print(r["name"], "host ms", r["detail"]["host_ms_per_call"])
            for row in r["detail"]["top_own_time_us_per_call"][:18]:
                print("   ", row["own_us"], row["cum_us"], row["calls"], row["fn"])
        elif r["kind"] == "framework-kernels" and "torch" in r["detail"]:
            d = r["detail"]
            print(r["name"], "bits", d["bit_identical"])
            for side in ("torch", "jax"):
                v = d[side]
                print("   ", side, "call", v["call_ms_median"], "stream", v["stream_ms"], "host", v["host_ms_median"],
                      "kernels", v["kernels_ms"])
                for name, k in list(v["kernels"].items())[:12]:
                    print("       ", k["ms_per_call"], k["launches_per_call"], name[:80])
        elif r["kind"] == "own-launcher" and "moe" in r["detail"]:
            d = r["detail"]
            print(r["name"], {name: (d[name]["executable"]["call_ms_median"], d[name]["executable"]["stream_ms"])
                              for name in d if name in ("moe", "graphed", "jaxlib", "torch")})
        elif r["kind"] in ("jax-profile", "launchers", "framework-kernels"):
            print(r["kind"], r["name"], r["detail"])
        elif r["kind"] == "short-tails":
            print("OK", r["kind"], r["name"], {n: v for n, v in r["detail"].items() if "inference" not in n})
        elif r["kind"] in ("steps", "step-variants"):
            print(r["name"])
            for t in r["detail"]:
                print("   ", t.get("step"), t.get("ms"), t.get("tflops"), t.get("config"), t.get("error", ""))


if __name__ == "__main__":
    main()
