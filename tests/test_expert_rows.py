"""The expert loop's CPU row kernel (moe_jax.expert_rows): its numbers in both of its ways (AMX tiles, AVX512-BF16
dot products), that grouped_mm's bfloat16 forward runs it, and the reasons it gives where it cannot run."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import experts_forward, expert_loop, expert_rows
from moe_shared import reference
from support import DIFF_ARGS, assert_close, random_case

REASON = expert_rows.unavailable()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"the row kernel cannot run here: {REASON}")
WAYS = {"amx": "1", "avx512": "0"}


@pytest.fixture
def fresh_state():
    """The kernel's cached availability and warning forgotten before and after the test (it is registered again
    on the next use)."""
    expert_rows.unavailable.cache_clear()
    expert_rows._warn_once.cache_clear()
    yield
    expert_rows.unavailable.cache_clear()
    expert_rows._warn_once.cache_clear()


# B x rows, K, N weight rows, E experts, count: the AMX tiles with a tail of weight rows (under 16) and several
# passes over x's tiles (2, 2, 1), a k width off the tiles' 32 (the AVX512 way throughout), no rows, one row
@pytest.mark.parametrize("B, K, N, E, count", [(8, 1024, 768, 4, 3), (70, 64, 200, 2, 70), (40, 96, 70, 3, 37),
                                                (5, 40, 7, 3, 5), (4, 64, 9, 2, 0), (1, 32, 16, 1, 1)])
@pytest.mark.parametrize("way", list(WAYS))
@needs_kernel
def test_row_kernel_matches_float64(way, B, K, N, E, count, monkeypatch):
    monkeypatch.setenv("MOE_JAX_ROW_KERNEL_AMX", WAYS[way])
    if way == "amx" and not expert_rows.amx():
        pytest.skip("the CPU has no AMX")
    rng = np.random.default_rng(B * N + count)
    x = jnp.asarray(rng.standard_normal((B, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((E, N, K)), jnp.bfloat16)
    e = E - 1
    got = np.asarray(jax.jit(expert_rows.expert_rows)(x, w, e, count))
    want = np.asarray(x, np.float64)[:count] @ np.asarray(w[e], np.float64).T
    assert got.shape == (B, N) and got.dtype == np.float32
    assert not got[count:].any()  # the rows past count: zeros, not what the buffer held
    if count:
        err = np.linalg.norm(got[:count] - want) / np.linalg.norm(want)
        assert err < 1e-6, err  # float32 sums of exact bfloat16 products


@needs_kernel
def test_grouped_mm_bfloat16_forward_runs_the_row_kernel(monkeypatch):
    """bfloat16 at few rows per expert: the forward's matmuls are the row kernel's custom calls (none in float32,
    none with MOE_JAX_ROW_KERNEL=off), and the forward and every gradient match the float64 reference, as they do
    with it off."""
    arrays, dy = random_case(21, T=40, H=96, I=48, E=4, k=2, bias=True, empty_fraction=0.1)
    kw = dict(activation="silu", gate_up_bias=arrays["gate_up_bias"], down_bias=arrays["down_bias"])
    args = [arrays[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")]
    expected = reference.experts_backward(*args, dy, **kw) | {"out": reference.experts_forward(*args, **kw)}
    assert expert_loop.uses_row_kernel(40 * 2, 4, *(jnp.zeros(1, jnp.bfloat16),) * 3)

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
        # gate/up and down in each loop over an expert's blocks (its first block, the further ones)
        assert calls == (4 if runs else 0), (setting, dtype, calls)
        name = jnp.dtype(dtype).name
        assert_close("out", np.asarray(out, np.float64), expected["out"], name)
        for n, g in grads.items():
            assert_close(f"grad_{n}", np.asarray(g, np.float64), expected[n], name)


def test_row_kernel_says_why_it_cannot_run(fresh_state, monkeypatch, tmp_path):
    monkeypatch.setattr(expert_rows, "cpu_flags", lambda: frozenset({"avx512f"}))
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
    monkeypatch.setattr(expert_rows, "cpu_flags", lambda: frozenset(expert_rows.CPU_FLAGS))
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
    monkeypatch.setattr(expert_rows, "cpu_flags", lambda: frozenset(expert_rows.CPU_FLAGS))
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
