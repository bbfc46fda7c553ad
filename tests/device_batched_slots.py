"""batched_mm's per-slot products on CUDA (moe_torch.slot_blas) on the GPU (not collected by pytest):

    PYTHONPATH=. python tests/device_batched_slots.py --out DIR

- correctness: ``slot_blas.products`` against float64 per slot (float32, bfloat16, float16; row- and
  column-contiguous weights; one and four slots per row of x) within the tolerance table, and against the gathered
  way (``table[ids]`` and torch.bmm) on the qwen3-30b-a3b shape; two calls give the same bits, and so do the batch
  entries in expert order;
- time, qwen3-30b-a3b, bf16, T = 1..64: each projection's products alone in a CUDA graph (device time only) with the
  batch entries in slot order and in expert order (its sort included), and gathered; the host time of the products
  and of their pointer arrays alone; batched_mm's whole forward (device_decode_profile's timer: CUDA events around
  one call, host time) with the slot products (expert order where ``slot_blas.ordered``, and slot order
  always) and gathered (no decode graphs), with its decode graph, and transformers' batched_mm; forward+backward
  likewise;
- compiled (mode default): batched_mm through the op moe_torch::slot_products (expert order from the threshold, and
  slot order always) and gathered, and transformers' batched_mm, device time per call in a CUDA graph; the op's
  calls counted; a compiled training step's gradients.
Writes DIR/batched-slots.json; prints each check and a table.
"""

from __future__ import annotations

import json
import os

import torch

import device_decode_profile  # the script beside this one (sys.path[0])
import moe_torch
from bench.peers import transformers_peer
from moe_shared import load_spec, relative_l2
from moe_torch import slot_blas

E, H, I, K = device_decode_profile.E, device_decode_profile.H, device_decode_profile.I, device_decode_profile.K
TOLERANCE = load_spec().tolerance


def graph_ms(call, calls: int = 20) -> float:
    """Device ms per call: ``calls`` calls captured in one CUDA graph, the replay timed by CUDA events (median of
    10), so no host time is in it."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


class SlotOrder:
    """batched_mm's slot products with their batch entries in slot order at every size."""

    def __enter__(self):
        self.ordered_from, slot_blas.ORDERED_FROM_SLOTS_PER_EXPERT = slot_blas.ORDERED_FROM_SLOTS_PER_EXPERT, 1e30

    def __exit__(self, *exc):
        slot_blas.ORDERED_FROM_SLOTS_PER_EXPERT = self.ordered_from


class Gathered:
    """batched_mm with its CUDA slot products off (the gathered way)."""

    def __enter__(self):
        self.devices, slot_blas.DEVICES = slot_blas.DEVICES, ()

    def __exit__(self, *exc):
        slot_blas.DEVICES = self.devices


def graphs(setting):
    class Setting:
        def __enter__(self):
            os.environ[moe_torch.graphs.VARIABLE] = setting

        def __exit__(self, *exc):
            os.environ[moe_torch.graphs.VARIABLE] = "auto"
    return Setting()


def main() -> None:
    folder = device_decode_profile.out_folder()
    device = torch.device("cuda")
    checks, timings = [], {}

    check = device_decode_profile.recorder(checks)

    g = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        for layout in ("rows", "columns"):
            for rows_per_x in (1, 4):
                table = torch.randn(8, 64, 96, device=device, generator=g).to(dtype)
                if layout == "columns":
                    table = torch.randn(8, 96, 64, device=device, generator=g).to(dtype).transpose(1, 2)
                x = torch.randn(40 // rows_per_x, 96, device=device, generator=g).to(dtype)
                ids = torch.randint(0, 8, (40,), device=device, generator=g)
                applies = slot_blas.applies(x, table)
                out = slot_blas.products(x, table, ids, rows_per_x)
                want = torch.stack([table[e].double() @ x[s // rows_per_x].double()
                                    for s, e in enumerate(ids.tolist())])
                err = relative_l2(out.double().cpu().numpy(), want.cpu().numpy())
                again = slot_blas.products(x, table, ids, rows_per_x)
                ordered = slot_blas.products(x, table, ids, rows_per_x, order=torch.sort(ids, stable=True)[1])
                check(f"{name} {layout} rows_per_x={rows_per_x}: float64 within tolerance, same bits again and "
                      f"in expert order", applies and err <= TOLERANCE[name] and torch.equal(out, again)
                      and torch.equal(out, ordered), rel_l2=err)

    def write() -> dict:
        return device_decode_profile.write_checks(
            folder / "batched-slots.json", "device_batched_slots.py",
            "ms; '... device': per call in a CUDA graph of 20; triples: [CUDA events around one call, host up to its "
            "result, host until the call returned]", checks, "timings_ms_device_host", timings)

    gate_up, down = device_decode_profile.qwen3_weights(device)
    theirs = transformers_peer("batched_mm")(E, H, I)
    for T in (1, 2, 4, 8, 16, 64):
        x = torch.randn(T, H, device=device, generator=g).bfloat16()
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device, generator=g), -1), K, -1)
        w = w.bfloat16()
        ids = idx.reshape(-1)
        order = torch.sort(ids, stable=True)[1]
        reference = slot_blas.gathered_products(x, gate_up, ids, K).float().cpu().numpy()
        plain = slot_blas.products(x, gate_up, ids, K)
        err = relative_l2(plain.float().cpu().numpy(), reference)
        check(f"T={T}: gate/up slot products against gathered bmm, the same bits in expert order",
              err <= TOLERANCE["bfloat16"] and torch.equal(plain, slot_blas.products(x, gate_up, ids, K, order=order)),
              rel_l2=err)

        def forward():
            return moe_torch.experts_forward(x, idx, w, gate_up, down, implementation="batched_mm")
        with torch.no_grad(), graphs("off"):
            slots_out = forward()
            with Gathered():
                gathered_out = forward()
        err = relative_l2(slots_out.float().cpu().numpy(), gathered_out.float().cpu().numpy())
        check(f"T={T}: batched_mm forward, slot products against gathered", err <= TOLERANCE["bfloat16"], rel_l2=err)

        row = {}
        a = torch.randn(T * K, I, device=device, generator=g).bfloat16()
        with torch.no_grad():
            for name, table, rows_x, vectors in (("gate_up", gate_up, K, x), ("down", down, 1, a)):
                row[f"{name} slot order device"] = graph_ms(lambda: slot_blas.products(vectors, table, ids, rows_x))
                row[f"{name} expert order device"] = graph_ms(lambda: slot_blas.products(
                    vectors, table, ids, rows_x, order=torch.sort(ids, stable=True)[1]))
                if T <= 64:  # a graph of gathers keeps every call's copy: 20 x 19 GB at T=256
                    row[f"{name} gathered device"] = graph_ms(
                        lambda: slot_blas.gathered_products(vectors, table, ids, rows_x))
            call = device_decode_profile.timed(lambda: slot_blas.products(x, gate_up, ids, K))
            row["gate_up products: launch host, whole host"] = [call[2], call[1]]
            call = device_decode_profile.timed(lambda: slot_blas.products(
                x, gate_up, ids, K, order=torch.sort(ids, stable=True)[1]))
            row["gate_up products in expert order, sort included: launch host, whole host"] = [call[2], call[1]]
            out = torch.empty(T * K, 2 * I, device=device, dtype=torch.bfloat16)
            row["gate_up pointers: launch host"] = device_decode_profile.timed(
                lambda: slot_blas.slot_pointers(x, gate_up, ids, K, out))[2]
            with graphs("off"):
                row["forward slots"] = device_decode_profile.timed(forward)
                with SlotOrder():
                    row["forward slots, slot order"] = device_decode_profile.timed(forward)
                with Gathered():
                    row["forward gathered"] = device_decode_profile.timed(forward)
            row["forward slots, decode graph"] = device_decode_profile.timed(forward)
            with SlotOrder():
                row["forward slots, decode graph, slot order"] = device_decode_profile.timed(forward)
            moe_torch.graphs.release()
            row["transformers batched_mm"] = device_decode_profile.timed(lambda: theirs(x, idx, w, gate_up, down))
        leaves = [t.detach().requires_grad_() for t in (x, w, gate_up, down)]

        def step():
            out = moe_torch.experts_forward(leaves[0], idx, leaves[1], leaves[2], leaves[3],
                                            implementation="batched_mm")
            torch.autograd.grad(out, leaves, torch.ones_like(out))
        row["fwd+bwd slots"] = device_decode_profile.timed(step, rounds=3, calls=10)
        with SlotOrder():
            row["fwd+bwd slots, slot order"] = device_decode_profile.timed(step, rounds=3, calls=10)
        with Gathered():
            row["fwd+bwd gathered"] = device_decode_profile.timed(step, rounds=3, calls=10)
        timings[f"T={T}"] = row
        print(f"T={T}: " + ", ".join(f"{k} " + (f"{v:.3f}" if isinstance(v, float) else
                                                  "/".join(f"{u:.3f}" for u in v)) for k, v in row.items()), flush=True)
        moe_torch.graphs.release()
        write()  # after each T: a run cut short keeps what it measured

    compiled_timings(g, gate_up, down, theirs, check, timings, write)
    print(json.dumps(write()["summary"]))


def compiled_timings(g, gate_up, down, theirs, check, timings, write) -> None:
    """batched_mm under torch.compile (mode default, one graph per T): through the op moe_torch::slot_products, and
    gathered (the slot products off), against transformers' compiled the same way; device time per call in a CUDA
    graph; checks that the op ran (its cuBLAS calls counted) and agrees with the eager forward, and a compiled
    training step's gradients against eager."""
    torch._dynamo.config.cache_size_limit = 64
    ran, products = [], slot_blas._products

    def counted(*args, **kwargs):
        ran.append(1)
        return products(*args, **kwargs)

    slot_blas._products = counted
    device = gate_up.device
    for T in (1, 4, 8, 16, 64):
        x = torch.randn(T, H, device=device, generator=g).bfloat16()
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device, generator=g), -1), K, -1)
        w = w.bfloat16()

        def ours(*args):
            return moe_torch.experts_forward(*args, implementation="batched_mm")

        args, row = (x, idx, w, gate_up, down), {}
        torch._dynamo.reset()
        with torch.no_grad(), graphs("off"):
            eager = ours(*args)
            compiled = torch.compile(ours, dynamic=False, fullgraph=True)
            before = len(ran)
            out = compiled(*args)
            err = relative_l2(out.float().cpu().numpy(), eager.float().cpu().numpy())
            check(f"T={T}: compiled batched_mm runs moe_torch::slot_products (2 calls) and agrees with eager",
                  len(ran) - before == 2 and err <= TOLERANCE["bfloat16"], rel_l2=err, op_calls=len(ran) - before)
            row["compiled slots device"] = graph_ms(lambda: compiled(*args))
            torch._dynamo.reset()
            with SlotOrder():
                slot_ordered = torch.compile(lambda *a: ours(*a), dynamic=False, fullgraph=True)
                slot_ordered_out = slot_ordered(*args)
                check(f"T={T}: compiled batched_mm, the same bits in slot order and expert order",
                      torch.equal(slot_ordered_out, out))
                row["compiled slots, slot order device"] = graph_ms(lambda: slot_ordered(*args))
            with Gathered():
                gathered_compiled = torch.compile(lambda *a: ours(*a), dynamic=False, fullgraph=True)
                row["compiled gathered device"] = graph_ms(lambda: gathered_compiled(*args))
            theirs_compiled = torch.compile(theirs, dynamic=False)
            row["transformers compiled device"] = graph_ms(lambda: theirs_compiled(*args))
        timings[f"compiled T={T}"] = row
        print(f"compiled T={T}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()), flush=True)
        write()
    T = 8
    leaves = [t.detach().requires_grad_() for t in (x[:T], w[:T], gate_up, down)]
    step = torch.compile(lambda *a: moe_torch.experts_forward(*a, implementation="batched_mm"), fullgraph=True)
    out = step(leaves[0], idx[:T], *leaves[1:])
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    eager_leaves = [t.detach().requires_grad_() for t in leaves]
    eager_out = moe_torch.experts_forward(eager_leaves[0], idx[:T], *eager_leaves[1:], implementation="batched_mm")
    want = torch.autograd.grad(eager_out, eager_leaves, torch.ones_like(eager_out))
    errs = [relative_l2(a.float().cpu().numpy(), b.float().cpu().numpy()) for a, b in zip(grads, want)]
    check("compiled batched_mm training step (T=8): every gradient against eager", max(errs) <= TOLERANCE["bfloat16"],
          rel_l2=errs)
    slot_blas._products = products
    write()


if __name__ == "__main__":
    main()
