"""Decode kernels' device time, CUDA-graph replays (run on the lent GPU; not collected by pytest):

    python tests/device_decode_study.py --out DIR [--points qwen3-30b-a3b:1,qwen3-30b-a3b:4]

The benchmark's decode calls are host-bound (host ~42 us per torch call at qwen3-30b-a3b T=1 on the H100) and
``--parts steps`` times each kernel after an L2 flush that leaves the L2 full of dirty lines, so neither gives the
kernels' own time. Here each variant's calls over 16 input sets (random routing: other experts each call) are
captured in one CUDA graph and replayed: ms per call is device time, launch gaps included. Variants:

- ``plan``: the current decode plan (``decode_gate_up_kernel`` then ``decode_down_combine_kernel``);
- ``pdl``: the same gate/up kernel, and a down kernel launched as its programmatic dependent that loads its weight
  tiles before waiting for the activations (one tile per program: k rounded up to a power of two experts, all of I);
- ``split``: one kernel per (slot, block of I) computing that block's activations and its partial down projection
  (every weight byte read in one launch), then a per-token kernel summing the partials in a fixed order and
  combining: several tile configs;
- ``read``: a kernel that only reads the hit experts' weights once (the bytes' floor on this device, measured).

Parity: each variant's output against the plan's (relative L2; the same math, other summation orders).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from moe_shared.kernels import moe
from moe_shared.kernels import plan as plans

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2),
          "deepseek-v3": (7168, 2048, 256, 8)}
POINTS = "qwen3-30b-a3b:1,qwen3-30b-a3b:2,qwen3-30b-a3b:4,qwen3-30b-a3b:8,mixtral-8x7b:1,deepseek-v3:1"
SPLIT_CONFIGS = [  # BI, BK (phase 1), BN (phase 2), num_warps
    (16, 512, 64, 4), (32, 256, 64, 4), (32, 512, 32, 4), (32, 512, 64, 8), (64, 256, 64, 8), (16, 1024, 128, 4),
    (64, 128, 128, 8), (8, 1024, 256, 4)]
PDL = os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if PDL else "cpu"


@triton.jit
def gate_up_pdl_kernel(x_ptr, ids_ptr, w_ptr, S, act_ptr, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                       TOP_K: tl.constexpr, stride_we: tl.constexpr, stride_wn: tl.constexpr,
                       stride_wk: tl.constexpr, ACTIVATION: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    num_n: tl.constexpr = (I + BN - 1) // BN
    s = pid // num_n
    expert = tl.load(ids_ptr + s)
    if (expert < 0) | (expert >= E):
        return
    offs_n = (pid % num_n) * BN + tl.arange(0, BN)
    n_live = offs_n < I
    x_row = x_ptr + (s // TOP_K).to(tl.int64) * H
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
    gate, up = moe._gate_up_dots(x_row, w_rows, n_live, w_ptr.dtype.element_ty, H, I, stride_wn, stride_wk, BN, BK)
    out = moe._activate(gate, ACTIVATION) * up
    tl.store(act_ptr + s.to(tl.int64) * I + offs_n, out.to(act_ptr.dtype.element_ty), mask=n_live)


@triton.jit
def down_pdl_kernel(act_ptr, ids_ptr, w_ptr, down_ptr, out_ptr, E: tl.constexpr, H: tl.constexpr,
                    I: tl.constexpr, TOP_K: tl.constexpr, stride_de: tl.constexpr, stride_dn: tl.constexpr,
                    stride_dk: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """The plan's down + combine with every expert's [BN, I] tile in one block (BK >= I), loaded before the wait."""
    pid = tl.program_id(0)
    num_n: tl.constexpr = (H + BN - 1) // BN
    t = pid // num_n
    offs_n = (pid % num_n) * BN + tl.arange(0, BN)
    n_live = offs_n < H
    offs_k = tl.arange(0, BK)
    k_live = offs_k < I
    offs_j = tl.arange(0, KP)
    slots = t.to(tl.int64) * TOP_K + offs_j
    experts = tl.load(ids_ptr + slots, mask=offs_j < TOP_K, other=-1)
    routed = moe._routed(experts, E)
    rows = tl.where(routed, experts, 0).to(tl.int64)
    d = tl.load(down_ptr + rows[:, None, None] * stride_de + offs_n[None, :, None] * stride_dn
                + offs_k[None, None, :] * stride_dk,
                mask=routed[:, None, None] & n_live[None, :, None] & k_live[None, None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    a = tl.load(act_ptr + slots[:, None] * I + offs_k[None, :], mask=routed[:, None] & k_live[None, :],
                other=0.0).to(tl.float32)
    y = tl.sum(d.to(tl.float32) * a[:, None, :], 2).to(down_ptr.dtype.element_ty).to(tl.float32)
    total = tl.sum(tl.load(w_ptr + slots, mask=routed, other=0.0).to(tl.float32)[:, None] * y, 0)
    tl.store(out_ptr + t.to(tl.int64) * H + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_live)


@triton.jit
def split_partial_kernel(x_ptr, ids_ptr, gate_up_ptr, down_ptr, part_ptr, E: tl.constexpr, H: tl.constexpr,
                         I: tl.constexpr, TOP_K: tl.constexpr, stride_we: tl.constexpr, stride_wn: tl.constexpr,
                         stride_wk: tl.constexpr, stride_de: tl.constexpr, stride_dn: tl.constexpr,
                         stride_dk: tl.constexpr, ACTIVATION: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr,
                         BN: tl.constexpr):
    """part[s, b, :] = down[e][:, block b of I] @ act_s[block b], act_s[block b] = act(g) * u (rounded to the
    weights' dtype, as the plan stores it) from gate/up rows of block b. Empty slots write nothing."""
    pid = tl.program_id(0)
    NB: tl.constexpr = (I + BI - 1) // BI
    s = pid // NB
    b = pid % NB
    expert = tl.load(ids_ptr + s)
    if (expert < 0) | (expert >= E):
        return
    offs_i = b * BI + tl.arange(0, BI)
    i_live = offs_i < I
    x_row = x_ptr + (s // TOP_K).to(tl.int64) * H
    w_rows = gate_up_ptr + expert.to(tl.int64) * stride_we + offs_i[:, None] * stride_wn
    gate, up = moe._gate_up_dots(x_row, w_rows, i_live, gate_up_ptr.dtype.element_ty, H, I, stride_wn, stride_wk,
                                 BI, BK)
    act = (moe._activate(gate, ACTIVATION) * up).to(down_ptr.dtype.element_ty).to(tl.float32)
    act = tl.where(i_live, act, 0.0)
    d_cols = down_ptr + expert.to(tl.int64) * stride_de + offs_i[None, :] * stride_dk
    part_row = part_ptr + (s.to(tl.int64) * NB + b) * H
    for n0 in range(0, H, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_live = offs_n < H
        d = tl.load(d_cols + offs_n[:, None] * stride_dn, mask=n_live[:, None] & i_live[None, :], other=0.0)
        tl.store(part_row + offs_n, tl.sum(d.to(tl.float32) * act[None, :], 1), mask=n_live)


@triton.jit
def split_combine_kernel(part_ptr, ids_ptr, w_ptr, out_ptr, E: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr,
                         NB: tl.constexpr, BN: tl.constexpr, Y_DTYPE: tl.constexpr):
    pid = tl.program_id(0)
    num_n: tl.constexpr = (H + BN - 1) // BN
    t = pid // num_n
    offs_n = (pid % num_n) * BN + tl.arange(0, BN)
    n_live = offs_n < H
    total = tl.zeros([BN], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        s = t.to(tl.int64) * TOP_K + j
        expert = tl.load(ids_ptr + s)
        if (expert >= 0) & (expert < E):
            acc = tl.zeros([BN], dtype=tl.float32)
            for b in range(NB):
                acc += tl.load(part_ptr + (s * NB + b) * H + offs_n, mask=n_live, other=0.0)
            total += tl.load(w_ptr + s).to(tl.float32) * acc.to(Y_DTYPE).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * H + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_live)


@triton.jit
def read_kernel(ids_ptr, gate_up_ptr, down_ptr, sink_ptr, E: tl.constexpr, GU: tl.constexpr, DN: tl.constexpr,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Reads each routed slot's expert weights once (gate_up[e] then down[e], both contiguous), CHUNK elements a
    program; writes one float per program so nothing is left out."""
    pid = tl.program_id(0)
    NG: tl.constexpr = (GU + CHUNK - 1) // CHUNK
    ND: tl.constexpr = (DN + CHUNK - 1) // CHUNK
    s = pid // (NG + ND)
    c = pid % (NG + ND)
    expert = tl.load(ids_ptr + s)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if (expert >= 0) & (expert < E):
        if c < NG:
            base = gate_up_ptr + expert.to(tl.int64) * GU
            size = GU
            start = c * CHUNK
        else:
            base = down_ptr + expert.to(tl.int64) * DN
            size = DN
            start = (c - NG) * CHUNK
        for o in range(0, CHUNK, BLOCK):
            offs = start + o + tl.arange(0, BLOCK)
            acc += tl.load(base + offs, mask=offs < size, other=0.0).to(tl.float32)
    tl.store(sink_ptr + pid, tl.sum(acc, 0))


def _pow2(n):
    return 1 << (n - 1).bit_length()


def make_sets(shape, T, n_sets, seed=0):
    H, I, E, k = SHAPES[shape]
    g = torch.Generator(DEVICE).manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H, device=DEVICE, dtype=torch.bfloat16, generator=g) * H ** -0.5
    down = torch.randn(E, H, I, device=DEVICE, dtype=torch.bfloat16, generator=g) * I ** -0.5
    sets = []
    for _ in range(n_sets):
        x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16, generator=g)
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEVICE, generator=g), -1), k, -1)
        sets.append((x, idx.to(torch.int32).reshape(-1).contiguous(), w.to(torch.bfloat16).reshape(-1).contiguous()))
    return gate_up, down, sets


def plan_call(gate_up, down, x, ids, w):
    from moe_torch.backends import triton as backend
    problem = backend.problem_of(x, ids.view(x.shape[0], -1), gate_up, down, None, None, "silu")
    plan = plans.forward_plan(problem)
    env = {"x": x, "ids": ids, "w": w, "gate_up": gate_up, "down": down}
    return lambda: backend.run_plan(plan, dict(env))["out"], plan


def pdl_call(gate_up, down, x, ids, w, plan, use_pdl):
    T, H = x.shape
    E, I = down.shape[0], down.shape[2]
    k = ids.numel() // T
    up = plan.steps[0]
    act = torch.empty(ids.numel(), I, device=DEVICE, dtype=gate_up.dtype)
    out = torch.empty(T, H, device=DEVICE, dtype=x.dtype)
    BN = 2
    g_e, g_n, g_k = gate_up.stride()
    d_e, d_n, d_k = down.stride()
    extra = {"launch_pdl": True} if use_pdl else {}

    def call():
        gate_up_pdl_kernel[(up.grid,)](x, ids, gate_up, ids.numel(), act, E=E, H=H, I=I, TOP_K=k, stride_we=g_e,
                                       stride_wn=g_n, stride_wk=g_k, ACTIVATION=0, BN=up.constants["BN"],
                                       BK=up.constants["BK"], USE_PDL=use_pdl, num_warps=up.num_warps,
                                       num_stages=up.num_stages)
        down_pdl_kernel[(T * triton.cdiv(H, BN),)](act, ids, w, down, out, E=E, H=H, I=I, TOP_K=k, stride_de=d_e,
                                                   stride_dn=d_n, stride_dk=d_k, KP=_pow2(k), BN=BN, BK=_pow2(I),
                                                   USE_PDL=use_pdl, num_warps=4, num_stages=1, **extra)
        return out
    return call


def split_call(gate_up, down, x, ids, w, cfg):
    BI, BK, BN, warps = cfg
    T, H = x.shape
    E, I = down.shape[0], down.shape[2]
    k = ids.numel() // T
    NB = triton.cdiv(I, BI)
    part = torch.empty(ids.numel(), NB, H, device=DEVICE, dtype=torch.float32)
    out = torch.empty(T, H, device=DEVICE, dtype=x.dtype)
    g_e, g_n, g_k = gate_up.stride()
    d_e, d_n, d_k = down.stride()
    CN = 256

    def call():
        split_partial_kernel[(ids.numel() * NB,)](x, ids, gate_up, down, part, E=E, H=H, I=I, TOP_K=k,
                                                  stride_we=g_e, stride_wn=g_n, stride_wk=g_k, stride_de=d_e,
                                                  stride_dn=d_n, stride_dk=d_k, ACTIVATION=0, BI=BI, BK=BK, BN=BN,
                                                  num_warps=warps, num_stages=2)
        split_combine_kernel[(T * triton.cdiv(H, CN),)](part, ids, w, out, E=E, H=H, TOP_K=k, NB=NB, BN=CN,
                                                        Y_DTYPE=tl.bfloat16, num_warps=4)
        return out
    return call


def read_call(gate_up, down, ids):
    E = gate_up.shape[0]
    GU, DN = gate_up[0].numel(), down[0].numel()
    CHUNK, BLOCK = 16384, 2048
    programs = ids.numel() * (triton.cdiv(GU, CHUNK) + triton.cdiv(DN, CHUNK))
    sink = torch.empty(programs, device=DEVICE, dtype=torch.float32)

    def call():
        read_kernel[(programs,)](ids, gate_up, down, sink, E=E, GU=GU, DN=DN, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=8)
        return sink
    return call


def graph_ms(calls, replays=20):
    """Device ms per call: ``calls`` (one per input set) captured in one CUDA graph, replayed."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def study(shape, T, n_sets, results):
    H, I, E, k = SHAPES[shape]
    gate_up, down, sets = make_sets(shape, T, n_sets)
    hit_bytes = sum(int(torch.unique(ids).numel()) for _, ids, _ in sets) / n_sets * 3 * H * I * 2
    plan_calls = [plan_call(gate_up, down, *s) for s in sets]
    plan = plan_calls[0][1]
    if plan.steps[0].kernel != "decode_gate_up_kernel":
        results.append(dict(shape=shape, T=T, skipped="not the decode plan on this device: "
                            + ", ".join(s.kernel for s in plan.steps)))
        print(shape, T, results[-1]["skipped"], flush=True)
        return
    expected = [c() for c, _ in plan_calls]
    rows = []

    def record(name, calls, outputs=None, **extra):
        t0 = time.perf_counter()
        try:
            got = [c() for c in calls]
            err = None if outputs is None else max(rel_l2(g, e) for g, e in zip(got, expected))
            ms = graph_ms(calls)
            row = dict(variant=name, ms=round(ms, 5), GBps=round(hit_bytes / ms / 1e6, 1), rel_l2_vs_plan=err,
                       **extra)
        except Exception as e:  # a variant that does not compile or run is reported, not fatal
            row = dict(variant=name, error=f"{type(e).__name__}: {e}"[:400], **extra)
        row["s"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(shape, T, json.dumps(row), flush=True)

    record("plan", [c for c, _ in plan_calls], outputs=True,
           steps=[(s.kernel, s.grid, {k: v for k, v in s.constants.items() if k in ("BN", "BK", "JB")},
                   s.num_warps, s.num_stages) for s in plan.steps])
    record("read", [read_call(gate_up, down, ids) for _, ids, _ in sets])
    if I <= 1024:
        for use_pdl in (False, True) if PDL else (False,):
            record(f"pdl={use_pdl}", [pdl_call(gate_up, down, *s, plan, use_pdl) for s in sets], outputs=True)
    for cfg in SPLIT_CONFIGS:
        record(f"split{cfg}", [split_call(gate_up, down, *s, cfg) for s in sets], outputs=True)
    results.append(dict(shape=shape, T=T, hit_bytes_per_call=hit_bytes, rows=rows))


def check_on_cpu():
    """Under TRITON_INTERPRET=1: every variant against the plan on a small shape with an empty slot."""
    SHAPES["small"] = (64, 48, 6, 3)
    gate_up, down, sets = make_sets("small", 3, 2)
    sets[0][1][4] = -1
    for x, ids, w in sets:
        expected, plan = plan_call(gate_up, down, x, ids, w)
        expected = expected()
        got = {"pdl": pdl_call(gate_up, down, x, ids, w, plan, False)()}
        got |= {f"split{cfg}": split_call(gate_up, down, x, ids, w, cfg)()
                for cfg in [(16, 32, 16, 4), (32, 64, 32, 4)]}
        for name, out in got.items():
            print(name, rel_l2(out, expected))
            if rel_l2(out, expected) > 1e-2:
                raise SystemExit(f"{name} differs")
    print("cpu check passed")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--points", default=POINTS)
    p.add_argument("--sets", type=int, default=16)
    args = p.parse_args()
    if DEVICE == "cpu":
        return check_on_cpu()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d"))
    for point in args.points.split(","):
        shape, T = point.split(":")
        study(shape, int(T), args.sets, results)
        (args.out / "decode_study.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
        torch.cuda.empty_cache()
    print("\nshape T variant ms GB/s rel_l2")
    for r in results:
        for row in r.get("rows", ()):
            print(r["shape"], r["T"], row["variant"], row.get("ms"), row.get("GBps"), row.get("rel_l2_vs_plan"),
                  row.get("error", ""))


if __name__ == "__main__":
    main()
