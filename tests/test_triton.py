"""Backend ``triton``: the shared Triton kernels under the Triton interpreter (CPU), through both bindings.

The kernels and the plans are the ones the GPU runs; the interpreter executes them program by program on the host
(``triton_interpreter`` makes its bfloat16 arithmetic the GPU's). On the GPU the same checks run in
tests/device_triton_check.py.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import triton_interpreter  # noqa: F401  (patches the interpreter's bfloat16 dot and cast)
from moe_jax.backends import triton as jax_triton_backend
from moe_shared import relative_l2
from moe_shared.kernels import moe, plan as plans
from moe_torch.backends import triton as torch_triton_backend
from support import CASES, DIFF_ARGS, SPEC, case_id, random_case
from test_jax import to_jax
from test_torch import to_torch

import moe_jax
import moe_torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
JAX_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def torch_run(arrays, dtype, grad_output=None, activation="silu", training=True):
    """Output and gradients (name -> float64 array) of the torch binding on these inputs."""
    ts = to_torch(arrays, dtype, requires_grad=training)
    out = torch_triton_backend.experts_forward(**ts, activation=activation)
    result = {"out": out.detach().double().numpy()}
    if training:
        out.backward(torch.from_numpy(np.asarray(grad_output, np.float32)).to(TORCH_DTYPES[dtype]))
        result |= {f"grad_{n}": t.grad.double().numpy() for n, t in ts.items() if n in DIFF_ARGS}
    return result


def jax_run(arrays, dtype, grad_output=None, activation="silu", training=True,
            launcher=triton_interpreter.jax_interpreter_launch):
    """The same through the JAX binding, jitted, with its kernels launched under the interpreter."""
    values = to_jax(arrays, dtype)
    names = [n for n in DIFF_ARGS if n in values]

    def f(*diff):
        return jax_triton_backend.experts_forward(**(values | dict(zip(names, diff))), activation=activation)

    with jax_triton_backend.use_launcher(launcher):
        if not training:
            return {"out": np.asarray(jax.jit(f)(*(values[n] for n in names)).astype(jnp.float32), np.float64)}
        out, vjp = jax.vjp(jax.jit(f), *(values[n] for n in names))
        grads = jax.jit(vjp)(jnp.asarray(grad_output).astype(JAX_DTYPES[dtype]))
    result = {"out": np.asarray(out.astype(jnp.float32), np.float64)}
    return result | {f"grad_{n}": np.asarray(g.astype(jnp.float32), np.float64) for n, g in zip(names, grads)}


def assert_matches_reference(result, case):
    tol = SPEC.tolerance_for(case.dtype)
    errors = {n: relative_l2(v, case.expected[n]) for n, v in result.items()}
    assert max(errors.values()) <= tol, f"{case.name}: {errors} > {tol}"


_TORCH_RESULTS = {}  # (case, training) -> torch_run result: the vector test's results, reused by the parity test


def torch_vector(case, training=True):
    key = (case.name, training)
    if key not in _TORCH_RESULTS:
        grad_output = np.asarray(jnp.asarray(case.grad_output).astype(JAX_DTYPES[case.dtype]).astype(jnp.float32))
        _TORCH_RESULTS[key] = torch_run(case.inputs, case.dtype, grad_output if training else None,
                                        case.activation, training=training)
    return _TORCH_RESULTS[key]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torch_binding_on_every_vector(case):
    """Forward and every gradient (the training plan), and the inference forward (decode kernels for a few slots,
    the sorted path otherwise), against the float64 reference."""
    assert_matches_reference(torch_vector(case), case)
    assert_matches_reference(torch_vector(case, training=False), case)


JAX_CASES = [c for c in CASES if c.dtype == "bfloat16" or c.name.endswith(("uniform-T7", "uniform-T0"))]


@pytest.mark.parametrize("case", JAX_CASES, ids=case_id)
def test_jax_binding_bit_identical_to_torch(case):
    """The JAX binding (jit, custom_vjp) launches the same kernels with the same configs: the same bits as torch,
    forward and every gradient, and within the tolerance of the reference."""
    grad_output = np.asarray(jnp.asarray(case.grad_output).astype(JAX_DTYPES[case.dtype]).astype(jnp.float32))
    ours = jax_run(case.inputs, case.dtype, grad_output, case.activation)
    assert_matches_reference(ours, case)
    theirs = torch_vector(case)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    inference = jax_run(case.inputs, case.dtype, activation=case.activation, training=False)
    np.testing.assert_array_equal(inference["out"], torch_vector(case, training=False)["out"])


def _problem(T, k=2, E=4, H=16, I=8, **kw):
    return plans.Problem(T=T, H=H, I=I, E=E, k=k, activation="silu", dtype="bfloat16",
                         gate_up_strides=(2 * I * H, H, 1), down_strides=(H * I, I, 1), **kw)


def test_plans_pick_the_decode_kernels_for_few_slots_at_inference_only():
    names = lambda plan: [s.kernel for s in plan.steps]
    few = _problem(T=4)  # 8 slots
    assert names(plans.forward_plan(few)) == ["decode_gate_up_kernel", "decode_down_combine_kernel"]
    assert names(plans.forward_plan(few, training=True)) == [
        "route_sort_kernel", "gather_rows_kernel", "grouped_gemm_kernel", "grouped_gemm_kernel", "combine_kernel"]
    many = _problem(T=2048)  # 4096 slots: several routing chunks
    assert names(plans.forward_plan(many)) == [
        "route_histogram_kernel", "route_sort_kernel", "grouped_gemm_kernel", "grouped_gemm_kernel", "combine_kernel"]
    assert not any(s.zeroed for s in plans.forward_plan(many).steps)  # deterministic: nothing accumulates


def test_grids_are_static_upper_bounds_of_the_expert_aligned_blocks():
    problem = _problem(T=300, k=4, E=16)
    step = plans.forward_plan(problem).steps[-3]
    BM, BN, N = step.constants["BM"], step.constants["BN"], step.constants["N"]
    # any routing needs at most ceil(S / BM) + min(E, S) blocks of BM rows
    rng = np.random.default_rng(0)
    for counts in (np.full(16, 75), rng.multinomial(1200, np.ones(16) / 16), np.eye(16)[3] * 1200):
        assert np.sum(-(-counts // BM)) * -(-N // BN) <= step.grid


def _routing(ids, monkeypatch, chunk):
    """order, counts, starts from the routing kernels on int ids [T, k]."""
    monkeypatch.setattr(plans, "ROUTE_CHUNK", chunk)
    plans.forward_plan.cache_clear()
    T, k = ids.shape
    problem = _problem(T=T, k=k, E=5)
    route = plans.Plan(tuple(plans._route_steps(problem.S, problem.E)), "order")
    env = torch_triton_backend.run_plan(route, {"ids": torch.from_numpy(ids).reshape(-1)},
                                        dtypes={plans.WEIGHTS: torch.float32})
    plans.forward_plan.cache_clear()
    return env["order"].numpy(), env["counts"].numpy(), env["starts"].numpy()


@pytest.mark.parametrize("chunk", [16, 1024])
def test_routing_is_a_stable_counting_sort_with_empty_slots_left_out(monkeypatch, chunk):
    rng = np.random.default_rng(1)
    ids = rng.integers(-2, 7, size=(40, 3)).astype(np.int64)  # 5 experts; -2, -1, 5, 6 are empty slots
    ids[:, 0] = np.where(rng.random(40) < 0.5, 2, ids[:, 0])  # skewed towards expert 2
    order, counts, starts = _routing(ids, monkeypatch, chunk)
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < 5)
    expected = np.argsort(np.where(valid, flat, 5), kind="stable")[: valid.sum()]
    np.testing.assert_array_equal(order[: valid.sum()], expected)
    np.testing.assert_array_equal(counts, np.bincount(flat[valid], minlength=5))
    np.testing.assert_array_equal(starts, np.concatenate([[0], np.cumsum(counts)]))


def test_unchecked_out_of_range_ids_are_empty_slots():
    arrays, grad_output = random_case(5, T=12, H=16, I=8, E=4, k=3, bias=True)
    arrays["top_k_index"][1, 0], arrays["top_k_index"][7, 2] = 9, -5
    cleaned = {n: a.copy() for n, a in arrays.items()}
    cleaned["top_k_index"][1, 0] = cleaned["top_k_index"][7, 2] = -1
    for training in (True, False):
        got = torch_run(arrays, "float32", grad_output, training=training)
        want = torch_run(cleaned, "float32", grad_output, training=training)
        for name in got:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("k, together", [(3, 0), (5, 0), (5, 1), (5, 2)])
def test_decode_kernels_with_k_off_a_power_of_two_empty_slots_and_biases(k, together, monkeypatch):
    """The decode down kernel loads JB experts' tiles as one [JB, BN, BK] block (JB from the tile config's
    EXPERTS_TOGETHER, 0: all k rounded up to a power of two): padded and empty slots add nothing; H and I off the
    tile sizes; torch and JAX give the same bits."""
    from moe_shared import reference

    monkeypatch.setitem(plans.OVERRIDES, ("decode", 40, 24, 6), plans.TileConfig(
        BM=1, BN=16, BK=16, num_warps=4, num_stages=2, EXPERTS_TOGETHER=together))
    plans.clear_caches()
    arrays, _ = random_case(16 + k, T=3, H=40, I=24, E=6, k=k, bias=True)
    arrays["top_k_index"][0, 1], arrays["top_k_index"][2, k - 1] = -1, 11  # an empty slot, an unchecked id
    down = plans.forward_plan(_problem(T=3, k=k, E=6, H=40, I=24)).steps[-1]
    assert (down.kernel, down.constants["KP"], down.constants["JB"]) == (
        "decode_down_combine_kernel", 8 if k == 5 else 4, together or (8 if k == 5 else 4))
    ours = torch_run(arrays, "float32", training=False)["out"]
    cleaned = dict(arrays, top_k_index=np.where(arrays["top_k_index"] < 6, arrays["top_k_index"], -1))
    want = reference.experts_forward(**cleaned)
    assert relative_l2(ours, want) <= SPEC.tolerance_for("float32")
    for dtype in ("bfloat16", "float32"):
        np.testing.assert_array_equal(jax_run(arrays, dtype, training=False)["out"],
                                      torch_run(arrays, dtype, training=False)["out"])
    plans.clear_caches()


def test_every_run_gives_the_same_bits():
    arrays, grad_output = random_case(6, T=40, H=24, I=16, E=6, k=2, bias=True, empty_fraction=0.1)
    first, second = (torch_run(arrays, "bfloat16", grad_output) for _ in range(2))
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


@pytest.mark.parametrize("group_m", [2, 3])
def test_grouped_row_block_order_gives_the_same_bits(group_m):
    """GROUP_M only reorders the programs: every output tile is computed the same way, forward and backward."""
    arrays, grad_output = random_case(9, T=48, H=32, I=16, E=3, k=2, bias=True, empty_fraction=0.1)
    plain = torch_run(arrays, "bfloat16", grad_output)
    try:
        for kernel, N, K in (("gate_up", 16, 32), ("down", 32, 16), ("dgrad_down", 16, 32), ("dgrad_up", 32, 32)):
            plans.OVERRIDES[kernel, N, K, 3] = plans.TileConfig(BM=16, BN=16, BK=16, GROUP_M=group_m)
        plans.clear_caches()
        grouped = torch_run(arrays, "bfloat16", grad_output)
        ts = to_torch(arrays, "bfloat16")
        problem = torch_triton_backend.problem_of(ts["hidden_states"], ts["top_k_index"], ts["gate_up_proj"],
                                                  ts["down_proj"], ts["gate_up_bias"], ts["down_bias"], "silu")
        steps = plans.forward_plan(problem, training=True).steps + plans.backward_plan(problem).steps
    finally:
        plans.OVERRIDES.clear()
        plans.clear_caches()
    assert [s.constants["GROUP_M"] for s in steps if s.kernel == "grouped_gemm_kernel"] == [group_m] * 4
    for name in plain:
        np.testing.assert_array_equal(grouped[name], plain[name], err_msg=name)


def _skewed_case():
    """T=73 over 5 experts, skewed (one idle, one empty slot), with last blocks of every height class at BM 64."""
    rng = np.random.default_rng(12)
    arrays, grad_output = random_case(12, T=73, H=32, I=16, E=5, k=2, bias=True)
    weights = np.array([0.48, 0.17, 0.07, 0.28, 0.0])
    idx = np.stack([rng.choice(5, size=2, replace=False, p=weights) for _ in range(73)]).astype(np.int32)
    idx[3, 1] = -1
    arrays["top_k_index"] = idx
    counts = np.bincount(idx[idx >= 0], minlength=5)
    tails = {int(c % 64 or 64) for c in counts if c}
    assert {bool(t <= 16) + bool(t <= 32) for t in tails} == {0, 1, 2}, counts  # every tile height is used
    return arrays, grad_output


def _grouped_gemm_runs(arrays, grad_output, config: plans.TileConfig):
    """Training (output and gradients) and inference results through torch with ``config`` for every grouped GEMM
    of ``_skewed_case``, and the plans' grouped GEMM steps."""
    shapes = (("gate_up", 16, 32), ("down", 32, 16), ("dgrad_down", 16, 32), ("dgrad_up", 32, 32))
    try:
        for kernel, N, K in shapes:
            plans.OVERRIDES[kernel, N, K, 5] = config
        plans.clear_caches()
        runs = (torch_run(arrays, "bfloat16", grad_output), torch_run(arrays, "bfloat16", training=False))
        ts = to_torch(arrays, "bfloat16")
        problem = torch_triton_backend.problem_of(ts["hidden_states"], ts["top_k_index"], ts["gate_up_proj"],
                                                  ts["down_proj"], ts["gate_up_bias"], ts["down_bias"], "silu")
        steps = plans.forward_plan(problem, training=True).steps + plans.backward_plan(problem).steps
        return runs, [s for s in steps if s.kernel == "grouped_gemm_kernel"]
    finally:
        plans.OVERRIDES.clear()
        plans.clear_caches()


def _assert_same_bits(runs, want):
    for got, plain in zip(runs, want):
        for name in plain:
            np.testing.assert_array_equal(got[name], plain[name], err_msg=name)


def test_short_tail_tiles_give_the_same_bits():
    """SHORT_TAILS runs an expert's last block as a 32- or 16-row tile where its rows fit (BM 64): every row is
    still computed once, in the same K steps, so forward and backward give the same bits as 64-row tiles."""
    arrays, grad_output = _skewed_case()
    plain, _ = _grouped_gemm_runs(arrays, grad_output, plans.TileConfig(BM=64, BN=16, BK=16))
    short, steps = _grouped_gemm_runs(arrays, grad_output, plans.TileConfig(BM=64, BN=16, BK=16, SHORT_TAILS=2))
    assert [s.constants["SHORT_TAILS"] for s in steps] == [2] * 4
    _assert_same_bits(short, plain)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_persistent_programs_give_the_same_bits(programs):
    """PROGRAMS > 0 launches that many programs, each looping over every PROGRAMS-th output tile of the real row
    blocks (with GROUP_M and short tails): every tile computed once in the same K steps, so the bits of one
    program per tile, forward, backward and inference; with more programs than tiles the rest do nothing."""
    arrays, grad_output = _skewed_case()
    tiles = dict(BM=64, BN=16, BK=16, GROUP_M=2, SHORT_TAILS=2)
    plain, _ = _grouped_gemm_runs(arrays, grad_output, plans.TileConfig(**tiles))
    persistent, steps = _grouped_gemm_runs(arrays, grad_output, plans.TileConfig(**tiles, PROGRAMS=programs))
    assert [(s.grid, s.constants["PROGRAMS"]) for s in steps] == [(programs, programs)] * 4
    _assert_same_bits(persistent, plain)


@pytest.mark.parametrize("programs", [0, 3])
def test_block_tables_give_the_same_bits(programs):
    """BLOCK_TABLE reads each row block's expert, first row, row count and start from a table written by a step
    before the first GEMM of that tile height (forward and backward each write their own): the same tiles as
    computing them in the GEMM, so the same bits, with one program per tile and persistent programs."""
    arrays, grad_output = _skewed_case()
    tiles = dict(BM=64, BN=16, BK=16, GROUP_M=2, SHORT_TAILS=2, PROGRAMS=programs)
    plain, _ = _grouped_gemm_runs(arrays, grad_output, plans.TileConfig(**tiles))
    tabled, gemms = _grouped_gemm_runs(arrays, grad_output, plans.TileConfig(**tiles, BLOCK_TABLE=True))
    assert [(s.constants["BLOCK_TABLE"], s.inputs[4]) for s in gemms] == [(True, "blocks64")] * 4
    _assert_same_bits(tabled, plain)
    if programs:  # the JAX binding allocates and passes the table as its own plan buffer: torch's bits
        shapes = (("gate_up", 16, 32), ("down", 32, 16), ("dgrad_down", 16, 32), ("dgrad_up", 32, 32))
        try:
            for kernel, N, K in shapes:
                plans.OVERRIDES[kernel, N, K, 5] = plans.TileConfig(**tiles, BLOCK_TABLE=True)
            plans.clear_caches()
            _assert_same_bits([jax_run(arrays, "bfloat16", grad_output)], [tabled[0]])
        finally:
            plans.OVERRIDES.clear()
            plans.clear_caches()


def test_block_table_holds_each_row_blocks_expert_rows_and_start():
    """route_blocks_kernel against the arithmetic of the expert-aligned layout: blocks of BM rows per expert in
    expert order (idle experts take none), E or more past the last block, and the number of real blocks last."""
    counts = np.array([70, 0, 17, 128, 1], np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    E, BM = len(counts), 64
    row_blocks = plans._row_blocks(int(counts.sum()), E, BM)
    step = plans._block_table(plans.Step("grouped_gemm_kernel", 1, ("a", "b", "counts", "starts", "blocks64"), (),
                                         dict(E=E, EB=plans._expert_bins(E), BM=BM, ROW_BLOCKS=row_blocks), 4, 3))
    assert plans._BLOCK_FIELDS == moe.BLOCK_FIELDS.value == 4  # the plan sizes the buffer the kernel fills
    table = torch.zeros(step.outputs[0].shape, dtype=torch.int32)
    moe.route_blocks_kernel[(step.grid,)](torch.from_numpy(counts), torch.from_numpy(starts), table,
                                          **step.constants)
    want = [(e, r, int(counts[e]), int(starts[e])) for e in range(E) for r in range(0, int(counts[e]), BM)]
    fields = table[:-1].view(row_blocks, 4).tolist()
    assert [tuple(f) for f in fields[:len(want)]] == want and table[-1].item() == len(want) == 6
    assert all(f[0] >= E for f in fields[len(want):])
    assert step.grid == -(-row_blocks // plans._TABLE_BLOCKS) and step.inputs == ("counts", "starts")


def test_short_tails_keep_tiles_of_at_least_16_rows():
    assert [plans._short_tails(plans.TileConfig(BM=bm, SHORT_TAILS=3)) for bm in (16, 32, 64, 128)] == [0, 1, 2, 3]
    assert plans._short_tails(plans.TileConfig(BM=128, SHORT_TAILS=1)) == 1


def test_training_gemms_read_sorted_rows():
    """The training forward gathers x into sorted order (kept for the backward) and the backward gathers w * dout
    (gather_rows_kernel), so every training GEMM loads plain row tiles: no gather or scale inside their
    loops. At inference the gate/up GEMM gathers its tokens itself (pointer loads)."""
    arrays, _ = random_case(3, T=16, H=32, I=16, E=4, k=2, bias=False)
    ts = to_torch(arrays, "bfloat16")
    problem = torch_triton_backend.problem_of(ts["hidden_states"], ts["top_k_index"], ts["gate_up_proj"],
                                              ts["down_proj"], None, None, "silu")
    forward = plans.forward_plan(problem, training=True)
    steps = forward.steps + plans.backward_plan(problem).steps
    gathers = {s.outputs[0].name: s.constants["SCALE"] for s in steps if s.kernel == "gather_rows_kernel"}
    assert gathers == {"x_sorted": False, "dout_sorted": True}
    assert "x_sorted" in forward.residuals
    gemms = [s for s in steps if s.kernel == "grouped_gemm_kernel"]
    assert not any(s.constants["A_BY_TOKEN"] for s in gemms) and gemms[0].inputs[0] == "x_sorted"
    wgrads = [s for s in steps if s.kernel == "grouped_wgrad_kernel"]
    assert [s.inputs[:2] for s in wgrads] == [("dout_sorted", "act"), ("dpreact", "x_sorted")]
    inference = plans.forward_plan(replace(problem, T=64))  # past the decode kernels
    assert [s.constants["A_BY_TOKEN"] for s in inference.steps if s.kernel == "grouped_gemm_kernel"] == [True, False]
    assert "gather_rows_kernel" not in [s.kernel for s in inference.steps]


def test_strided_weights_are_read_in_place():
    arrays, grad_output = random_case(7, T=20, H=16, I=8, E=4, k=2, bias=False)
    ts = to_torch(arrays, "float32")
    gate_up_t = ts["gate_up_proj"].transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H], strides (.., 1, 2I)
    down_t = ts["down_proj"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not gate_up_t.is_contiguous()
    with torch.no_grad():
        strided = torch_triton_backend.experts_forward(
            ts["hidden_states"], ts["top_k_index"], ts["top_k_weights"], gate_up_t, down_t)
        plain = torch_triton_backend.experts_forward(
            ts["hidden_states"], ts["top_k_index"], ts["top_k_weights"], ts["gate_up_proj"], ts["down_proj"])
    torch.testing.assert_close(strided, plain, rtol=1e-6, atol=1e-6)


def _every_other(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view with a step of 2 on every axis (no unit stride anywhere)."""
    big = torch.zeros([2 * n for n in t.shape], dtype=t.dtype)
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def test_strided_inputs_give_the_same_bits_as_contiguous_ones():
    """hidden_states, the ids, the routing weights (k = 1: reshape keeps a strided view there), the weights and the
    biases as views with a step of 2: the binding hands the kernels what they read with a unit stride, so the
    output and every gradient are the same bits as from contiguous inputs."""
    arrays, grad_output = random_case(12, T=12, H=16, I=8, E=3, k=1, bias=True, empty_fraction=0.1)
    results = []
    for layout in (lambda t: t, _every_other):
        ts = {n: layout(t).requires_grad_(n in DIFF_ARGS) for n, t in to_torch(arrays, "bfloat16").items()}
        out = torch_triton_backend.experts_forward(**ts)
        out.backward(torch.from_numpy(np.asarray(grad_output, np.float32)).to(out.dtype))
        results.append({"out": out.detach()} | {n: t.grad for n, t in ts.items() if n in DIFF_ARGS})
    assert not any(t.stride(-1) == 1 for t in ts.values())
    for name, plain in results[0].items():
        torch.testing.assert_close(results[1][name], plain, rtol=0, atol=0, msg=name)


def _train_through(path, ts):
    """The training output through the eager autograd.Function (what eager experts_forward runs) or the custom
    ops (what torch.compile traces)."""
    if path == "eager":
        return torch_triton_backend.experts_forward(**ts)
    args = [ts.get(n) for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj",
                                "gate_up_bias", "down_bias")]
    return torch_triton_backend.triton_experts_train(*args, "silu")[0]


@pytest.mark.parametrize("path", ["eager", "op"])
def test_backward_fills_no_zero_gradients_for_the_residuals(path):
    """The training forward's residuals (pre-activations, activations, per-slot outputs) are not the user's: the
    backward gets no zero-filled gradients for them (three bf16 fills of [S, 2I], [S, I] and [S, H] per call).
    Eager mode runs without the op dispatch."""
    arrays, grad_output = random_case(13, T=40, H=32, I=16, E=4, k=2, bias=False)
    ts = to_torch(arrays, "bfloat16", requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = _train_through(path, ts)
        out.backward(torch.from_numpy(np.asarray(grad_output, np.float32)).to(torch.bfloat16))
    ops = [e.name for e in prof.events()]
    through_ops = {"moe_torch::triton_experts_train", "moe_torch::triton_experts_backward"} <= set(ops)
    assert through_ops == (path == "op")
    assert not [op for op in ops if op in ("aten::zeros", "aten::zeros_like", "aten::fill_", "aten::zero_")], ops


def test_eager_training_gives_the_bits_of_the_custom_ops():
    arrays, grad_output = random_case(14, T=40, H=32, I=16, E=4, k=2, bias=True, empty_fraction=0.1)
    results = []
    for path in ("eager", "op"):
        ts = to_torch(arrays, "bfloat16", requires_grad=True)
        out = _train_through(path, ts)
        out.backward(torch.from_numpy(np.asarray(grad_output, np.float32)).to(torch.bfloat16))
        results.append({"out": out.detach()} | {n: t.grad for n, t in ts.items() if n in DIFF_ARGS})
    assert results[0].keys() == results[1].keys() and len(results[0]) == 7
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_torch_custom_ops_trace_fullgraph_with_their_fake_implementations():
    """torch.compile(fullgraph=True) through the custom ops' fake implementations and autograd registration
    (aot_eager: the graph is traced as for inductor, then run eagerly on the interpreter)."""
    arrays, grad_output = random_case(8, T=10, H=16, I=8, E=4, k=2, bias=True)
    ts = to_torch(arrays, "float32", requires_grad=True)
    compiled = torch.compile(lambda **kw: torch_triton_backend.experts_forward(**kw), fullgraph=True,
                             backend="aot_eager")
    out = compiled(**ts)
    out.backward(torch.from_numpy(grad_output).float())
    expected = torch_run(arrays, "float32", grad_output)
    np.testing.assert_array_equal(out.detach().double().numpy(), expected["out"])
    for n, t in ts.items():
        if n in DIFF_ARGS:
            np.testing.assert_array_equal(t.grad.double().numpy(), expected[f"grad_{n}"], err_msg=n)
    with torch.no_grad():
        inference = compiled(**{n: t.detach() for n, t in ts.items()})
    np.testing.assert_array_equal(inference.double().numpy(),
                                  torch_run(arrays, "float32", training=False)["out"])


def test_torch_opcheck():
    arrays, _ = random_case(9, T=6, H=16, I=8, E=4, k=2, bias=True)
    ts = to_torch(arrays, "float32")
    args = (ts["hidden_states"], ts["top_k_index"], ts["top_k_weights"], ts["gate_up_proj"], ts["down_proj"],
            ts["gate_up_bias"], ts["down_bias"], "silu")
    torch.library.opcheck(torch.ops.moe_torch.triton_experts.default, args + (True,),
                          test_utils=("test_schema", "test_faketensor"))
    train_args = tuple(t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                       for t in args)
    torch.library.opcheck(torch.ops.moe_torch.triton_experts_train.default, train_args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_jax_plan_is_traced_once_per_shape_under_jit():
    arrays, grad_output = random_case(10, T=8, H=16, I=8, E=4, k=2, bias=False)
    values = to_jax(arrays, "float32")
    launches = []

    def counting(kernel, step, args, out_shapes):
        launches.append(step.kernel)
        return triton_interpreter.jax_interpreter_launch(kernel, step, args, out_shapes)

    ids = values.pop("top_k_index")
    f = jax.jit(jax.grad(lambda v, ids: jax_triton_backend.experts_forward(top_k_index=ids, **v).sum()))
    with jax_triton_backend.use_launcher(counting):
        f(values, ids)
        traced = list(launches)
        f(values, ids)
    # forward (training plan) + backward plan, each step launched once per trace; the second call re-traces nothing
    assert traced == launches
    assert traced.count("grouped_wgrad_kernel") == 2 and traced.count("routing_grad_kernel") == 1


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_named_gated_activations_only(framework):
    arrays, _ = random_case(11, T=4, H=8, I=4, E=3, k=2, bias=False)
    gate = lambda h: h[..., :4]
    backend = torch_triton_backend if framework == "torch" else jax_triton_backend
    values = to_torch(arrays, "float32") if framework == "torch" else to_jax(arrays, "float32")
    with pytest.raises(ValueError, match=r"activation: implementation 'triton' takes one of \['silu', 'gelu', "
                                         r"'relu'\], got the callable <lambda>"):
        backend.experts_forward(**values, activation=gate)


def test_unavailable_on_cpu_with_reasons():
    assert moe_torch.available_backends("cpu")["triton"] == (
        "implementation 'triton' runs on ['cuda'], got a tensor on cpu")
    reason = moe_jax.available_backends("cpu")["triton"]
    expected = ("implementation 'triton' needs the package 'triton': pip install 'moe-experts[gpu]'"
                if importlib.util.find_spec("triton") is None else
                "implementation 'triton' runs on ['cuda'], got the cpu platform")
    assert reason == expected
    arrays = to_torch(random_case(12, T=4, H=8, I=4, E=3, k=2, bias=False)[0], "float32")
    with pytest.raises(RuntimeError, match=r"runs on \['cuda'\], got a tensor on cpu"):
        moe_torch.experts_forward(**arrays, implementation="triton")


def test_missing_triton_names_the_extra(monkeypatch):
    from moe_shared import registry
    monkeypatch.setitem(registry.PACKAGES_PRESENT, "triton", False)
    with pytest.raises(ImportError, match=r"needs the package 'triton': pip install 'moe-experts\[gpu\]'"):
        moe_torch.api.check_requirements("triton", torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("transpose_w", [True, False])
def test_jax_grouped_matmul_kernel_matches_ragged_dot(transpose_w):
    """moe_jax grouped_mm's CUDA kernel (the Triton grouped GEMM), forward and VJP, against ragged_dot; idle
    groups, and rows past the last group that come out as zeros."""
    from moe_jax.grouped_matmul import grouped_matmul
    rng = np.random.default_rng(13)
    sizes = jnp.asarray([5, 0, 19, 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((30, 24)), jnp.float32)  # 25 grouped rows, 5 past them
    w = jnp.asarray(rng.standard_normal((4, 12, 24) if transpose_w else (4, 24, 12)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((30, 12)), jnp.float32)

    def run(kernel):
        f = lambda x, w: grouped_matmul(x, w, sizes, kernels={"default": kernel}, transpose_w=transpose_w)
        y, vjp = jax.vjp(jax.jit(f), x, w)
        return (y, *vjp(dy))

    with jax_triton_backend.use_launcher(triton_interpreter.jax_interpreter_launch):
        ours = run("triton")
    reference = run("ragged_dot")
    for got, want, name in zip(ours, reference, ("y", "dx", "dw")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=name)
    assert not np.asarray(ours[0][25:]).any()


def test_jax_grouped_mm_traces_only_present_platforms():
    """grouped_mm's spec names the Triton kernel for CUDA; a CPU-only process never traces that branch (its
    binding needs a CUDA jaxlib), and the CPU branch is the expert loop."""
    assert SPEC.backends["grouped_mm"].support("jax").details["kernel"]["cuda"] == "triton"
    values = to_jax(random_case(14, T=6, H=8, I=4, E=3, k=2, bias=False)[0], "float32")
    text = jax.jit(lambda v: moe_jax.experts_forward(**v, implementation="grouped_mm")).lower(values).as_text()
    assert "triton" not in text and "while" in text


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_atomic_combine_at_inference(framework):
    """deterministic=False: the down GEMM adds w * y into float32 token rows (zeroed first) with atomics."""
    arrays, _ = random_case(15, T=40, H=24, I=16, E=5, k=3, bias=True, empty_fraction=0.1)
    problem = _problem(T=40, k=3, E=5, deterministic=False)
    steps = plans.forward_plan(problem).steps
    assert steps[-1].constants["ACCUMULATE"] and steps[-1].zeroed == (0,)
    expected = torch_run(arrays, "float32", training=False)["out"]
    if framework == "torch":
        with torch.no_grad():
            got = torch_triton_backend.experts_forward(**to_torch(arrays, "float32"), deterministic=False)
        got = got.double().numpy()
    else:
        with jax_triton_backend.use_launcher(triton_interpreter.jax_interpreter_launch):
            got = np.asarray(jax.jit(partial(jax_triton_backend.experts_forward, deterministic=False))(
                **to_jax(arrays, "float32")), np.float64)
    assert relative_l2(got, expected) <= 1e-6


def _stand_in_kernel(calls, scratch=0):
    """A stand-in for triton's JITFunction whose compiled kernels record how they were launched: through their
    wrapper (``compiled[grid](...)``) or their C launcher (``compiled.run.launch``)."""

    class Launcher:
        global_scratch_size, profile_scratch_size, global_scratch_align, num_ctas = scratch, 0, 128, 1
        launch_cooperative_grid, launch_pdl = False, True

        def launch(self, *args):
            calls.append(("c-launcher", args))

    class Compiled:
        function, packed_metadata = "function", "packed"
        run = Launcher()

        def __getitem__(self, grid):
            return lambda *args: calls.append(("wrapper", grid, args))

    class Param:
        def __init__(self, name, default):
            self.name, self.default = name, default

    class Kernel:
        arg_names = ["a", "n", "out", "B", "FLAG"]
        params = [Param("a", None), Param("n", None), Param("out", None), Param("B", None), Param("FLAG", 7)]

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(("jit", grid, args, kwargs))
                return Compiled()
            return run

    return Kernel()


def test_launch_cache_reuses_the_compiled_kernel_only_for_the_same_specialization():
    """The torch binding's launch path (GPU only: the interpreter compiles nothing) with a stand-in for triton's
    JITFunction: the first launch per step and argument kind goes through it, later ones launch what it returned
    with the constants appended in the kernel's parameter order; another dtype, alignment, integer or current
    device goes through it again."""
    calls = []
    step = plans.Step("k", 3, ("a", 5), (plans.Buffer("out", (4,), plans.FLOAT32),), {"B": 2}, 4, 2)
    a, out = torch.zeros(8), torch.zeros(4)
    kernel = _stand_in_kernel(calls)
    wrapped = (0, None)  # device 0, no stream: through triton's launch wrapper
    for args, where in (([a, 5, out], wrapped), ([a, 5, out], wrapped), ([a[1:], 5, out], wrapped),
                        ([a, 6, out], wrapped), ([a.double(), 5, out], wrapped), ([a, 5, out], (1, None))):
        torch_triton_backend._launch(kernel, step, args, where)
    assert [c[0] for c in calls] == ["jit", "wrapper", "jit", "jit", "jit", "jit"]
    assert calls[0][3] == {"num_warps": 4, "num_stages": 2, "B": 2}
    assert calls[1][1] == (3, 1, 1) and calls[1][2][3:] == (2, 7)


def test_launch_cache_calls_the_c_launcher_with_the_arguments_of_triton_s_wrapper(monkeypatch):
    """Given a stream, a cached kernel is launched through its C launcher with what triton's wrapper passes it
    (grid, stream, function, launch flags, no scratch, packed metadata, no launch metadata or hooks, then every
    argument, tensors as their addresses, and constant); a kernel that takes a global scratch gets one of programs
    x its bytes per program from the allocator triton's wrapper would use."""
    calls = []
    step = plans.Step("k", 3, ("a", 5), (plans.Buffer("out", (4,), plans.FLOAT32),), {"B": 2}, 4, 2)
    a, out = torch.zeros(8), torch.zeros(4)
    kernel = _stand_in_kernel(calls)
    for _ in range(2):
        torch_triton_backend._launch(kernel, step, [a, 5, out], (0, 1234))
    assert [c[0] for c in calls] == ["jit", "c-launcher"]
    assert calls[1][1] == (3, 1, 1, 1234, "function", False, True, None, None, "packed", None, None, None,
                           a.data_ptr(), 5, out.data_ptr(), 2, 7)

    calls.clear()
    scratch_step = plans.Step("k", 3, ("a", 5), (plans.Buffer("out", (4,), plans.FLOAT32),), {"B": 2}, 4, 2)
    kernel = _stand_in_kernel(calls, scratch=128)
    allocated = []

    def workspace(size, alignment, stream):
        allocated.append((size, alignment, stream))
        return torch.empty(size, dtype=torch.int8)

    monkeypatch.setattr(torch_triton_backend, "_descriptor_workspace", workspace)
    for _ in range(2):
        torch_triton_backend._launch(kernel, scratch_step, [a, 5, out], (0, 1234))
    assert [c[0] for c in calls] == ["jit", "c-launcher"]
    assert allocated == [(3 * 128, 128, 1234)]
    scratch = calls[1][1][7]
    assert isinstance(scratch, torch.Tensor) and scratch.numel() == 3 * 128
    assert calls[1][1][:7] == (3, 1, 1, 1234, "function", False, True)
    assert calls[1][1][8:] == (None, "packed", None, None, None, a.data_ptr(), 5, out.data_ptr(), 2, 7)


def test_triton_launch_hooks_keep_triton_s_launch_wrapper():
    """The C-launcher path is taken only while triton's launch hooks are empty (a profiler adds one): triton 3.6
    keeps them as chains of hooks, never None; CPU tensors get no stream."""
    from triton import knobs
    chain = knobs.runtime.launch_enter_hook
    assert not torch_triton_backend._hook_set(chain) and not torch_triton_backend._hook_set(None)
    chain.add(print)
    try:
        assert torch_triton_backend._hook_set(chain)
    finally:
        chain.remove(print)
    assert torch_triton_backend._launch_place(torch.device("cpu")) == (-1, None)


def _tensor_at(address: int, shape, dtype) -> torch.Tensor:
    """A tensor over the host memory at ``address`` (owned by a live tensor)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=dtype).view(shape)


def _launches_from_addresses(monkeypatch) -> dict:
    """The binding's CUDA launch path stood in for on the CPU: a stream for every call, and each step's first
    launch runs under the interpreter as before and gives, as its direct launch, one that rebuilds the step's
    tensors from the addresses it is passed (with the shapes and dtypes of that first launch's tensors) and runs
    the kernel on them under the interpreter. Returns the counts of the launches of each kind."""
    counts = {"plan": 0, "addresses": 0}
    launch = torch_triton_backend._launch

    def launch_then_bind(kernel, step, args, where):
        counts["plan"] += 1
        assert launch(kernel, step, args, where) is None  # the interpreter compiles nothing
        layout = [(a.shape, a.dtype) if isinstance(a, torch.Tensor) else None for a in args]

        def from_addresses(grid, stream, values, constants):
            counts["addresses"] += 1
            assert (grid, stream, constants) == (step.grid, 1234, ["constants"])
            tensors = [v if spec is None else _tensor_at(v, *spec) for v, spec in zip(values, layout, strict=True)]
            kernel[(grid,)](*tensors, num_warps=step.num_warps, num_stages=step.num_stages, **step.constants)
        return from_addresses, ["constants"]

    monkeypatch.setattr(torch_triton_backend, "_launch", launch_then_bind)
    monkeypatch.setattr(torch_triton_backend, "_launch_place", lambda device: (0, 1234))
    monkeypatch.setattr(torch_triton_backend, "_BOUND", {})
    return counts


@pytest.mark.parametrize("name", ["bfloat16-uniform-T1", "bfloat16-empty-slots-T64", "float32-one-expert-T64",
                                  "float16-half-aligned-T9"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_a_bound_plan_launches_from_addresses_with_the_bits_of_the_plan(name, deterministic, monkeypatch):
    """Eager inference on CUDA binds a call's plan at its first call and later runs it from addresses: its output
    alone, every other buffer in one workspace. Here the launches rebuild tensors from those addresses (on the
    CPU, under the interpreter): the bound call launches every step once from addresses and gives the plan's bits
    (decode and sorted paths, biases, empty slots, the atomic combine's zeroed output)."""
    case = next(c for c in CASES if c.name == name)
    counts = _launches_from_addresses(monkeypatch)
    ts = to_torch(case.inputs, case.dtype)
    first = torch_triton_backend.experts_forward(**ts, deterministic=deterministic)
    steps = counts["plan"]
    assert steps and counts["addresses"] == 0 and list(torch_triton_backend._BOUND.values())[0] is not None
    bound = torch_triton_backend.experts_forward(**ts, deterministic=deterministic)
    assert counts == {"plan": steps, "addresses": steps}
    assert torch.equal(first, bound)
    tol = SPEC.tolerance_for(case.dtype)
    assert relative_l2(bound.double().numpy(), case.expected["out"]) <= tol


def _training_step(ts, grad_output):
    """The output and every gradient (x, routing weights, both weights, the biases) of one eager training call."""
    leaves = {n: t.detach().requires_grad_(True) for n, t in ts.items()
              if n in DIFF_ARGS and t is not None}
    out = torch_triton_backend.experts_forward(**(ts | leaves))
    return out, leaves


@pytest.mark.parametrize("name", ["bfloat16-uniform-T7", "bfloat16-empty-slots-T64", "float32-one-expert-T64"])
def test_bound_training_steps_launch_from_addresses_with_the_bits_of_the_plans(name, monkeypatch):
    """Eager training binds the forward and the backward plans at a key's first step; later steps run both from
    addresses (the forward's residuals in its workspace, read by the backward at their offsets), with the plans'
    bits. A second forward before the first step's backward, backward in the other order: the backward of the
    bound forward (not bound yet) reads the residuals as views of that workspace and binds; the first forward's
    backward then runs bound on its own residual tensors; the same bits again."""
    case = next(c for c in CASES if c.name == name)
    counts = _launches_from_addresses(monkeypatch)
    ts = to_torch(case.inputs, case.dtype)
    grad_output = torch.from_numpy(np.asarray(case.grad_output, np.float32)).to(ts["hidden_states"].dtype)

    def grads(out, leaves):
        return [out.detach()] + list(torch.autograd.grad(out, list(leaves.values()), grad_output))

    first = grads(*_training_step(ts, grad_output))
    plan_launches = counts["plan"]
    assert plan_launches and counts["addresses"] == 0
    assert all(bound is not None for bound in torch_triton_backend._BOUND.values())
    assert sorted(key[0] for key in torch_triton_backend._BOUND) == ["backward", "train"]
    bound = grads(*_training_step(ts, grad_output))
    assert counts == {"plan": plan_launches, "addresses": plan_launches}
    for a, b in zip(first, bound, strict=True):
        assert torch.equal(a, b)
    tol = SPEC.tolerance_for(case.dtype)
    assert relative_l2(bound[0].double().numpy(), case.expected["out"]) <= tol

    torch_triton_backend._BOUND.clear()
    early, late = _training_step(ts, grad_output), _training_step(ts, grad_output)  # the second one bound
    late_grads = grads(*late)  # its backward not bound yet: the residuals as views of the forward's workspace
    assert sorted(key[0] for key in torch_triton_backend._BOUND) == ["backward", "train"]
    early_grads = grads(*early)  # bound, on the first forward's residual tensors
    for a, b, c in zip(first, late_grads, early_grads, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_bound_plans_are_kept_per_shape_alignment_and_option(monkeypatch):
    """Another shape, an input at another address modulo 16 (triton specializes on it) or another option binds
    again; a call with no tokens runs its plan (its steps launch nothing) and is never bound."""
    counts = _launches_from_addresses(monkeypatch)
    ts = to_torch(next(c for c in CASES if c.name == "bfloat16-uniform-T64").inputs, "bfloat16")
    torch_triton_backend.experts_forward(**ts)
    torch_triton_backend.experts_forward(**ts)
    assert len(torch_triton_backend._BOUND) == 1
    shifted = torch.empty(ts["hidden_states"].numel() + 1, dtype=torch.bfloat16)[1:]
    shifted = shifted.view(ts["hidden_states"].shape).copy_(ts["hidden_states"])
    assert shifted.data_ptr() % 16 != ts["hidden_states"].data_ptr() % 16
    base = torch_triton_backend.experts_forward(**ts)
    assert torch.equal(torch_triton_backend.experts_forward(**(ts | {"hidden_states": shifted})), base)
    torch_triton_backend.experts_forward(**(ts | {"hidden_states": ts["hidden_states"][:7]}))
    torch_triton_backend.experts_forward(**ts, activation="gelu")
    assert len(torch_triton_backend._BOUND) == 4
    empty = {n: t[:0] if n in ("hidden_states", "top_k_index", "top_k_weights") else t for n, t in ts.items()}
    before = dict(counts)
    assert torch_triton_backend.experts_forward(**empty).shape == (0, ts["hidden_states"].shape[1])
    assert counts == before and len(torch_triton_backend._BOUND) == 4
    # no stream to launch on directly (a launch hook set, another current device): the plan, never bound
    monkeypatch.setattr(torch_triton_backend, "_launch_place", lambda device: (0, None))
    before = dict(counts)
    torch_triton_backend.experts_forward(**ts)
    assert counts["addresses"] == before["addresses"] and counts["plan"] > before["plan"]
    assert len(torch_triton_backend._BOUND) == 4


def test_bound_plan_workspace_holds_each_buffer_apart_and_aligned():
    """The workspace layout: every buffer but the output at its own 256-byte aligned offset, none overlapping,
    the unused outputs sharing one; the arguments resolve to the call's addresses, the output's, the buffers'
    and the plan's integers."""
    ts = to_torch(next(c for c in CASES if c.name == "bfloat16-empty-slots-T64").inputs, "bfloat16")
    env = torch_triton_backend._inputs(ts["hidden_states"], ts["top_k_index"], ts["top_k_weights"],
                                       ts["gate_up_proj"], ts["down_proj"], ts["gate_up_bias"], ts["down_bias"])
    problem = torch_triton_backend.problem_of(ts["hidden_states"], ts["top_k_index"], ts["gate_up_proj"],
                                              ts["down_proj"], ts["gate_up_bias"], ts["down_bias"], "silu")
    plan = plans.forward_plan(replace(problem, T=200, device="no tuned tiles"))
    dtypes = torch_triton_backend._DTYPE_ROLES | torch_triton_backend._dtypes(env)
    bound = torch_triton_backend._bind(plan, [("launch", [])] * len(plan.steps), dtypes)
    made = {b.name: b for step in plan.steps for b in step.outputs if b.name != plan.output}
    assert len(bound.offsets) == len(made) and "unused" in made
    spans = sorted((o, o + math.prod(b.shape) * dtypes[b.dtype].itemsize) for o, b in zip(bound.offsets,
                                                                                            made.values()))
    assert all(o % torch_triton_backend.WORKSPACE_ALIGN == 0 for o, _ in spans)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])) and spans[-1][1] <= bound.workspace_bytes
    values = bound.values(list(range(100, 107)), [1000], 1 << 20)
    names = list(torch_triton_backend.CALL_INPUTS) + [plan.output] + list(made)
    for step, (_, grid, arguments, _) in zip(plan.steps, bound.launches):
        expected = [a if not isinstance(a, str) else values[names.index(a)] for a in step.inputs]
        expected += [values[names.index(b.name)] for b in step.outputs]
        assert list(arguments(values)) == expected and grid == step.grid
    assert bound.outputs == ((plan.buffers[plan.output].shape, dtypes[plan.buffers[plan.output].dtype], False),)
    assert [name for name, _, _ in bound.workspace] == list(made)


def test_plans_that_cannot_run_from_addresses_are_not_bound():
    """A step without a direct launch (a kernel with a profile scratch) or a workspace buffer that must start as
    zeros keeps a call on the plan path."""
    ts = to_torch(next(c for c in CASES if c.name == "bfloat16-uniform-T64").inputs, "bfloat16")
    problem = torch_triton_backend.problem_of(ts["hidden_states"], ts["top_k_index"], ts["gate_up_proj"],
                                              ts["down_proj"], None, None, "silu")
    plan = plans.forward_plan(problem)
    dtypes = torch_triton_backend._DTYPE_ROLES | {plans.WEIGHTS: torch.bfloat16, plans.HIDDEN: torch.bfloat16,
                                                  plans.ROUTING: torch.bfloat16}
    n = len(plan.steps)
    assert torch_triton_backend._bind(plan, [("launch", [])] * n, dtypes) is not None
    assert torch_triton_backend._bind(plan, [("launch", [])] * (n - 1) + [(None, [])], dtypes) is None
    assert torch_triton_backend._bind(plan, [("launch", [])] * (n - 1), dtypes) is None
    zeroing = replace(plan, steps=(replace(plan.steps[0], zeroed=(0,)),) + plan.steps[1:])
    assert torch_triton_backend._bind(zeroing, [("launch", [])] * n, dtypes) is None


def _described_run(arrays, grad_output, transposed: bool):
    """Output and gradients through the torch binding, weights stored as given or transposed ([E, H, 2I] and
    [E, I, H] storage viewed as the contract's shapes), the inference output, and the descriptor codes of the
    plans: each grouped GEMM's (B_DESC, A_DESC) (training forward, backward, then inference forward) and each
    weight gradient's DESC."""
    ts = to_torch(arrays, "bfloat16")
    if transposed:
        for name in ("gate_up_proj", "down_proj"):
            ts[name] = ts[name].transpose(1, 2).contiguous().transpose(1, 2)
    for t in ts.values():
        if t.is_floating_point():
            t.requires_grad_(True)
    out = torch_triton_backend.experts_forward(**ts)
    out.backward(torch.from_numpy(np.asarray(grad_output, np.float32)).to(torch.bfloat16))
    result = {"out": out.detach().double().numpy()}
    result |= {n: t.grad.double().numpy() for n, t in ts.items() if n in DIFF_ARGS}
    with torch.no_grad():
        result["inference"] = torch_triton_backend.experts_forward(**ts).double().numpy()
    problem = torch_triton_backend.problem_of(ts["hidden_states"], ts["top_k_index"], ts["gate_up_proj"],
                                              ts["down_proj"], ts["gate_up_bias"], ts["down_bias"], "silu")
    steps = (plans.forward_plan(problem, training=True).steps + plans.backward_plan(problem).steps
             + plans.forward_plan(problem).steps)
    return result, ([(s.constants["B_DESC"], s.constants["A_DESC"]) for s in steps if s.kernel == "grouped_gemm_kernel"]
                    + [s.constants["DESC"] for s in steps if s.kernel == "grouped_wgrad_kernel"])


@pytest.mark.parametrize("rows", [False, True], ids=["weights", "weights-and-rows"])
@pytest.mark.parametrize("transposed", [False, True], ids=["stored", "transposed"])
def test_tiles_through_tensor_descriptors_give_the_same_bits(transposed, rows, monkeypatch):
    """TMA=True loads the weight tiles through tensor descriptors (rows of n where k is contiguous, rows of k where
    n is), and the weight gradients' whole row steps (the last partial step of each expert through pointers);
    A_TMA=True the grouped GEMMs' row tiles too (at inference the gate/up GEMM then reads x gathered first): the
    same tiles, so the same bits as the masked pointer loads, forward, backward and inference."""
    arrays, grad_output = random_case(10, T=40, H=32, I=16, E=3, k=2, bias=True, empty_fraction=0.1)
    monkeypatch.setattr(torch_triton_backend, "tensor_descriptors_allowed", lambda *weights: True)
    shapes = (("gate_up", 16, 32), ("down", 32, 16), ("dgrad_down", 16, 32), ("dgrad_up", 32, 32),
              ("wgrad", 32, 16), ("wgrad", 32, 32))
    try:
        for kernel, N, K in shapes:
            plans.OVERRIDES[kernel, N, K, 3] = plans.TileConfig(BM=16, BN=16, BK=16)
        plans.clear_caches()
        plain, plain_codes = _described_run(arrays, grad_output, transposed)
        for kernel, N, K in shapes:
            plans.OVERRIDES[kernel, N, K, 3] = plans.TileConfig(BM=16, BN=16, BK=16, TMA=True, A_TMA=rows)
        plans.clear_caches()
        described, codes = _described_run(arrays, grad_output, transposed)
    finally:
        plans.OVERRIDES.clear()
        plans.clear_caches()
    k_rows, n_rows, pointers = plans.B_K_ROWS, plans.B_N_ROWS, plans.B_POINTERS
    assert plain_codes == [(pointers, False)] * 6 + [False] * 2
    # training forward gate_up, down; backward dgrad_down, dgrad_up (the transposed weights swap the
    # orientations); inference gate_up, down; then both weight gradients
    forward, backward = (n_rows, k_rows) if transposed else (k_rows, n_rows)
    b_codes = [forward, forward, backward, backward, forward, forward]
    assert codes == [(b, rows) for b in b_codes] + [True] * 2
    for name in plain:
        np.testing.assert_array_equal(described[name], plain[name], err_msg=name)


def test_row_descriptors_alone_get_the_descriptor_workspace(monkeypatch):
    """A plan whose kernels make only row-tile descriptors (the weights through pointers) still gets triton's
    allocator for their global scratch."""
    import triton
    arrays, grad_output = random_case(13, T=40, H=32, I=16, E=3, k=2, bias=False)
    monkeypatch.setattr(torch_triton_backend, "tensor_descriptors_allowed", lambda *weights: True)
    allocators = []
    monkeypatch.setattr(triton, "set_allocator", allocators.append)
    shapes = (("gate_up", 16, 32), ("down", 32, 16), ("dgrad_down", 16, 32), ("dgrad_up", 32, 32))
    try:
        for kernel, N, K in shapes:
            plans.OVERRIDES[kernel, N, K, 3] = plans.TileConfig(BM=16, BN=16, BK=16, A_TMA=True)
        plans.clear_caches()
        ours = torch_run(arrays, "bfloat16", grad_output)
        ts = to_torch(arrays, "bfloat16")
        problem = torch_triton_backend.problem_of(ts["hidden_states"], ts["top_k_index"], ts["gate_up_proj"],
                                                  ts["down_proj"], None, None, "silu")
        steps = plans.forward_plan(problem, training=True).steps + plans.backward_plan(problem).steps
    finally:
        plans.OVERRIDES.clear()
        plans.clear_caches()
    gemms = [s for s in steps if s.kernel == "grouped_gemm_kernel"]
    assert [(s.constants["B_DESC"], s.constants["A_DESC"]) for s in gemms] == [(plans.B_POINTERS, True)] * 4
    assert allocators == [torch_triton_backend._descriptor_workspace] * 2  # the forward's run and the backward's
    plain = torch_run(arrays, "bfloat16", grad_output)
    _assert_same_bits([ours], [plain])


def test_tensor_descriptors_need_a_layout_that_fits():
    problem = plans.Problem(T=8, H=24, I=20, E=3, k=2, activation="silu", dtype="bfloat16",
                            gate_up_strides=(40 * 24, 24, 1), down_strides=(24 * 20, 20, 1), tma=True)
    cfg = plans.TileConfig(BM=16, BN=16, BK=16, TMA=True)
    assert plans._b_descriptor(problem, cfg, (40 * 24, 1, 24), 24)["B_DESC"] == plans.B_K_ROWS  # 48-byte rows
    assert plans._b_descriptor(problem, cfg, (24 * 20, 1, 20), 20)["B_DESC"] == plans.B_POINTERS  # 40-byte rows
    assert plans._b_descriptor(problem, cfg, (24 * 20 + 8, 1, 24), 24)["B_DESC"] == plans.B_POINTERS  # a gap
    assert plans._b_descriptor(problem, cfg, (40 * 24, 2, 48), 24)["B_DESC"] == plans.B_POINTERS  # no unit stride
    off = plans.Problem(**{**problem.__dict__, "tma": False})
    assert plans._b_descriptor(off, cfg, (40 * 24, 1, 24), 24)["B_DESC"] == plans.B_POINTERS
    assert plans._b_descriptor(problem, plans.TileConfig(), (40 * 24, 1, 24), 24)["B_DESC"] == plans.B_POINTERS


def test_jax_binding_reads_tiles_through_descriptors_when_its_launcher_gives_scratch():
    """A launcher without global scratch gets pointer loads; one with it (the default), the descriptor loads of
    weight and row tiles, with the same bits."""
    arrays, grad_output = random_case(11, T=24, H=32, I=16, E=3, k=2, bias=False)
    shapes = (("gate_up", 16, 32), ("down", 32, 16), ("dgrad_down", 16, 32), ("dgrad_up", 32, 32))
    values = to_jax(arrays, "bfloat16")

    def loads():
        problem = jax_triton_backend.problem_of(values["hidden_states"], values["top_k_index"],
                                                values["gate_up_proj"], values["down_proj"], None, None, "silu")
        return {(s.constants["B_DESC"], s.constants["A_DESC"]) for s in plans.forward_plan(problem).steps
                if s.kernel == "grouped_gemm_kernel"}

    assert jax_triton_backend.XLA_LAUNCHER.tensor_descriptors is True
    with_scratch = jax_triton_backend.Launcher(triton_interpreter.jax_interpreter_launch, tensor_descriptors=True)
    try:
        for kernel, N, K in shapes:
            plans.OVERRIDES[kernel, N, K, 3] = plans.TileConfig(BM=16, BN=16, BK=16, TMA=True, A_TMA=True)
        plans.clear_caches()
        with jax_triton_backend.use_launcher(with_scratch):
            assert loads() == {(plans.B_K_ROWS, True)}
            described = jax_run(arrays, "bfloat16", grad_output, launcher=with_scratch)
        with jax_triton_backend.use_launcher(triton_interpreter.jax_interpreter_launch):
            assert loads() == {(plans.B_POINTERS, False)}
        plain = jax_run(arrays, "bfloat16", grad_output)
    finally:
        plans.OVERRIDES.clear()
        plans.clear_caches()
    for name in plain:
        np.testing.assert_array_equal(described[name], plain[name], err_msg=name)


def test_tracing_reads_no_address_of_cuda_weights():
    """The fake implementations build plans from fake tensors (tracing on CUDA): no data pointer is read, and the
    plans' buffers are those of pointer loads."""
    import warnings
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # reading a FakeTensor's data pointer warns
        gate_up = torch.empty(3, 32, 32, device="cuda", dtype=torch.bfloat16)
        down = torch.empty(3, 32, 16, device="cuda", dtype=torch.bfloat16)
        assert not torch_triton_backend.tensor_descriptors_allowed(gate_up, down)


def test_tuned_tables_hold_tile_configs_the_planner_picks():
    """Every entry of the checked-in tables is a TileConfig of power-of-two tiles for a kernel the plans name; the
    planner takes the entry of the nearest slot count for its shape."""
    kernels = {"gate_up", "down", "dgrad_down", "dgrad_up", "wgrad", "decode"}
    for path in plans.CONFIG_DIR.glob("*.json"):
        table = json.loads(path.read_text())
        device = table["device"]
        assert plans.device_file_name(device) == path.stem
        for entry in table["configs"]:
            cfg = plans.TileConfig(**entry["config"])
            assert entry["kernel"] in kernels, entry
            assert all(v & (v - 1) == 0 for v in (cfg.BM, cfg.BN, cfg.BK)), entry
            assert plans.tile_config(device, entry["kernel"], entry["N"], entry["K"], entry["E"],
                                     entry["slots"]) == cfg


def test_a_table_s_tuned_reach_bounds_the_slot_counts_an_entry_stands_for(monkeypatch):
    """Without ``tuned_reach`` the nearest entry is taken at any distance; with it (log2), only within that reach,
    else the documented default for that many rows per expert."""
    tuned = plans.TileConfig(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)
    table = {"configs": [{"kernel": "dgrad_up", "N": 64, "K": 32, "E": 4, "slots": 4096, "config": vars(tuned)}]}
    monkeypatch.setattr(plans, "_tuned", lambda device: table)
    pick = partial(plans.tile_config, "a device", "dgrad_up", 64, 32, 4)
    assert all(pick(slots) == tuned for slots in (64, 2048, 4096, 8192, 1 << 20))
    table["tuned_reach"] = 1.0
    assert all(pick(slots) == tuned for slots in (2048, 4096, 8192))
    for slots in (64, 2047, 8193):
        assert pick(slots) == plans.default_config("dgrad_up", 64, 32, slots / 4)
    assert pick(64).BM == 16  # 16 rows per expert: 16-row blocks, not the entry's 128


def test_merging_step_variants_keeps_the_fastest_per_step(tmp_path):
    """``device_triton_check.py --merge-steps``: the fastest measured variant of each step replaces the table's
    entry of that kernel, shape and slot count where it beats the step's own config by MERGE_MARGIN; failed
    variants, steps whose variants are not that much faster and other entries are left alone."""
    import device_triton_check as check
    H, I, E, k = check.SHAPES["qwen3-30b-a3b"]
    kept = {"kernel": "gate_up", "N": I, "K": H, "E": E, "slots": 512, "config": {"BM": 16}, "ms": 1.0}
    replaced = {"kernel": "down", "N": H, "K": I, "E": E, "slots": 4096 * k, "config": {"BM": 16}, "ms": 9.0}
    close = {"kernel": "gate_up", "N": I, "K": H, "E": E, "slots": 4096 * k, "config": {"BM": 32}, "ms": 0.4}
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"device": "X", "configs": [kept, replaced, close]}))
    step = {"shape": "qwen3-30b-a3b", "T": 4096, "step": "down"}
    own_gate_up = step | {"step": "gate_up", "ms": 0.40, "config": [32, 64, 64, 4, 4, 1, 0, False]}
    results = tmp_path / "steps.json"
    results.write_text(json.dumps({"results": [
        {"kind": "steps", "detail": [step | {"ms": 0.5, "config": [16, 128, 64, 8, 3, 1, 0, False]}, own_gate_up]},
        {"kind": "step-variants", "detail": [own_gate_up | {"ms": 0.39, "config": [64, 64, 64, 4, 4, 8, 0, False]}]},
        {"kind": "step-variants", "detail": [
            step | {"ms": 0.30, "config": [128, 128, 64, 8, 3, 8, 0, False]},
            step | {"ms": 0.27, "config": [128, 256, 64, 8, 3, 8, 1, True]},
            {"config": [128, 256, 64, 8, 4, 8, 1, False], "error": "out of resource"}]},
        {"kind": "step-variants", "detail": [
            step | {"step": "wgrad_gate_up", "ms": 0.7, "config": [64, 128, 128, 8, 3, None, None, None]}]}]}))
    check.merge_step_variants([results], table)
    configs = {(c["kernel"], c["N"], c["K"], c["slots"]): c for c in json.loads(table.read_text())["configs"]}
    assert configs["gate_up", I, H, 512] == kept
    assert configs["gate_up", I, H, 4096 * k] == close  # 0.39 against its own 0.40 ms: within the margin
    down = configs["down", H, I, 4096 * k]
    assert down["ms"] == 0.27 and down["timed"] == "step alone"
    assert plans.TileConfig(**down["config"]) == plans.TileConfig(BM=128, BN=256, BK=64, num_warps=8, num_stages=3,
                                                                  GROUP_M=8, TMA=True, WARP_SPECIALIZE=True)
    assert configs["wgrad", 2 * I, H, 4096 * k]["config"] == {"BM": 64, "BN": 128, "BK": 128, "num_warps": 8,
                                                              "num_stages": 3}
