"""moe_jax: every backend against every shared vector (forward and gradients), jit, errors, Flax, conversion."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_jax
from moe_jax import BACKENDS, experts_forward
from moe_jax import convert, flax_moe
from moe_shared import reference, relative_l2
from moe_shared.spec import FrameworkSupport, Requirements
from support import (BAD_INPUT_IDS, BAD_INPUTS, CASES, DIFF_ARGS, SPEC, assert_close, case_id, cpu_backends,
                     good_arrays, random_case)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
BACKENDS_ = cpu_backends("jax")
JITTABLE = [b for b in BACKENDS_ if SPEC.backends[b].support("jax").jit]


def to_jax(arrays: dict, dtype: str) -> dict:
    return {n: jnp.asarray(a) if n == "top_k_index" else jnp.asarray(a).astype(DTYPES[dtype])
            for n, a in arrays.items()}


def forward_and_grads(arrays: dict, backend: str, activation="silu", grad_output=None, jit=False):
    names = [n for n in DIFF_ARGS if n in arrays]

    def f(*diff):
        return experts_forward(**(arrays | dict(zip(names, diff))), implementation=backend, activation=activation)

    if jit:
        f = jax.jit(f)
    if grad_output is None:
        return f(*(arrays[n] for n in names)), {}
    out, vjp = jax.vjp(f, *(arrays[n] for n in names))
    return out, dict(zip(names, vjp(grad_output)))


def test_registry_holds_the_spec_backends():
    assert set(SPEC.backend_names("jax")) <= set(BACKENDS)
    assert all(BACKENDS.capability(n) is SPEC.backends[n].support("jax") for n in SPEC.backend_names("jax"))
    torch_only = {n for n in SPEC.backend_names("torch") if "jax" not in SPEC.backends[n].frameworks}
    assert torch_only == {"deepgemm_megamoe"}  # the fused expert-parallel kernel has no JAX binding
    assert set(SPEC.backend_names("torch")) - torch_only <= set(BACKENDS)  # the same names as torch otherwise


def test_moe_jax_never_imports_torch():
    code = ("import sys, moe_jax, moe_jax.flax_moe, moe_jax.convert; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("backend", BACKENDS_)
def test_vectors_forward_and_gradients(backend, case):
    arrays = to_jax(case.inputs, case.dtype)
    dy = jnp.asarray(case.grad_output).astype(DTYPES[case.dtype])
    jit = backend in JITTABLE
    out, grads = forward_and_grads(arrays, backend, case.activation, dy, jit=jit)
    assert out.dtype == DTYPES[case.dtype] and out.shape == (case.T, case.H)
    assert_close("out", np.asarray(out.astype(jnp.float32)), case.expected["out"], case.dtype)
    for name, g in grads.items():
        assert_close(f"grad_{name}", np.asarray(g.astype(jnp.float32)), case.expected[f"grad_{name}"], case.dtype)


@pytest.mark.parametrize("backend", JITTABLE)
def test_jit_equals_op_by_op_and_grad_under_jit(backend):
    arrays = to_jax(random_case(7, T=12, H=16, I=8, E=4, k=2, bias=True, empty_fraction=0.2)[0], "float32")
    plain = experts_forward(**arrays, implementation=backend)
    jitted = jax.jit(lambda a: experts_forward(**a, implementation=backend))(arrays)
    np.testing.assert_allclose(jitted, plain, rtol=1e-6, atol=1e-6)
    loss = lambda a: jnp.sum(experts_forward(**a, implementation=backend) ** 2)
    diff = {n: v for n, v in arrays.items() if n != "top_k_index"}
    grads = jax.jit(jax.grad(lambda d: loss(d | {"top_k_index": arrays["top_k_index"]})))(diff)
    expected = jax.grad(lambda d: loss(d | {"top_k_index": arrays["top_k_index"]}))(diff)
    for n in diff:
        np.testing.assert_allclose(grads[n], expected[n], rtol=1e-5, atol=1e-5)


def test_eager_under_jit_names_the_jittable_backends():
    arrays = to_jax(good_arrays(), "float32")
    jittable = sorted(n for n in SPEC.backend_names("jax") if SPEC.backends[n].support("jax").jit)
    assert {"batched_mm", "grouped_mm", "ragged_dot"} <= set(jittable)
    with pytest.raises(ValueError, match=r"implementation 'eager' .* under jax.jit .* use one of "
                                         + re.escape(str(jittable))):
        jax.jit(lambda a: experts_forward(**a, implementation="eager"))(arrays)


def _programs(backend: str) -> tuple[str, str]:
    """(jaxpr, compiled HLO) of a jitted call on this machine."""
    arrays = to_jax(good_arrays(), "bfloat16")
    f = jax.jit(lambda a: experts_forward(**a, implementation=backend))
    return str(jax.make_jaxpr(f)(arrays)), f.lower(arrays).compile().as_text()


def test_grouped_mm_runs_the_expert_loop_on_cpu_and_ragged_dot_backend_runs_ragged_dot():
    assert SPEC.backends["grouped_mm"].support("jax").details["kernel"]["cpu"] == "expert_loop"
    grouped_jaxpr, grouped_hlo = _programs("grouped_mm")
    ragged_jaxpr, ragged_hlo = _programs("ragged_dot")
    assert "platform_index" in grouped_jaxpr  # both kernels traced, one kept per platform at lowering
    assert " while(" in grouped_hlo  # the expert loop was compiled for CPU
    assert "ragged_dot_general" in ragged_jaxpr and "platform_index" not in ragged_jaxpr
    assert " while(" not in ragged_hlo  # ragged_dot's CPU expansion is loop-free


def test_expert_loop_matmuls_contract_the_left_operands_last_dimension():
    """XLA:CPU runs a bfloat16 dot on YNNPACK only when its left operand contracts its last dimension; a left
    operand contracted over its rows (the weight gradients' natural form) runs on Eigen in float32, several
    times slower. Every dot of the compiled forward+backward has the fast form."""
    arrays, dy = random_case(5, T=96, H=64, I=32, E=4, k=2, bias=False)
    values = to_jax(arrays, "bfloat16")
    names = [n for n in DIFF_ARGS if n in values]

    def grads(diff, dy):
        f = lambda *d: experts_forward(**(values | dict(zip(names, d))), implementation="grouped_mm")
        return jax.vjp(f, *diff)[1](dy)

    diff = [values[n] for n in names]
    hlo = jax.jit(grads).lower(diff, jnp.asarray(dy, jnp.bfloat16)).compile().as_text()
    dots = re.findall(r" dot\([^\n]*", hlo)
    # two weight gradients per loop over blocks; without the row kernel also the forward's and the backward's
    # products through the weights
    assert len(dots) >= 6
    assert [d for d in dots if "lhs_contracting_dims={1}" not in d] == []


# T, E, k, one-row decode blocks: one-row blocks in the forward (at most 2 rows per expert on average; where the
# host has no AMX), the same routing in one block per expert (where it has), one block size (under 16), the ladder of
# sizes with one block per expert, and experts with more rows than the largest block (several blocks)
EXPERT_LOOP_PATHS = {"one-row": (6, 4, 1, True), "decode-blocks": (6, 4, 1, False), "one-size": (40, 4, 1, True),
                     "ladder": (60, 2, 2, True), "several-blocks": (700, 2, 1, True)}


@pytest.mark.parametrize("path", list(EXPERT_LOOP_PATHS))
def test_expert_loop_block_paths_match_the_reference(path, monkeypatch):
    """grouped_mm's CPU kernel through each way it splits an expert's rows into blocks, forward and every
    gradient in float32, biases and empty slots included."""
    from moe_jax import expert_loop
    T, E, k, one_row = EXPERT_LOOP_PATHS[path]
    monkeypatch.setattr(expert_loop, "one_row_decode", lambda: one_row)
    arrays, dy = random_case(len(path), T=T, H=16, I=8, E=E, k=k, bias=True, empty_fraction=0.1)
    sizes = expert_loop.block_sizes(T * k, E)
    assert {"one-row": sizes == (1,), "decode-blocks": sizes == (4,), "one-size": len(sizes) == 1 and sizes[0] > 1,
            "ladder": len(sizes) > 1 and T * k / E < expert_loop.MAX_BLOCK,
            "several-blocks": T * k / E > expert_loop.MAX_BLOCK}[path]
    values = to_jax(arrays, "float32")
    out, grads = forward_and_grads(values, "grouped_mm", grad_output=jnp.asarray(dy, jnp.float32), jit=True)
    kw = dict(activation="silu", gate_up_bias=arrays["gate_up_bias"], down_bias=arrays["down_bias"])
    args = [arrays[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")]
    expected = reference.experts_backward(*args, dy, **kw) | {"out": reference.experts_forward(*args, **kw)}
    assert_close("out", np.asarray(out), expected["out"], "float32")
    for name, g in grads.items():
        assert_close(f"grad_{name}", np.asarray(g), expected[name], "float32")


@pytest.mark.parametrize("transpose_w", [True, False])
def test_segment_loop_kernel_matches_ragged_dot(transpose_w):
    """The other CPU grouped-matmul kernel (selectable in the spec), forward and VJP, against ragged_dot, with idle
    groups; rows past the last group are not its (what it leaves there is dropped by the combine)."""
    from moe_jax.grouped_matmul import grouped_matmul
    rng = np.random.default_rng(13)
    sizes = jnp.asarray([5, 0, 19, 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((30, 24)), jnp.float32)  # 25 grouped rows, 5 past them
    w = jnp.asarray(rng.standard_normal((4, 12, 24) if transpose_w else (4, 24, 12)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((30, 12)), jnp.float32).at[25:].set(0)

    def run(kernel):
        f = lambda x, w: grouped_matmul(x, w, sizes, kernels={"default": kernel}, transpose_w=transpose_w)
        y, vjp = jax.vjp(jax.jit(f), x, w)
        return (y, *vjp(dy))

    ours, theirs = run("segment_loop"), run("ragged_dot")
    for got, want, name in zip(ours, theirs, ("y", "dx", "dw")):
        rows = slice(None) if name == "dw" else slice(25)
        np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("arg, reshape, dtype, pattern", BAD_INPUTS, ids=BAD_INPUT_IDS)
@pytest.mark.parametrize("backend", BACKENDS_)
def test_bad_inputs_name_the_argument(backend, arg, reshape, dtype, pattern):
    arrays = good_arrays()
    values = to_jax(arrays | {arg: reshape(arrays[arg])}, "float32")
    if dtype:
        values[arg] = values[arg].astype(dtype)
    with pytest.raises(ValueError, match=pattern):
        experts_forward(**values, implementation=backend)
    if backend in JITTABLE:  # shapes and dtypes are checked at trace time too
        with pytest.raises(ValueError, match=pattern):
            jax.jit(lambda v: experts_forward(**v, implementation=backend))(values)


def test_bad_array_type_and_unknown_names():
    values = to_jax(good_arrays(), "float32")
    with pytest.raises(ValueError, match="hidden_states: expected a jax.Array, got list"):
        experts_forward(**values | {"hidden_states": [[1.0]]})
    with pytest.raises(ValueError, match=r"implementation: expected one of the registered jax backends \['batched_mm', "
                                         r"'deepgemm', 'eager', 'grouped_mm', 'ragged_dot'.*got 'fast'"):
        experts_forward(**values, implementation="fast")
    with pytest.raises(ValueError, match=r"activation: expected one of \['silu', 'gelu', 'relu'\]"):
        experts_forward(**values, activation="tanh")


@pytest.mark.parametrize("bad_id", [3, 9, -2])
@pytest.mark.parametrize("backend", BACKENDS_)
def test_out_of_range_ids(backend, bad_id):
    arrays = good_arrays()
    arrays["top_k_index"][1, 0] = bad_id
    values = to_jax(arrays, "float32")
    with pytest.raises(ValueError, match=r"top_k_index: expected expert ids in \[-1, 3\)"):
        experts_forward(**values, implementation=backend)
    out = experts_forward(**values, implementation=backend, validate=False)
    arrays["top_k_index"][1, 0] = -1
    np.testing.assert_array_equal(out, experts_forward(**to_jax(arrays, "float32"), implementation=backend))
    if backend in JITTABLE:  # under jit nothing is checked and nothing reads out of bounds
        values["top_k_index"] = values["top_k_index"].at[1, 0].set(bad_id)
        jitted = jax.jit(lambda v: experts_forward(**v, implementation=backend))(values)
        np.testing.assert_allclose(jitted, out, rtol=1e-6, atol=1e-6)
        with pytest.raises(ValueError, match="validate: expected concrete top_k_index"):
            jax.jit(lambda v: experts_forward(**v, implementation=backend, validate=True))(values)


def test_requirements_are_errors_not_fallbacks():
    fn = lambda *a, **kw: pytest.fail("a backend with unmet requirements ran")
    base = FrameworkSupport("jax", ("cpu",), ("float32",), (), Requirements())
    try:
        moe_jax.register("needs_pkg", fn, capability=dataclasses.replace(
            base, requires=Requirements(packages={"surely_not_installed_pkg": "gpu-kernels"})))
        moe_jax.register("needs_gpu", fn, capability=dataclasses.replace(base, devices=("cuda",)))
        values = to_jax(good_arrays(), "float32")
        with pytest.raises(ImportError, match=r"pip install 'moe-experts\[gpu-kernels\]'"):
            experts_forward(**values, implementation="needs_pkg")
        with pytest.raises(RuntimeError, match=r"implementation 'needs_gpu' runs on \['cuda'\], got the cpu"):
            experts_forward(**values, implementation="needs_gpu")
        reasons = moe_jax.available_backends("cpu")
        assert reasons["grouped_mm"] is None and "cuda" in reasons["needs_gpu"]
    finally:
        BACKENDS.unregister("needs_pkg"), BACKENDS.unregister("needs_gpu")


@pytest.mark.parametrize("backend", BACKENDS_)
def test_custom_gate_callable(backend):
    arrays = random_case(3, T=6, H=8, I=4, E=3, k=2, bias=False)[0]
    arrays["gate_up_proj"] = arrays["gate_up_proj"][:, :4]  # an up projection only: N = I
    values = to_jax(arrays, "float32")
    out = experts_forward(**values, implementation=backend, activation=jnp.tanh)
    x, idx, w = arrays["hidden_states"], arrays["top_k_index"], arrays["top_k_weights"]
    expected = sum(w[:, j, None] * np.einsum("thi,ti->th", arrays["down_proj"][idx[:, j]],
                                               np.tanh(np.einsum("tih,th->ti", arrays["gate_up_proj"][idx[:, j]], x)))
                   for j in range(2))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


# --- the Flax NNX module -------------------------------------------------------------------------------------

def test_flax_experts_parameters_and_call():
    m = flax_moe.Experts(4, 8, 6, activation="gelu", bias=True, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    shapes = {k: v.get_value().shape for k, v in nnx.state(m, nnx.Param).flat_state()} if hasattr(
        nnx.state(m, nnx.Param), "flat_state") else None
    assert m.gate_up_proj.get_value().shape == (4, 12, 8) and m.down_proj.get_value().shape == (4, 8, 6)
    assert m.gate_up_bias.get_value().shape == (4, 12) and m.down_bias.get_value().shape == (4, 8)
    assert m.gate_up_proj.get_value().dtype == jnp.bfloat16
    assert float(jnp.abs(m.gate_up_proj.get_value().astype(jnp.float32)).max()) <= 8 ** -0.5
    values = to_jax(random_case(1, T=5, H=8, I=6, E=4, k=2, bias=False)[0], "bfloat16")
    x, idx, w = values["hidden_states"], values["top_k_index"], values["top_k_weights"]
    for backend in BACKENDS_:
        m.set_backend(backend)
        expected = experts_forward(x, idx, w, m.gate_up_proj.get_value(), m.down_proj.get_value(),
                                   activation="gelu", gate_up_bias=m.gate_up_bias.get_value(),
                                   down_bias=m.down_bias.get_value(), implementation=backend)
        np.testing.assert_array_equal(m(x, idx, w), expected)
    m.set_backend("grouped_mm")
    out = nnx.jit(lambda m, x, i, w: m(x, i, w))(m, x, idx, w)
    assert out.dtype == jnp.bfloat16
    grads = nnx.grad(lambda m: jnp.sum(m(x.astype(jnp.float32), idx, w).astype(jnp.float32) ** 2))(m)
    assert grads.gate_up_proj.get_value().shape == (4, 12, 8) if hasattr(grads, "gate_up_proj") else grads
    compute = flax_moe.Experts(4, 8, 6, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert compute(x.astype(jnp.float32), idx, w).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="implementation: expected one of the registered"):
        flax_moe.Experts(2, 4, 2, backend="fast", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_experts: expected a positive int, got 0"):
        flax_moe.Experts(0, 4, 2, rngs=nnx.Rngs(0))


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.text = nnx.List([flax_moe.Experts(2, 4, 2, rngs=rngs), flax_moe.Experts(2, 4, 2, rngs=rngs)])
        self.vision = flax_moe.Experts(2, 4, 2, backend="eager", rngs=rngs)


def test_flax_set_and_get_backend():
    model = _Model(nnx.Rngs(0))
    snapshot = flax_moe.get_backend(model)
    assert snapshot == {"": None, "text.0": "auto", "text.1": "auto", "vision": "eager"}  # "auto" by default
    flax_moe.set_backend(model, "batched_mm")
    assert set(flax_moe.get_backend(model).values()) == {"batched_mm"}
    flax_moe.set_backend(model, {"": "grouped_mm", "text.1": "auto"})
    assert flax_moe.get_backend(model) == {"": None, "text.0": "grouped_mm", "text.1": "auto",
                                           "vision": "grouped_mm"}
    flax_moe.set_backend(model, {"vision": "eager"})
    assert model.vision.backend == "eager" and model.text[0].backend == "grouped_mm"
    flax_moe.set_backend(model, snapshot)
    assert flax_moe.get_backend(model) == snapshot
    with pytest.raises(ValueError, match="implementation: expected one of the registered"):
        flax_moe.set_backend(model, {"text": "nope"})
    assert flax_moe.get_backend(model) == snapshot
    with pytest.raises(ValueError, match="key 'audio' names no experts module"):
        flax_moe.set_backend(model, {"audio": "eager"})
    with pytest.raises(ValueError, match="model: expected a module holding moe_jax.flax_moe.Experts"):
        flax_moe.set_backend(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "eager")


def test_auto_backend_follows_the_spec_threshold(monkeypatch):
    x, idx = jnp.ones((4, 8)), jnp.zeros((4, 2), jnp.int32)
    gate_up, down = jnp.zeros((3, 2 * 256, 512), jnp.bfloat16), jnp.zeros((3, 512, 256), jnp.bfloat16)  # 0.75 MiB
    assert SPEC.decode_threshold("jax", "cpu") == 0
    assert flax_moe.resolve_backend("auto", x, idx, gate_up, down) == "grouped_mm"  # on CPU grouped_mm at every size
    import moe_shared.switching as switching
    monkeypatch.setattr(switching, "_SPEC", dataclasses.replace(SPEC, decode_max_gathered_mib={"jax": {"cpu": 6}}))
    assert flax_moe.resolve_backend("auto", x, idx, gate_up, down) == "batched_mm"  # T*k = 8 slots gather 6 MiB
    assert flax_moe.resolve_backend("auto", jnp.ones((5, 8)), jnp.zeros((5, 2), jnp.int32), gate_up,
                                    down) == "grouped_mm"  # 7.5 MiB
    assert flax_moe.resolve_backend("auto", x, idx, gate_up.astype(jnp.float32),
                                    down.astype(jnp.float32)) == "grouped_mm"  # float32: 12 MiB
    assert flax_moe.resolve_backend("eager", x, idx, gate_up, down) == "eager"
    m = flax_moe.Experts(2, 8, 4, backend="auto", rngs=nnx.Rngs(0))
    jitted = nnx.jit(lambda m, x, i, w: m(x, i, w))
    np.testing.assert_allclose(jitted(m, x, idx, jnp.ones((4, 2))), m(x, idx, jnp.ones((4, 2))), rtol=1e-6)


# --- weight conversion ----------------------------------------------------------------------------------------

def test_conversion_layouts_round_trip():
    rng = np.random.default_rng(0)
    params = {"gate_up_proj": rng.standard_normal((3, 8, 5)), "down_proj": rng.standard_normal((3, 5, 4)),
              "gate_up_bias": rng.standard_normal((3, 8)), "down_bias": rng.standard_normal((3, 5))}
    for layout in ({}, {"is_transposed": True}, {"is_transposed": True, "interleaved": True}):
        for names in ("moe_torch", "transformers"):
            sd = convert.state_dict_from_params(params, names=names, **layout)
            back = convert.params_from_state_dict(sd, **layout)
            assert set(back) == set(params)
            for k in params:
                np.testing.assert_array_equal(back[k], params[k])
    sd = convert.state_dict_from_params(params, names="transformers", is_transposed=True, interleaved=True)
    assert sd["gate_up_proj"].shape == (3, 5, 8) and "gate_up_proj_bias" in sd
    np.testing.assert_array_equal(sd["gate_up_proj"][:, :, 0], params["gate_up_proj"][:, 0, :])  # gate row 0
    np.testing.assert_array_equal(sd["gate_up_proj"][:, :, 1], params["gate_up_proj"][:, 4, :])  # up row 0
    with pytest.raises(ValueError, match="state_dict: expected a key 'mlp.down_proj'"):
        convert.params_from_state_dict({"mlp.gate_up_proj": params["gate_up_proj"]}, prefix="mlp.")
    with pytest.raises(ValueError, match="names: expected one of"):
        convert.state_dict_from_params(params, names="hf")


def test_load_state_dict_into_flax_checks_shapes():
    m = flax_moe.Experts(3, 5, 4, bias=True, rngs=nnx.Rngs(0))
    sd = convert.module_state_dict(m)
    assert sorted(sd) == ["down_bias", "down_proj", "gate_up_bias", "gate_up_proj"]
    fresh = flax_moe.Experts(3, 5, 4, bias=True, rngs=nnx.Rngs(1))
    convert.load_state_dict(fresh, sd)
    np.testing.assert_array_equal(fresh.gate_up_proj.get_value(), m.gate_up_proj.get_value())
    with pytest.raises(ValueError, match=r"state_dict\['down_proj'\]: expected shape \(3, 5, 4\), got"):
        convert.load_state_dict(fresh, sd | {"down_proj": np.zeros((3, 5, 3))})
    with pytest.raises(ValueError, match="built with bias=False"):
        convert.load_state_dict(flax_moe.Experts(3, 5, 4, rngs=nnx.Rngs(0)), sd)
    with pytest.raises(ValueError, match="expected bias entries"):
        convert.load_state_dict(fresh, {k: sd[k] for k in ("gate_up_proj", "down_proj")})
    with pytest.raises(ValueError, match="gate_up_proj: expected a NumPy/JAX array or a DLPack tensor, got list"):
        convert.load_state_dict(fresh, sd | {"gate_up_proj": [[1.0]]})
