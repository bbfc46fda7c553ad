"""Training graphs on the GPU (moe_torch.graphs, MOE_TORCH_TRAINING_GRAPHS; not collected by pytest):

    PYTHONPATH=. python tests/device_training_graphs.py --out DIR

- every shared vector through batched_mm and grouped_mm, forward and gradients, with the setting ``auto`` (training
  graphs where the call is within the bound) and ``off`` (the one-node step, or the composed path with biases or a
  gate callable): within the tolerance table against the float64 reference, and the same bits both ways;
qwen3-30b-a3b shape, bf16, each backend's training step (every input takes gradients), T = 1, 4, 8, 16:
- bits: three steps on different inputs (a quarter of the slots -1 in the last) with ``auto`` give the output and
  every gradient of the plain step (``off``) bit for bit; two graphs per T (forward and backward) within the spec's
  ``training_graphs`` bound, none past it (T=16); two forwards
  before their backwards keep their own values; a step differentiated for the hidden states alone too;
- time: the step with and without the graphs and transformers' same-named backend (device_decode_profile's timer:
  CUDA events around one step, host time up to its result, host time until it returned).
Writes DIR/training-graphs.json; prints each check and a table.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

import device_decode_profile  # the script beside this one (sys.path[0])
import moe_torch
from bench.peers import transformers_peer
from moe_shared import load_spec, relative_l2
from moe_shared.vectors import load_cases
from support import DIFF_ARGS

E, H, I, K = device_decode_profile.E, device_decode_profile.H, device_decode_profile.I, device_decode_profile.K
NAMES = ("hidden_states", "top_k_weights", "gate_up_proj", "down_proj")


def setting(value: str):
    class Setting:
        def __enter__(self):
            os.environ[moe_torch.graphs.TRAINING_VARIABLE] = value

        def __exit__(self, *exc):
            os.environ.pop(moe_torch.graphs.TRAINING_VARIABLE, None)
    return Setting()


BACKENDS = ("batched_mm", "grouped_mm")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def vector_checks(device, check) -> None:
    """Every shared vector through each backend with the setting auto and off: within the tolerance table, the same
    bits."""
    spec = load_spec()
    for backend in BACKENDS:
        for case in load_cases():
            results = {}
            for value in ("auto", "off"):
                with setting(value):
                    tensors = {n: torch.from_numpy(np.ascontiguousarray(a)).to(device)
                               for n, a in case.inputs.items()}
                    tensors = {n: t if n == "top_k_index" else
                               t.to(DTYPES[case.dtype]).requires_grad_(n in DIFF_ARGS) for n, t in tensors.items()}
                    out = moe_torch.experts_forward(**tensors, implementation=backend, activation=case.activation)
                    dy = torch.from_numpy(case.grad_output.astype(np.float32)).to(device).to(DTYPES[case.dtype])
                    leaves = [n for n in tensors if n in DIFF_ARGS]
                    grads = torch.autograd.grad(out, [tensors[n] for n in leaves], dy, allow_unused=True)
                    results[value] = {"out": out.detach(), **{f"grad_{n}": torch.zeros_like(tensors[n]) if g is None
                                                              else g for n, g in zip(leaves, grads)}}
            errors = {name: relative_l2(t.float().cpu().numpy(), case.expected[name])
                      for name, t in results["auto"].items()}
            same = all(torch.equal(t, results["off"][name]) for name, t in results["auto"].items())
            worst = max(errors.values())
            check(f"{backend}/{case.name}: within the tolerance, auto and off the same bits",
                  same and worst <= spec.tolerance_for(case.dtype), worst_rel_l2=worst, same_bits=same)


def main() -> None:
    folder = device_decode_profile.out_folder()
    device = torch.device("cuda")
    checks, timings = [], {}

    check = device_decode_profile.recorder(checks)

    vector_checks(device, check)
    for backend in BACKENDS:
        backend_steps(backend, device, check, timings)
        write(folder, checks, timings)
    print(json.dumps(write(folder, checks, timings)["summary"]))


def write(folder, checks, timings) -> dict:
    return device_decode_profile.write_checks(
        folder / "training-graphs.json", "device_training_graphs.py",
        "ms; triples: [CUDA events around one step, host up to its result, host until the step returned]",
        checks, "timings_ms", timings)


def backend_steps(backend, device, check, timings) -> None:
    gate_up, down = (w.requires_grad_() for w in device_decode_profile.qwen3_weights(device))
    theirs = transformers_peer(backend)(E, H, I)
    g = torch.Generator(device=device).manual_seed(0)

    def inputs(T, empties=False, requires=NAMES):
        x = torch.randn(T, H, device=device, generator=g).bfloat16()
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=device, generator=g), -1), K, -1)
        if empties:
            idx = idx.masked_fill(torch.rand(T, K, device=device, generator=g) < 0.25, -1)
        tensors = {"hidden_states": x, "top_k_index": idx, "top_k_weights": w.bfloat16(), "gate_up_proj": gate_up,
                   "down_proj": down}
        return {n: t.detach().requires_grad_(n in requires) if n != "top_k_index" else t for n, t in tensors.items()}

    def step(tensors, dy):
        out = moe_torch.experts_forward(**tensors, implementation=backend)
        leaves = [tensors[n] for n in NAMES if tensors[n].requires_grad]
        return out, torch.autograd.grad(out, leaves, dy)

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    bound_mib = load_spec().backends[backend].frameworks["torch"].training_graphs["cuda"]
    expert_mib = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size() / 2**20
    for T in (1, 4, 8, 16):
        graphed = T * K * expert_mib <= bound_mib  # past the bound: the plain step, no graph
        moe_torch.graphs.release()
        runs = [(inputs(T, empties=n == 2), torch.randn(T, H, device=device, generator=g).bfloat16())
                for n in range(3)]
        ok = True
        for tensors, dy in runs:
            with setting("auto"):
                out, grads = step(tensors, dy)
            with setting("off"):
                want_out, want_grads = step(tensors, dy)
            ok = ok and torch.equal(out, want_out) and same(grads, want_grads)
        check(f"{backend} T={T}: three graphed steps give the plain step's bits (output, four gradients; -1 slots "
              f"in the last; {'two graphs' if graphed else 'no graph: past the training bound'})",
              ok and moe_torch.graphs.count() == (2 if graphed else 0), graphs=moe_torch.graphs.count())
        (first, dy1), (second, dy2) = runs[0], runs[1]
        with setting("auto"):
            out1 = moe_torch.experts_forward(**first, implementation=backend)
            out2 = moe_torch.experts_forward(**second, implementation=backend)
            grads2 = torch.autograd.grad(out2, [second[n] for n in NAMES], dy2)
            grads1 = torch.autograd.grad(out1, [first[n] for n in NAMES], dy1)
        with setting("off"):
            want1, want2 = step(first, dy1), step(second, dy2)
        check(f"{backend} T={T}: two forwards before their backwards keep their own values",
              torch.equal(out1, want1[0]) and torch.equal(out2, want2[0]) and same(grads1, want1[1])
              and same(grads2, want2[1]))
        only_x = inputs(T, requires=("hidden_states",))
        with setting("auto"):
            got = step(only_x, dy1)
        with setting("off"):
            want = step(only_x, dy1)
        check(f"{backend} T={T}: a step for the hidden states' gradient alone",
              torch.equal(got[0], want[0]) and same(got[1], want[1]))
        tensors, dy = runs[0]
        row = {}
        for name, value in (("graphs", "auto"), ("plain", "off")):
            with setting(value):
                row[name] = device_decode_profile.timed(lambda: step(tensors, dy), rounds=3, calls=10)
        leaves = [tensors[n] for n in NAMES]

        def their_step():
            out = theirs(*(tensors[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj",
                                             "down_proj")))
            torch.autograd.grad(out, leaves, dy)
        row[f"transformers {backend}"] = device_decode_profile.timed(their_step, rounds=3, calls=10)
        timings[f"{backend} T={T}"] = row
        print(f"{backend} T={T}: " + ", ".join(f"{k} " + "/".join(f"{v:.3f}" for v in vals)
                                                for k, vals in row.items()), flush=True)


if __name__ == "__main__":
    main()
