"""The CPU row kernel (moe_shared/kernels/expert_rows.h) through both bindings, moe_jax.expert_rows (the expert
loop's XLA FFI call) and moe_torch.expert_rows (a C entry point over a list of groups): its numbers in both of its
ways (AMX tiles, AVX512-BF16 dot products) and both orientations (x @ w.T, and the transposed mode x @ w), the same
bits from torch and JAX, that the backends' bfloat16 forwards run it and JAX grouped_mm's backward runs its
transposed mode, and the reasons it gives where it cannot run."""

from __future__ import annotations

import mmap
import os
import re
import warnings
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moe_jax import experts_forward, expert_loop, expert_rows
from moe_torch import experts_forward as torch_experts_forward
from moe_torch import expert_rows as torch_rows
from moe_shared import native, reference
from support import DIFF_ARGS, assert_close, random_case

REASON = expert_rows.unavailable()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"the row kernel cannot run here: {REASON}")
WAYS = {"amx": "1", "avx512": "0"}


@pytest.fixture
def fresh_state():
    """The kernel's cached availability and warning forgotten before and after the test (it is registered again
    on the next use)."""
    expert_rows.unavailable.cache_clear()
    native.warn_once.cache_clear()
    yield
    expert_rows.unavailable.cache_clear()
    native.warn_once.cache_clear()


def _assert_rows_match_float64(way, B, inner, N, K, E, count, transposed, monkeypatch):
    """expert_rows (x [B, K] @ w[e].T) or expert_rows_transposed (x [B, N] @ w[e]) on w [E, N, K], the weights read
    in place, against float64: float32 sums of the exact bfloat16 products, zeros from row ``count`` on."""
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL_AMX", WAYS[way])
    if way == "amx" and not expert_rows.amx():
        pytest.skip("the CPU has no AMX")
    rng = np.random.default_rng(B * (K if transposed else N) + count)
    x = jnp.asarray(rng.standard_normal((B, inner)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((E, N, K)), jnp.bfloat16)
    e = E - 1
    kernel = expert_rows.expert_rows_transposed if transposed else expert_rows.expert_rows
    call = jax.jit(lambda a, b: kernel(a, b, e, count))  # traced here: the way is read at tracing
    got = np.asarray(call(x, w))
    weights = np.asarray(w[e], np.float64)
    want = np.asarray(x, np.float64)[:count] @ (weights if transposed else weights.T)
    assert got.shape == (B, K if transposed else N) and got.dtype == np.float32
    assert not got[count:].any()  # the rows past count: zeros, not what the buffer held
    if count:
        err = np.linalg.norm(got[:count] - want) / np.linalg.norm(want)
        assert err < 1e-6, err


# B x rows, K, N weight rows, E experts, count: the AMX tiles with a tail of weight rows (under 16) and several
# passes over x's tiles (2, 2, 1), a k width off the tiles' 32 (the AVX512 way throughout), no rows, one row
@pytest.mark.parametrize("B, K, N, E, count", [(8, 1024, 768, 4, 3), (70, 64, 200, 2, 70), (40, 96, 70, 3, 37),
                                                (5, 40, 7, 3, 5), (4, 64, 9, 2, 0), (1, 32, 16, 1, 1)])
@pytest.mark.parametrize("way", list(WAYS))
@needs_kernel
def test_row_kernel_matches_float64(way, B, K, N, E, count, monkeypatch):
    _assert_rows_match_float64(way, B, K, N, K, E, count, False, monkeypatch)


@pytest.mark.parametrize("K, N", [(1024, 768), (40, 70), (96, 13)])
@pytest.mark.parametrize("way", list(WAYS))
@needs_kernel
def test_a_one_row_group_gives_the_bits_of_that_row_in_a_larger_group(way, K, N, monkeypatch):
    """A decode slot's group (one x row) takes blocks of 8 weight rows, other groups blocks of 4 x rows by 4
    weight rows: each output is the same sum in the same order, so the same bits (N off 8 and K off 32 included)."""
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL_AMX", WAYS[way])
    if way == "amx" and not expert_rows.amx():
        pytest.skip("the CPU has no AMX")
    rng = np.random.default_rng(K + N)
    x = jnp.asarray(rng.standard_normal((5, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, N, K)), jnp.bfloat16)
    rows = jax.jit(lambda a, b, count: expert_rows.expert_rows(a, b, 1, count), static_argnums=2)
    np.testing.assert_array_equal(np.asarray(rows(x, w, 1))[0], np.asarray(rows(x, w, 5))[0])
    np.testing.assert_array_equal(np.asarray(rows(x[:1], w, 1)), np.asarray(rows(x, w, 5))[:1])


# B rows, K, N, T token rows, count: AMX tiles with a tail of weight rows and several x tiles, a k width off 32
# (the AVX512 way), no rows, one row
@pytest.mark.parametrize("B, K, N, T, count", [(40, 96, 70, 13, 37), (70, 64, 200, 30, 70), (8, 1024, 768, 5, 3),
                                                (33, 40, 7, 6, 30), (4, 64, 9, 3, 0), (1, 32, 16, 1, 1)])
@pytest.mark.parametrize("way", list(WAYS))
@needs_kernel
def test_row_kernel_add_is_the_scatter_add_of_its_rounded_rows(way, B, K, N, T, count, monkeypatch):
    """expert_rows_add: the same bits as XLA's in-order scatter-add of the row kernel's products rounded to
    bfloat16 and times their scales, into token rows that repeat; rows from count on add nothing."""
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL_AMX", WAYS[way])
    if way == "amx" and not expert_rows.amx():
        pytest.skip("the CPU has no AMX")
    rng = np.random.default_rng(B * N + T)
    x = jnp.asarray(rng.standard_normal((B, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, N, K)), jnp.bfloat16)
    token = jnp.asarray(rng.integers(0, T, B), jnp.int32)
    scale = jnp.asarray(rng.random(B), jnp.float32)
    into = jnp.asarray(rng.standard_normal((T, N)), jnp.float32)
    added = jax.jit(lambda o, a, b, t, s: expert_rows.expert_rows_add(o, a, b, 1, count, t, s))  # traced here
    got = np.asarray(added(into, x, w, token, scale))
    rows = jax.jit(lambda a, b: expert_rows.expert_rows(a, b, 1, count))(x, w)
    terms = rows.astype(jnp.bfloat16).astype(jnp.float32) * scale[:, None]
    want = np.asarray(into.at[jnp.where(jnp.arange(B) < count, token, T)].add(terms, mode="drop"))
    np.testing.assert_array_equal(got, want)


@needs_kernel
def test_row_kernel_add_refuses_a_token_row_out_of_range():
    x, w = jnp.ones((2, 32), jnp.bfloat16), jnp.ones((1, 16, 32), jnp.bfloat16)
    with pytest.raises(Exception, match="token index out of range"):
        expert_rows.expert_rows_add(jnp.zeros((3, 16)), x, w, 0, 2, jnp.asarray([0, 3], jnp.int32),
                                    jnp.ones(2)).block_until_ready()


# B x rows, N (the weights' first dimension, contracted), K outputs, E experts, count: qwen3-cpu's down weights at 3
# rows (AMX: one x tile; the accumulators carried across 8 blocks of weight rows; 4 chunks of 96 columns); 5 x tiles
# (passes of 2, 2, 1) with N off 32 (blocks of 4, 4, 2 steps) and K past a chunk (128 + 72); N odd and off 32, K off
# 16; 2 rows (the AVX512 way, AMX or not), a lone last weight row; no rows; one row, K = 96 + 34; two x tiles, N
# under one step
@pytest.mark.parametrize("B, N, K, E, count", [(8, 1024, 384, 4, 3), (70, 300, 200, 2, 70), (40, 77, 70, 3, 37),
                                                (5, 41, 7, 3, 2), (4, 64, 9, 2, 0), (1, 33, 130, 1, 1),
                                                (17, 7, 16, 2, 17)])
@pytest.mark.parametrize("way", list(WAYS))
@needs_kernel
def test_row_kernel_transposed_matches_float64(way, B, N, K, E, count, monkeypatch):
    """expert_rows_transposed: x [B, N] times w[e] [N, K] (not transposed), the weights read in place; float32
    sums of the exact bfloat16 products, zeros from row count on."""
    _assert_rows_match_float64(way, B, N, N, K, E, count, True, monkeypatch)


@pytest.mark.parametrize("x_shape, x_dtype, w_dtype, message", [
    ((4, 64), jnp.float16, jnp.bfloat16,
     r"x: expected dtype bfloat16 \(the row kernel's only one\), got dtype float16"),
    ((4, 64), jnp.bfloat16, jnp.float32,
     r"weights: expected dtype bfloat16 \(the row kernel's only one\), got dtype float32"),
    ((4, 1, 64), jnp.bfloat16, jnp.bfloat16, r"x: expected a 2-D array, got shape \(4, 1, 64\)"),
    ((4, 16), jnp.bfloat16, jnp.bfloat16,
     r"x: expected shape \[B, N\] = \(\?, 64\) for weights of shape \(2, 64, 16\), got shape \(4, 16\)"),
])
def test_row_kernel_transposed_names_a_wrong_operand(x_shape, x_dtype, w_dtype, message):
    """Checked at tracing, before any kernel is looked at: the argument, what was expected and what came."""
    x, w = jnp.zeros(x_shape, x_dtype), jnp.zeros((2, 64, 16), w_dtype)
    with pytest.raises(ValueError, match=message):
        expert_rows.expert_rows_transposed(x, w, 0, 1)


# S rows, N, K, group sizes (E of them): rows past the groups, an expert without rows in the middle and at the end,
# K off 32 with N odd, one expert taking every row
@pytest.mark.parametrize("S, N, K, sizes", [(40, 70, 96, (3, 0, 20, 1, 10)), (19, 33, 40, (5, 7, 0)),
                                             (8, 16, 64, (8,))])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("way", list(WAYS))
@needs_kernel
def test_grouped_rows_are_each_experts_rows_in_one_call(way, S, N, K, sizes, transposed, monkeypatch):
    """grouped_rows: every expert's rows (sorted by expert) times its weights in one call, the bits of expert_rows
    (expert_rows_transposed) on each group alone, within float32 sums of float64; zeros past the groups' rows."""
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL_AMX", WAYS[way])
    if way == "amx" and not expert_rows.amx():
        pytest.skip("the CPU has no AMX")
    rng = np.random.default_rng(S + N)
    x = jnp.asarray(rng.standard_normal((S, N if transposed else K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(sizes), N, K)), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(jax.jit(partial(expert_rows.grouped_rows, transposed=transposed))(x, w, group_sizes))
    one = expert_rows.expert_rows_transposed if transposed else expert_rows.expert_rows
    assert got.shape == (S, K if transposed else N) and got.dtype == np.float32
    row = 0
    for e, n in enumerate(sizes):
        if n:
            alone = np.asarray(jax.jit(lambda a, b, e=e, n=n: one(a, b, e, n))(x[row:row + n], w))
            np.testing.assert_array_equal(got[row:row + n], alone)
            weights = np.asarray(w[e], np.float64)
            want = np.asarray(x[row:row + n], np.float64) @ (weights if transposed else weights.T)
            assert np.linalg.norm(got[row:row + n] - want) / np.linalg.norm(want) < 1e-6
        row += n
    assert not got[row:].any()


@needs_kernel
def test_grouped_rows_name_bad_operands():
    x, w = jnp.zeros((6, 32), jnp.bfloat16), jnp.zeros((3, 16, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"group_sizes: expected shape \(3,\) for weights of shape \(3, 16, 32\), "
                                         r"got shape \(2,\)"):
        expert_rows.grouped_rows(x, w, jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match=r"x: expected shape \[B, K\] = \(\?, 32\)"):
        expert_rows.grouped_rows(x[:, :16], w, jnp.ones(3, jnp.int32))
    with pytest.raises(Exception, match="group_sizes: negative, or more rows than x has"):
        expert_rows.grouped_rows(x, w, jnp.asarray([4, 0, 3], jnp.int32)).block_until_ready()
    with pytest.raises(Exception, match="group_sizes: negative, or more rows than x has"):
        expert_rows.grouped_rows(x, w, jnp.asarray([4, -1, 1], jnp.int32)).block_until_ready()


@pytest.mark.parametrize("T, E, k, empty", [(8, 16, 4, 0.0), (24, 6, 3, 0.2), (1, 8, 2, 0.5)])
@needs_kernel
def test_grouped_forward_gives_the_bits_of_the_expert_loop(T, E, k, empty, monkeypatch):
    """Under GROUPED_MEAN_ROWS the bfloat16 forward without biases runs as two grouped_rows calls and one ordered
    scatter-add; above it (the bound set to 0 here) the loop over experts with expert_rows_add. The same bits:
    output, and every gradient (the backward reads the same pre-activations)."""
    arrays, dy = random_case(T * E + k, T=T, H=64, I=48, E=E, k=k, bias=False, empty_fraction=empty)
    values = {n: jnp.asarray(a, jnp.int32 if n == "top_k_index" else jnp.bfloat16) for n, a in arrays.items()
              if a is not None}
    names = [n for n in DIFF_ARGS if n in values]

    def run(bound):
        monkeypatch.setattr(expert_loop, "GROUPED_MEAN_ROWS", {True: bound, False: bound})

        def forward_and_grads(diff, dy):
            f = lambda *d: experts_forward(**(values | dict(zip(names, d))), implementation="grouped_mm")
            out, vjp = jax.vjp(f, *diff)
            return out, vjp(dy)

        args = ([values[n] for n in names], jnp.asarray(dy, jnp.bfloat16))
        compiled = jax.jit(forward_and_grads).lower(*args).compile()
        return compiled.as_text().count('custom_call_target="moe_grouped_rows"'), compiled(*args)

    (grouped_calls, grouped), (loop_calls, loop) = run(1 << 20), run(0)
    assert (grouped_calls, loop_calls) == (2, 0)
    for a, b in zip(jax.tree.leaves(grouped), jax.tree.leaves(loop), strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@needs_kernel
def test_grouped_mm_bfloat16_forward_runs_the_row_kernel(monkeypatch):
    """bfloat16 at few rows per expert: the forward's matmuls are the row kernel's custom calls (none in float32,
    none with MOE_JAX_ROW_KERNEL=off), and the forward and every gradient match the float64 reference, as they do
    with it off."""
    # 6 rows per expert: under ROW_KERNEL_MEAN_ROWS with AMX and without
    arrays, dy = random_case(21, T=12, H=96, I=48, E=4, k=2, bias=True, empty_fraction=0.1)
    kw = dict(activation="silu", gate_up_bias=arrays["gate_up_bias"], down_bias=arrays["down_bias"])
    args = [arrays[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")]
    expected = reference.experts_backward(*args, dy, **kw) | {"out": reference.experts_forward(*args, **kw)}
    assert expert_loop.uses_row_kernel(12 * 2, 4, *(jnp.zeros(1, jnp.bfloat16),) * 3)

    def run(dtype):
        values = {n: jnp.asarray(a, jnp.int32 if n == "top_k_index" else dtype) for n, a in arrays.items()}
        names = [n for n in DIFF_ARGS if n in values]

        def forward_and_grads(diff, dy):
            f = lambda *d: experts_forward(**(values | dict(zip(names, d))), implementation="grouped_mm")
            out, vjp = jax.vjp(f, *diff)
            return out, dict(zip(names, vjp(dy)))

        call = jax.jit(forward_and_grads)
        diff, g = [values[n] for n in names], jnp.asarray(dy, dtype)
        return call.lower(diff, g).compile().as_text(), call(diff, g)

    for setting, dtype, runs in (("auto", jnp.bfloat16, True), ("off", jnp.bfloat16, False),
                                 ("auto", jnp.float32, False)):
        monkeypatch.setenv("MOE_JAX_ROW_KERNEL", setting)
        hlo, (out, grads) = run(dtype)
        calls = hlo.count('custom_call_target="moe_expert_rows"')
        # gate/up and down in each loop over an expert's blocks (its first block, the further ones); with a down
        # bias, the down projection stores its rows (no expert_rows_add)
        assert calls == (4 if runs else 0), (setting, dtype, calls)
        assert 'custom_call_target="moe_expert_rows_add"' not in hlo
        name = jnp.dtype(dtype).name
        assert_close("out", np.asarray(out, np.float64), expected["out"], name)
        for n, g in grads.items():
            assert_close(f"grad_{n}", np.asarray(g, np.float64), expected[n], name)


@pytest.mark.parametrize("T, E, k", [(160, 2, 1), (12, 4, 2)])  # about 72 rows per expert, 5
@pytest.mark.parametrize("way", list(WAYS))
@needs_kernel
def test_grouped_mm_bfloat16_forward_adds_its_rows_on_the_row_kernel(way, T, E, k, monkeypatch):
    """bfloat16 without a down bias, where the forward runs on the row kernel (under ROW_KERNEL_MEAN_ROWS, None:
    at any rows per expert): the down projection is expert_rows_add's custom call, which adds the rows into the
    token rows, or, under GROUPED_MEAN_ROWS, the two projections are two grouped_rows calls over every expert's rows
    and no call per expert; elsewhere (and with the kernel off), XLA's dots and scatter-add instead. The forward and
    every gradient match the float64 reference each way."""
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL_AMX", WAYS[way])
    if way == "amx" and not expert_rows.amx():
        pytest.skip("the CPU has no AMX")
    arrays, dy = random_case(T + E, T=T, H=64, I=32, E=E, k=k, bias=False, empty_fraction=0.1)
    args = [arrays[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")]
    expected = reference.experts_backward(*args, dy, activation="silu") | {
        "out": reference.experts_forward(*args, activation="silu")}
    values = {n: jnp.asarray(a, jnp.int32 if n == "top_k_index" else jnp.bfloat16) for n, a in arrays.items()
              if a is not None}
    names = [n for n in DIFF_ARGS if n in values]

    for setting in ("auto", "off"):
        monkeypatch.setenv("MOE_JAX_ROW_KERNEL", setting)

        def forward_and_grads(diff, dy):  # a new function per setting: jit's cache would keep the first trace
            f = lambda *d: experts_forward(**(values | dict(zip(names, d))), implementation="grouped_mm")
            out, vjp = jax.vjp(f, *diff)
            return out, dict(zip(names, vjp(dy)))

        call = jax.jit(forward_and_grads)
        diff, g = [values[n] for n in names], jnp.asarray(dy, jnp.bfloat16)
        hlo = call.lower(diff, g).compile().as_text()
        calls = hlo.count('custom_call_target="moe_expert_rows_add"')
        bound = expert_loop.ROW_KERNEL_MEAN_ROWS[way == "amx"]
        adds = setting == "auto" and (bound is None or T * k // E < bound)
        grouped_bound = expert_loop.GROUPED_MEAN_ROWS[way == "amx"]
        grouped = adds and -(-T * k // E) < grouped_bound
        assert (calls > 0) == (adds and not grouped), (setting, calls)
        assert hlo.count('custom_call_target="moe_grouped_rows"') == (2 if grouped else 0), setting
        out, grads = call(diff, g)
        assert_close("out", np.asarray(out, np.float64), expected["out"], "bfloat16")
        for n, grad in grads.items():
            assert_close(f"grad_{n}", np.asarray(grad, np.float64), expected[n], "bfloat16")


# the AVX512 way runs at few rows per expert only (ROW_KERNEL_MEAN_ROWS): 14 rows per expert on average with AMX
# (blocks of 32 rows: one or two x tiles, or a few rows on the AVX512 way), 6 without
@pytest.mark.parametrize("way, T", [("amx", 28), ("avx512", 12)])
@needs_kernel
def test_grouped_mm_bfloat16_backward_runs_the_transposed_row_kernel(way, T, monkeypatch):
    """bfloat16: the backward's products through the weights (the output gradient through the down weights, the
    pre-activation gradient through the gate/up weights) are moe_expert_rows_transposed's custom calls, two in each
    loop over blocks (an expert's first block, one loop per block size; its further blocks), and the weight
    gradients moe_weight_grads' two: no dot is left. With MOE_JAX_ROW_KERNEL=off or in
    float32, XLA's dots on the weight slices instead. The forward and every gradient within the tolerance table
    each way."""
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL_AMX", WAYS[way])
    if way == "amx" and not expert_rows.amx():
        pytest.skip("the CPU has no AMX")
    H, I, E, k = 72, 44, 4, 2  # H and 2I off multiples of 16: no block of rows has a weight gradient's shape
    arrays, dy = random_case(T + 31, T=T, H=H, I=I, E=E, k=k, bias=False, empty_fraction=0.1)
    args = [arrays[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")]
    expected = reference.experts_backward(*args, dy, activation="silu") | {
        "out": reference.experts_forward(*args, activation="silu")}
    weight_gradients = {(2 * I, H), (H, I)}
    block_sizes = expert_loop.block_sizes(T * k, E, backward=True)

    for setting, dtype, runs in (("auto", jnp.bfloat16, True), ("off", jnp.bfloat16, False),
                                 ("auto", jnp.float32, False)):
        monkeypatch.setenv("MOE_JAX_ROW_KERNEL", setting)
        values = {n: jnp.asarray(a, jnp.int32 if n == "top_k_index" else dtype) for n, a in arrays.items()
                  if a is not None}
        names = [n for n in DIFF_ARGS if n in values]

        def forward_and_grads(diff, dy):  # a new function per setting: jit's cache would keep the first trace
            f = lambda *d: experts_forward(**(values | dict(zip(names, d))), implementation="grouped_mm")
            out, vjp = jax.vjp(f, *diff)
            return out, dict(zip(names, vjp(dy)))

        call = jax.jit(forward_and_grads)
        diff, g = [values[n] for n in names], jnp.asarray(dy, dtype)
        hlo = call.lower(diff, g).compile().as_text()
        calls = hlo.count('custom_call_target="moe_expert_rows_transposed"')
        assert calls == (2 * (len(block_sizes) + 1) if runs else 0), (setting, dtype, calls)
        # the weight gradients come from moe_weight_grads, written once per expert (test below)
        assert hlo.count('custom_call_target="moe_weight_grads"') == (2 if runs else 0), (setting, dtype)
        dots = {(int(a), int(b)) for a, b in re.findall(r"= f32\[(\d+),(\d+)\]\{[\d,]*\} dot\(", hlo)}
        assert (not dots) if runs else not dots <= weight_gradients, (setting, dtype, dots)
        out, grads = call(diff, g)
        name = jnp.dtype(dtype).name
        assert_close("out", np.asarray(out, np.float64), expected["out"], name)
        for n, grad in grads.items():
            assert_close(f"grad_{n}", np.asarray(grad, np.float64), expected[n], name)


# (T, E) at k=2: fewer slots than experts; as many; 40 rows per expert (over a bound of 16: XLA's dots)
@pytest.mark.parametrize("T, E", [(3, 16), (8, 16), (40, 2)])
@pytest.mark.parametrize("bound", ["host", 16])
@needs_kernel
def test_grouped_mm_backward_weight_gradients_by_rows_per_expert(T, E, bound, monkeypatch):
    """bfloat16 on the row kernel: up to WEIGHT_GRADS_MEAN_ROWS rows per expert (this host's bound, and 16) the
    weight gradients come from moe_weight_grads (which writes the idle experts' zeros itself), from the rows of dh,
    gw and a the loop keeps (three buffers of the library's zeros); by default no huge pages asked, with
    MOE_EXPERTS_HUGE_PAGES=1 they are, and the bits are the same. Above it, XLA's dots per block, into XLA's zeros.
    The gradients within the tolerance table each way."""
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL", "auto")
    if bound != "host":
        monkeypatch.setattr(expert_loop, "WEIGHT_GRADS_MEAN_ROWS", {True: bound, False: bound})
    limit = expert_loop.WEIGHT_GRADS_MEAN_ROWS[expert_rows.amx()]
    H, I, k = 40, 24, 2
    arrays, dy = random_case(T + 7, T=T, H=H, I=I, E=E, k=k, bias=False, empty_fraction=0.0)
    args = [arrays[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")]
    expected = reference.experts_backward(*args, dy, activation="silu")
    values = {n: jnp.asarray(a, jnp.int32 if n == "top_k_index" else jnp.bfloat16) for n, a in arrays.items()
              if a is not None}
    names = [n for n in DIFF_ARGS if n in values]

    def grads(diff, dy):  # a new function per setting: jit's cache would keep the first trace
        f = lambda *d: experts_forward(**(values | dict(zip(names, d))), implementation="grouped_mm")
        return dict(zip(names, jax.vjp(f, *diff)[1](dy)))

    diff, g = [values[n] for n in names], jnp.asarray(dy, jnp.bfloat16)
    call = jax.jit(grads)
    hlo = call.lower(diff, g).compile().as_text()
    fused = limit is None or T * k <= limit * E
    assert hlo.count('custom_call_target="moe_weight_grads"') == 2 * fused
    assert hlo.count('custom_call_target="moe_zeros"') == 3 * fused
    assert hlo.count("from_bytes = -1") == 5 * fused
    got = call(diff, g)
    for n, grad in got.items():
        assert_close(f"grad_{n}", np.asarray(grad, np.float64), expected[n], "bfloat16")
    if fused:
        monkeypatch.setenv("MOE_EXPERTS_HUGE_PAGES", "1")
        advised = jax.jit(lambda d, y: grads(d, y))  # a new function: traced again
        assert advised.lower(diff, g).compile().as_text().count("from_bytes = -1") == 0
        for n, grad in advised(diff, g).items():
            np.testing.assert_array_equal(np.asarray(grad), np.asarray(got[n]), err_msg=n)


@pytest.mark.parametrize("S, N, K, R, E", [(13, 40, 24, 7, 5), (9, 17, 33, 4, 3), (64, 96, 272, 16, 8),
                                           (24, 256, 4096, 8, 12)])
@needs_kernel
def test_weight_grads_sum_each_experts_outer_products(S, N, K, R, E):
    """moe_weight_grads: per expert with rows, the outer products of its left rows and their right rows (gathered),
    summed in float32 and rounded once: within one bfloat16 rounding of the float64 sums (K off multiples of 16 and
    32, odd row counts: a pair's missing row); zeros for the other experts, also where XLA hands it memory holding
    other values (the last shape's idle runs are over a page and over the release size, each call's output lands on
    memory the one before freed or on fresh pages); the same bits on every call."""
    rng = np.random.default_rng(S)
    left = jnp.asarray(rng.standard_normal((S, N)), jnp.bfloat16)
    right = jnp.asarray(rng.standard_normal((R, K)), jnp.bfloat16)
    rows = jnp.asarray(rng.integers(0, R, S), jnp.int32)
    cuts = np.sort(rng.integers(0, S + 1, E - 1))
    start, end = np.concatenate([[0], cuts]), np.concatenate([cuts, [S]])
    start[1] = end[1] = start[1]  # expert 1 without rows
    if E >= 12:  # a run of idle experts from the first one, and one at the end
        start[:4], end[:4] = 0, 0
        start[-3:], end[-3:] = S, S
        start[4], end[-4] = 0, S
    args = (left, right, rows, jnp.asarray(start, jnp.int32), jnp.asarray(end, jnp.int32))
    L, gathered = np.asarray(left, np.float64), np.asarray(right, np.float64)[np.asarray(rows)]
    want = np.stack([L[a:b].T @ gathered[a:b] for a, b in zip(start, end)])
    empty = start >= end  # expert 1, and any other the cuts left without rows
    call = jax.jit(expert_rows.weight_grads)
    first = None
    for _ in range(3):
        junk = jax.block_until_ready(jnp.full((E, N, K), 3, jnp.bfloat16))  # freed memory holding threes
        del junk
        got = np.asarray(call(*args), np.float64)
        assert np.all(got[empty] == 0)
        assert np.all(np.abs(got - want)[~empty] <= 2.0 ** -8 * np.abs(want)[~empty] + 1e-30)
        first = got if first is None else first
        np.testing.assert_array_equal(got, first)


@needs_kernel
def test_weight_grads_name_bad_operands():
    left, right = jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((3, 16), jnp.bfloat16)
    rows, start, end = jnp.zeros(4, jnp.int32), jnp.asarray([0, 2], jnp.int32), jnp.asarray([2, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"left: expected a 2-D bfloat16 array, got float32 of shape \(4, 8\)"):
        expert_rows.weight_grads(left.astype(jnp.float32), right, rows, start, end)
    with pytest.raises(ValueError, match=r"start, end: expected two \[E\] arrays, got shapes \(2,\) and \(3,\)"):
        expert_rows.weight_grads(left, right, rows, start, jnp.zeros(3, jnp.int32))
    with pytest.raises(Exception, match="moe_weight_grads: right_row index out of range"):
        jax.block_until_ready(expert_rows.weight_grads(left, right, rows.at[1].set(3), start, end))
    with pytest.raises(Exception, match="moe_weight_grads: an expert's rows lie outside left"):
        jax.block_until_ready(expert_rows.weight_grads(left, right, rows, start, end.at[1].set(5)))


@pytest.mark.parametrize("shape, dtype", [((3, 5), jnp.bfloat16), ((17,), jnp.float32), ((9, 1024, 1024), jnp.float32),
                                          ((0, 4), jnp.bfloat16)])
@needs_kernel
@pytest.mark.parametrize("huge_pages", ["0", "1"])
def test_library_zeros_are_zeros(shape, dtype, huge_pages, monkeypatch):
    """moe_zeros: zeros of the shape and dtype asked, under and over the release size and
    HUGE_PAGES_FROM_BYTES (36 MB: pages not in memory released, the others written, then, with
    MOE_EXPERTS_HUGE_PAGES=1, marked for huge pages),
    and for no elements; its memory is whatever XLA's allocator gave (reused buffers written with other values
    included)."""
    assert 9 * 1024 * 1024 * 4 >= native.HUGE_PAGES_FROM_BYTES
    monkeypatch.setenv("MOE_EXPERTS_HUGE_PAGES", huge_pages)
    for _ in range(2):  # the second call may get the first one's freed memory back
        junk = jax.block_until_ready(jnp.full(shape, 7, dtype))
        del junk
        got = jax.jit(lambda: expert_rows.zeros(shape, dtype))()
        assert got.shape == shape and got.dtype == dtype
        assert not np.asarray(got).any()


def test_row_kernel_says_why_it_cannot_run(fresh_state, monkeypatch, tmp_path):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f"}))
    assert expert_rows.unavailable() == "the CPU lacks avx512bw, avx512_bf16"
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL", "auto")
    assert not expert_rows.enabled()  # a CPU without the instructions: XLA's dots, no warning
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL", "on")
    with pytest.raises(RuntimeError, match="MOE_JAX_ROW_KERNEL=on, but the row kernel cannot run: the CPU lacks"):
        expert_rows.enabled()
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"MOE_JAX_ROW_KERNEL: expected one of \('auto', 'on', 'off'\), got 'fast'"):
        expert_rows.enabled()

    expert_rows.unavailable.cache_clear()
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(native.CPU_FLAGS))
    monkeypatch.setenv("MOE_EXPERTS_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL", "auto")
    with pytest.warns(RuntimeWarning, match="the CPU row kernel is not used .false failed on expert_rows.cc"):
        assert not expert_rows.enabled()
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL", "off")
    assert not expert_rows.enabled()  # off: not even looked at


def test_row_kernel_is_not_built_beside_an_accelerator(fresh_state, monkeypatch, tmp_path):
    """With a GPU as JAX's default backend, grouped_mm's traced CPU branch runs XLA's dots: auto builds and
    registers nothing (no compiler is run, no warning), while on still asks for the kernel."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(native.CPU_FLAGS))
    monkeypatch.setenv("MOE_EXPERTS_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # were a build tried, it would fail and warn
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL", "auto")
    bf16 = (jnp.zeros(1, jnp.bfloat16),) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not expert_loop.uses_row_kernel(8, 4, *bf16)
    assert expert_rows.unavailable.cache_info().currsize == 0 and not list(tmp_path.iterdir())
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL", "on")
    with pytest.raises(RuntimeError, match="MOE_JAX_ROW_KERNEL=on, but the row kernel cannot run: false failed"):
        expert_loop.uses_row_kernel(8, 4, *bf16)


# --- the torch binding ----------------------------------------------------------------------------------------------

TORCH_REASON = torch_rows.unavailable()
needs_torch_kernel = pytest.mark.skipif(TORCH_REASON is not None,
                                        reason=f"the torch row kernel cannot run here: {TORCH_REASON}")


@pytest.fixture
def fresh_torch_state():
    torch_rows.unavailable.cache_clear()
    native.warn_once.cache_clear()
    yield
    torch_rows.unavailable.cache_clear()
    native.warn_once.cache_clear()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("way", list(WAYS))
@needs_torch_kernel
def test_torch_row_kernel_matches_float64(way, threads, monkeypatch):
    """Groups of 0, 1, 3, 17 and 40 rows (an expert twice), x rows read with a stride past K, output rows at other
    offsets than the input's; N with a tail under the AMX tiles' 16 rows and K off 32 (the AVX512 way) too."""
    monkeypatch.setenv("MOE_TORCH_ROW_KERNEL_AMX", WAYS[way])
    if way == "amx" and not torch_rows.amx():
        pytest.skip("the CPU has no AMX")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(7)
    for E, N, K in ((5, 200, 64), (3, 70, 96), (2, 9, 40)):
        x = torch.randn(90, K + 8, generator=gen).bfloat16()[:, :K]  # rows K + 8 apart
        table = torch.randn(E, N, K, generator=gen).bfloat16()
        x_row, out_row, rows, expert = [0, 5, 5, 8, 25], [60, 0, 3, 10, 40], [0, 3, 1, 17, 40], [1, 0, E - 1, 1, 0]
        out = torch_rows.grouped_rows(x, table, 80, x_row, out_row, rows, expert)
        assert out.shape == (80, N) and out.dtype == torch.float32
        for xr, orow, r, e in zip(x_row, out_row, rows, expert):
            want = x[xr:xr + r].double() @ table[e].double().T
            got = out[orow:orow + r].double()
            assert torch.linalg.norm(got - want) <= 1e-6 * torch.linalg.norm(want), (E, N, K, r)


@needs_torch_kernel
def test_torch_row_kernel_runs_on_torchs_openmp_team():
    """The torch binding's threads are torch's OpenMP team: a call on two threads starts no thread of its own once
    torch's team of two exists, and the process maps one OpenMP runtime (a second one's workers would compete with
    torch's, which spin a while after each op)."""
    gen = torch.Generator().manual_seed(5)
    x, table = torch.randn(64, 256, generator=gen).bfloat16(), torch.randn(8, 512, 256, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 22).add_(1)  # torch's team of two, started if it was not
        before = len(os.listdir("/proc/self/task"))
        out = torch_rows.grouped_rows(x, table, 64, [0, 32], [0, 32], [32, 32], [1, 6])
        assert len(os.listdir("/proc/self/task")) == before
    finally:
        torch.set_num_threads(threads)
    runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert len(runtimes) == 1, runtimes
    want = x[32:].double() @ table[6].double().T
    assert torch.linalg.norm(out[32:].double() - want) <= 1e-6 * torch.linalg.norm(want)


@pytest.mark.parametrize("way", list(WAYS))
@needs_kernel
@needs_torch_kernel
def test_torch_and_jax_row_kernels_give_the_same_bits(way, monkeypatch):
    """The same kernel from both frameworks: bit-identical outputs on the same inputs, in either way."""
    for variable in ("MOE_TORCH_ROW_KERNEL_AMX", "MOE_JAX_ROW_KERNEL_AMX"):
        monkeypatch.setenv(variable, WAYS[way])
    if way == "amx" and not torch_rows.amx():
        pytest.skip("the CPU has no AMX")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(24, 256, generator=gen).bfloat16()
    table = torch.randn(4, 144, 256, generator=gen).bfloat16()
    ours = torch_rows.grouped_rows(x, table, 24, [0], [0], [21], [2])[:21]
    call = jax.jit(lambda a, b: expert_rows.expert_rows(a, b, 2, 21))  # traced here: the way is read at tracing
    theirs = call(jnp.asarray(x.float().numpy(), jnp.bfloat16), jnp.asarray(table.float().numpy(), jnp.bfloat16))
    np.testing.assert_array_equal(ours.numpy(), np.asarray(theirs)[:21])


def _torch_ops(fn) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


@pytest.mark.parametrize("backend", ["grouped_mm", "batched_mm"])
@needs_torch_kernel
def test_torch_backends_run_the_row_kernel(backend, monkeypatch):
    """bfloat16 on the CPU at few rows per expert: one kernel call per projection (no matmul op) at inference, and
    in the training forward (batched_mm's autograd functions, grouped_mm's training step); grouped_mm's training
    step's backward also runs its two products through the weights on the kernel (under TRANSPOSED_MEAN_ROWS), and
    both backends' backwards their two weight gradients in moe_weight_grads (under WEIGHT_GRADS_MEAN_ROWS). None of
    it in float32 or with MOE_TORCH_ROW_KERNEL=off. Forward and every gradient within the tolerance table each way."""
    arrays, dy = random_case(23, T=24, H=96, I=48, E=6, k=2, bias=False, empty_fraction=0.1)
    args = [arrays[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")]
    expected = reference.experts_backward(*args, dy, activation="silu")
    expected["out"] = reference.experts_forward(*args, activation="silu")
    rows = int((arrays["top_k_index"] >= 0).sum())  # 48 slots, about a tenth empty: under 8 rows per expert
    transposed = torch_rows.TRANSPOSED_MEAN_ROWS[torch_rows.amx()]
    weight_grads = torch_rows.WEIGHT_GRADS_MEAN_ROWS[torch_rows.amx()]
    hit = len(np.unique(arrays["top_k_index"][arrays["top_k_index"] >= 0]))
    under = lambda bound, experts: bound is None or rows < bound * experts  # per hit expert, or per expert

    def run(dtype, train):
        values = {n: torch.from_numpy(np.ascontiguousarray(a)) if n == "top_k_index" else
                  torch.from_numpy(np.ascontiguousarray(a)).to(dtype).requires_grad_(train) for n, a in arrays.items()}
        result = {}

        def call():
            out = torch_experts_forward(**values, implementation=backend)
            if train:
                out.backward(torch.from_numpy(dy).to(dtype))
            result["out"] = out

        ops = _torch_ops(call)
        grads = {n: v.grad for n, v in values.items() if train and n in DIFF_ARGS}
        calls = (ops.get(torch_rows.PROFILER_NAME, 0), ops.get("moe_torch::weight_grads", 0))
        return calls, result["out"].detach(), grads

    step = backend == "grouped_mm"
    trained = (2 + 2 * (step and under(transposed, hit)), 2 * under(weight_grads, 6))
    cases = [("auto", torch.bfloat16, False, (2, 0)), ("off", torch.bfloat16, False, (0, 0)),
             ("auto", torch.float32, False, (0, 0)), ("auto", torch.bfloat16, True, trained),
             ("off", torch.bfloat16, True, (0, 0)), ("auto", torch.float32, True, (0, 0))]
    for setting, dtype, train, calls in cases:
        monkeypatch.setenv("MOE_TORCH_ROW_KERNEL", setting)
        ran, out, grads = run(dtype, train)
        assert ran == calls, (setting, dtype, train, ran)
        name = str(dtype).removeprefix("torch.")
        assert_close("out", out.double().numpy(), expected["out"], name)
        for n, g in grads.items():
            assert_close(f"grad_{n}", g.double().numpy(), expected[n], name)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T, k, H", [(0, 2, 16), (1, 8, 1024), (37, 3, 70), (300, 8, 200)])
@needs_torch_kernel
def test_torch_combine_slots_gives_the_bits_of_the_slot_order_sum(T, k, H, threads, monkeypatch):
    """combine_slots reads rows in another order (a permutation, rows strided past H) and gives the bits of
    base.sum_over_k on the rows in slot order, into bfloat16 and float32; empty slots add nothing though their rows
    hold NaN; H off 16 takes the masked tail."""
    from moe_torch.base import sum_over_k

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(T + k + H)
    in_slot_order = torch.randn(T * k, H, generator=gen).bfloat16()
    weights = torch.rand(T, k, generator=gen).bfloat16()
    empty = torch.rand(T * k, generator=gen) < 0.2
    in_slot_order[empty] = float("nan")
    order = torch.randperm(T * k, generator=gen)  # the slot of each stored row
    stored = torch.full((T * k, H + 8), 7.0, dtype=torch.bfloat16)[:, :H]
    stored[:] = in_slot_order[order]
    want = sum_over_k(in_slot_order.view(T, k, H), weights, empty.view(T, k))
    for dtype in (torch.bfloat16, torch.float32):
        got = torch_rows.combine_slots(stored, order, empty, weights, dtype)
        assert got.dtype == dtype and got.shape == (T, H)
        assert torch.equal(got, want.to(dtype)), dtype


@needs_torch_kernel
def test_torch_zero_releases_pages_of_anonymous_memory_only(tmp_path):
    """expert_rows.zero_ gives zeros on written memory, large (partial pages at both ends written: the slice starts
    mid-page) and small; on a private file mapping whose pages are not in memory (the file's cached pages dropped),
    where released pages would read the file again, it writes the zeros (the lookup in /proc/self/maps), and the
    file is left as it was."""
    big = torch.full((6 << 20,), 3, dtype=torch.uint8)
    part = big[1000:-1000]  # unaligned ends
    assert torch_rows.zero_(part) is part
    assert not part.any() and (big[:1000] == 3).all() and (big[-1000:] == 3).all()
    again = torch.full((6 << 20,), 5, dtype=torch.uint8)  # memory that may be the first one's, written again
    assert not torch_rows.zero_(again).any()
    small = torch.full((3, 5), 2.0)
    assert not torch_rows.zero_(small).any()
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x07" * (8 << 20))
    with open(path, "r+b") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # clean cached pages dropped: none in memory
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writes stay in this process
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the buffer is writable: frombuffer's warning is for read-only ones
            view = torch.frombuffer(mapped, dtype=torch.uint8)
        pages = (8 << 20) // mmap.PAGESIZE
        assert _pages_in_memory(view.data_ptr(), pages) < pages // 2
        torch_rows.zero_(view[4096:])
        assert not view[4096:].any() and (view[:4096] == 7).all()
        del view
        mapped.close()
    assert path.read_bytes() == b"\x07" * (8 << 20)


def _pages_in_memory(address: int, pages: int) -> int:
    """How many of the ``pages`` pages from ``address`` (page-aligned) are in memory (mincore)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    vector = ctypes.create_string_buffer(pages)
    if libc.mincore(address, pages * mmap.PAGESIZE, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vector.raw)


@needs_torch_kernel
def test_zero_writes_pages_in_memory_and_releases_the_others():
    """zero_pages.h on a range of a private anonymous mapping whose first half was written and second half never
    touched: zeros throughout; the written half stays in memory (written, not released, so that memory an
    allocator reuses does not fault again), and the untouched half is not brought into memory."""
    page, pages = mmap.PAGESIZE, 2048
    pages_buffer = mmap.mmap(-1, pages * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages_buffer.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KB pages: a write brings in its page alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        view = torch.frombuffer(pages_buffer, dtype=torch.uint8)
    view[: pages // 2 * page] = 7
    address = view.data_ptr()
    assert _pages_in_memory(address, pages) == pages // 2
    torch_rows.zero_(view[100:])  # unaligned start: its partial page written
    assert _pages_in_memory(address, pages) == pages // 2  # before the reads below bring in the zero page
    assert not view[100:].any() and (view[:100] == 7).all()
    del view
    pages_buffer.close()


@needs_torch_kernel
def test_grouped_mm_combines_its_sorted_rows_on_the_row_library(monkeypatch):
    """grouped_mm's bfloat16 inference on the CPU sums each token's slots from the down projection's rows in expert
    order (one moe_torch::combine_slots call, no copy back to slot order), with the bits of the copy-then-sum path
    (MOE_TORCH_ROW_KERNEL=off, the same F.grouped_mm at this many rows per expert); float32 routing weights and
    training take the copy path. Within the tolerance table each way."""
    arrays = random_case(25, T=300, H=64, I=32, E=2, k=2, bias=False, empty_fraction=0.1)[0]
    expected = reference.experts_forward(**arrays, activation="silu")

    def run(setting, weights_dtype=torch.bfloat16, train=False):
        monkeypatch.setenv("MOE_TORCH_ROW_KERNEL", setting)
        values = {n: torch.from_numpy(np.ascontiguousarray(a)) if n == "top_k_index" else
                  torch.from_numpy(np.ascontiguousarray(a)).bfloat16().requires_grad_(train)
                  for n, a in arrays.items()}
        values["top_k_weights"] = values["top_k_weights"].detach().to(weights_dtype).requires_grad_(train)
        result = {}
        ops = _torch_ops(lambda: result.setdefault("out", torch_experts_forward(**values, implementation="grouped_mm")))
        assert ops.get(torch_rows.PROFILER_NAME, 0) == 0  # 300 rows per expert: F.grouped_mm either way
        out = result["out"].detach()
        assert_close("out", out.double().numpy(), expected, "bfloat16")
        return ops.get("moe_torch::combine_slots", 0), out

    (fused, out), (copied, out_off) = run("auto"), run("off")
    assert (fused, copied) == (1, 0)
    assert torch.equal(out, out_off)
    assert run("auto", weights_dtype=torch.float32)[0] == 0
    assert run("auto", train=True)[0] == 0


@needs_torch_kernel
def test_torch_row_kernel_takes_few_rows_per_expert_only(monkeypatch):
    """A grouped matmul runs on the kernel under MEAN_ROWS rows per expert with rows (idle experts not counted);
    under torch.compile not directly but through an opaque op (``applies_compiled``)."""
    bound = torch_rows.MEAN_ROWS[torch_rows.amx()]
    few = torch.tensor([0, bound - 1, bound - 1, 2 * bound - 2], dtype=torch.int32)  # two experts with rows
    assert torch_rows.expert_groups(few) == ([0, bound - 1], [bound - 1, bound - 1], [1, 3])
    assert torch_rows.expert_groups(torch.tensor([bound, 2 * bound], dtype=torch.int32)) is None
    x, table = torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(2, 16, 32, dtype=torch.bfloat16)
    assert torch_rows.applies(x, table)
    assert not torch_rows.applies_compiled(x, table)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not torch_rows.applies(x, table) and torch_rows.applies_compiled(x, table)


@needs_torch_kernel
def test_compiled_grouped_mm_runs_the_row_kernel_through_its_op(monkeypatch):
    """Compiled with fullgraph, grouped_mm's bfloat16 inference runs each projection in the opaque op
    moe_torch::eager_grouped_linear, which takes the kernel at few rows per expert; with MOE_TORCH_ROW_KERNEL=off
    the graph has no such op. The output within the tolerance table either way."""
    arrays = random_case(24, T=24, H=96, I=48, E=6, k=2, bias=False, empty_fraction=0.1)[0]
    expected = reference.experts_forward(**arrays, activation="silu")
    values = {n: torch.from_numpy(np.ascontiguousarray(a)) if n == "top_k_index" else
              torch.from_numpy(np.ascontiguousarray(a)).bfloat16() for n, a in arrays.items()}
    for setting, calls in (("auto", 2), ("off", 0)):
        monkeypatch.setenv("MOE_TORCH_ROW_KERNEL", setting)
        torch._dynamo.reset()
        compiled = torch.compile(lambda **kw: torch_experts_forward(**kw, implementation="grouped_mm"),
                                 fullgraph=True)
        compiled(**values)
        result = {}
        ops = _torch_ops(lambda: result.setdefault("out", compiled(**values)))
        assert ops.get("moe_torch::eager_grouped_linear", 0) == calls, setting
        assert ops.get(torch_rows.PROFILER_NAME, 0) == calls, setting
        assert_close("out", result["out"].double().numpy(), expected, "bfloat16")


def test_torch_row_kernel_says_why_it_cannot_run(fresh_torch_state, monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw"}))
    assert torch_rows.unavailable() == "the CPU lacks avx512_bf16"
    x, table = torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(2, 16, 32, dtype=torch.bfloat16)
    monkeypatch.setenv("MOE_TORCH_ROW_KERNEL", "auto")
    assert not torch_rows.applies(x, table)  # torch.mm instead, no warning
    monkeypatch.setenv("MOE_TORCH_ROW_KERNEL", "on")
    with pytest.raises(RuntimeError, match="MOE_TORCH_ROW_KERNEL=on, but the row kernel cannot run: the CPU lacks"):
        torch_rows.applies(x, table)
    monkeypatch.setenv("MOE_TORCH_ROW_KERNEL", "yes")
    with pytest.raises(ValueError, match=r"MOE_TORCH_ROW_KERNEL: expected one of \('auto', 'on', 'off'\), got 'yes'"):
        torch_rows.applies(x, table)


@pytest.mark.parametrize("S, N, K, E", [(13, 40, 24, 5), (64, 96, 272, 8), (9, 17, 33, 3)])
@needs_kernel
@needs_torch_kernel
def test_torch_and_jax_weight_grads_and_transposed_rows_are_the_same_bits(S, N, K, E, monkeypatch):
    """The same kernels through both bindings: torch's grouped_mm weight gradient (moe_weight_grads on torch's
    OpenMP team, idle experts zeroed in the same call) and its product of rows through each expert's weights (the
    transposed row kernel, where TRANSPOSED_MEAN_ROWS takes it) give JAX's calls' bits; both within one bfloat16
    rounding of the float64 sums (odd row counts, K and N off multiples of 16 and 32, an expert without rows)."""
    from moe_torch.backends.grouped_mm import grouped_linear, grouped_weight_grad

    monkeypatch.setattr(torch_rows, "WEIGHT_GRADS_MEAN_ROWS", {True: None, False: None})
    monkeypatch.setattr(torch_rows, "TRANSPOSED_MEAN_ROWS", {True: None, False: None})
    rng = np.random.default_rng(S + N)
    left, right = rng.standard_normal((S, N)), rng.standard_normal((S, K))
    weights = rng.standard_normal((E, N, K))
    ends = np.sort(rng.integers(0, S + 1, E)).astype(np.int32)
    ends[-1] = S
    ends[1] = ends[0]  # expert 1 without rows
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int32)
    as_torch = lambda a: torch.from_numpy(np.ascontiguousarray(a)).bfloat16()
    L, R, W = (np.asarray(as_torch(a).double()) for a in (left, right, weights))

    grads = grouped_weight_grad(as_torch(left), as_torch(right), torch.from_numpy(ends), E)
    want = np.stack([L[a:b].T @ R[a:b] for a, b in zip(starts, ends)])
    got = grads.double().numpy()
    assert np.all(got[1] == 0) and np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 1e-30)
    same = lambda a: jnp.asarray(as_torch(a).float().numpy(), jnp.bfloat16)  # torch's bfloat16 bits, exactly
    from_jax = expert_rows.weight_grads(same(left), same(right),
                                        jnp.arange(S, dtype=jnp.int32), jnp.asarray(starts), jnp.asarray(ends))
    np.testing.assert_array_equal(np.asarray(from_jax.astype(jnp.float32)), grads.float().numpy())

    table = as_torch(weights)
    through = grouped_linear(as_torch(left), table.transpose(1, 2), torch.from_numpy(ends))  # left @ W[e]
    want = np.concatenate([L[a:b] @ W[e] for e, (a, b) in enumerate(zip(starts, ends))])
    assert np.all(np.abs(through.double().numpy() - want) <= 2.0 ** -8 * np.abs(want) + 1e-6)
    jax_rows = [np.asarray(expert_rows.expert_rows_transposed(same(left[a:b]), same(weights), e, b - a))
                for e, (a, b) in enumerate(zip(starts, ends)) if b > a]
    rounded = jnp.asarray(np.concatenate(jax_rows)).astype(jnp.bfloat16).astype(jnp.float32)  # as torch's output
    np.testing.assert_array_equal(np.asarray(rounded), through[:ends[-1]].float().numpy())
