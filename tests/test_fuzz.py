"""Property-based fuzzing of every CPU backend in both frameworks against the float64 reference (issue 13).

Hypothesis draws a problem: T in 0..24, H in 1..24, I in 1..16, E in 1..8, k in 1..min(E, 4); the dtypes of the
weights, of hidden_states and of top_k_weights (mixed ones too) and of the ids; a named activation or a custom gate
callable (for the backends whose spec takes callables); biases; routing (uniform, one expert in every token, idle
experts, repeated ids, a fraction of -1 slots up to all, out-of-range ids); strided torch inputs (a step of 2, or
transposed storage; JAX arrays have no strides). Each backend's forward and every gradient must be within the spec
tolerance (relative L2) of the float64 reference on the inputs as rounded to their dtypes; out-of-range ids must
raise a ValueError naming top_k_index where they are checked (validate=True, and by default on CPU) and count as
empty slots where not (validate=False). Every JAX backend runs as it is used (under jax.jit if it is jittable), and
the same draws go through torch's backend of the same name, checked against JAX as well.

A result that is a sum which cancels (H = 1, a few tokens of mixed signs) has no relative accuracy in bfloat16 for
any backend; where the tolerance is missed, a result is still accepted within NOISE_FACTOR times the rounding noise
the reference shows under roundings at the backends' rounding points. A wrong result is off by about its own norm.

The examples are the same on every run (derandomize, no database). JAX compiles every new shape (about a second
per example and backend, three for eager), so it gets fewer examples than torch: the file runs in about a minute on
two cores. ``triton`` runs on CUDA only, or under the Triton interpreter, which executes each program on the host:
its kernels get a few draws there (``TRITON_EXAMPLES``) through the torch binding, besides tests/test_triton.py's
fixed cases. torch ``batched_mm``'s CUDA way (per-slot cuBLAS pointer arrays) gets draws of its own on the CPU
through a stand-in for cuBLAS (``SLOT_EXAMPLES``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import moe_jax
import moe_torch
from moe_shared import reference, relative_l2
from support import DIFF_ARGS, SPEC

ARGS = ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")
NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
JAX_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _cpu_backends(available: dict[str, str | None]) -> list[str]:
    return [n for n, why in available.items() if why is None and n != "triton"]


TORCH_BACKENDS = _cpu_backends(moe_torch.available_backends("cpu"))
JAX_BACKENDS = _cpu_backends(moe_jax.available_backends("cpu"))
TORCH_EXAMPLES, JAX_EXAMPLES, TRITON_EXAMPLES, SLOT_EXAMPLES = 100, 6, 40, 40
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
NOISE_FACTOR = 4
REGISTRIES = {"torch": moe_torch.ExpertsInterface, "jax": moe_jax.BACKENDS}


def _takes_callables(framework: str, backend: str) -> bool:
    capability = REGISTRIES[framework].capability(backend)
    return capability is None or capability.activations is None


# --- gates: the callable per framework and float64 NumPy forward and vjp; a slot-wise float64 reference ---------

_np_silu, _np_silu_grad = reference.ACTIVATIONS["silu"]  # the float64 reference's own silu and its derivative


def _torch_interleaved_swiglu(a):
    return torch.nn.functional.silu(a[:, 0::2]) * a[:, 1::2]


def _jax_interleaved_swiglu(a):
    return jax.nn.silu(a[:, 0::2]) * a[:, 1::2]


def _np_interleaved_swiglu_vjp(a, dh):
    g, u = a[:, 0::2], a[:, 1::2]
    da = np.empty_like(a)
    da[:, 0::2] = dh * u * _np_silu_grad(g)
    da[:, 1::2] = dh * _np_silu(g)
    return da


@dataclass(frozen=True)
class Gate:
    """Maps the first projection [S, width * I] to [S, I]: the torch and JAX activations, NumPy forward and vjp."""

    width: int
    torch_fn: object
    jax_fn: object
    forward: object
    vjp: object


def _named_gate(name: str) -> Gate:
    act, act_grad = reference.ACTIVATIONS[name]

    def forward(a):
        g, u = np.split(a, 2, axis=1)
        return act(g) * u

    def vjp(a, dh):
        g, u = np.split(a, 2, axis=1)
        return np.concatenate([dh * u * act_grad(g), dh * act(g)], axis=1)

    return Gate(2, name, name, forward, vjp)


NAMED_GATES = {name: _named_gate(name) for name in SPEC.activations}
# custom gate callables; gates whose backward works from their rounded output (tanh, sigmoid) are left out: in
# bfloat16 their own gradient loses digits, whatever the backend does
CUSTOM_GATES = {
    "ungated_silu": Gate(1, torch.nn.functional.silu, jax.nn.silu, _np_silu, lambda a, dh: dh * _np_silu_grad(a)),
    "interleaved_swiglu": Gate(2, _torch_interleaved_swiglu, _jax_interleaved_swiglu,
                               lambda a: _np_silu(a[:, 0::2]) * a[:, 1::2], _np_interleaved_swiglu_vjp),
}


def slot_reference(arrays: dict, grad_output, gate: Gate, jitter=None) -> dict[str, np.ndarray]:
    """Float64 forward ("out") and gradients, slot by slot; ids outside [0, E) are empty. ``jitter`` (an array ->
    array function) is applied to every input, intermediate and result: where the backends round."""
    jitter = jitter or (lambda v: v)
    f = {n: jitter(np.asarray(a, dtype=np.float64)) for n, a in arrays.items() if n != "top_k_index"}
    x, w, gate_up, down = f["hidden_states"], f["top_k_weights"], f["gate_up_proj"], f["down_proj"]
    b1, b2 = f.get("gate_up_bias"), f.get("down_bias")
    idx = np.asarray(arrays["top_k_index"]).astype(np.int64).reshape(-1)
    k = np.asarray(arrays["top_k_index"]).shape[1]
    pos = np.nonzero((idx >= 0) & (idx < gate_up.shape[0]))[0]
    tok, e, ws = pos // k, idx[pos], w.reshape(-1)[pos]
    xs = x[tok]
    a = jitter(np.einsum("snh,sh->sn", gate_up[e], xs) + (0.0 if b1 is None else b1[e]))
    h = jitter(gate.forward(a))
    y = jitter(np.einsum("shi,si->sh", down[e], h) + (0.0 if b2 is None else b2[e]))
    out = np.zeros_like(x)
    np.add.at(out, tok, ws[:, None] * y)
    dy = jitter(np.asarray(grad_output, dtype=np.float64))[tok]
    grads = {n: np.zeros_like(v) for n, v in f.items()}
    grads["top_k_weights"].reshape(-1)[pos] = np.sum(dy * y, axis=1)
    dys = jitter(ws[:, None] * dy)
    np.add.at(grads["down_proj"], e, dys[:, :, None] * h[:, None, :])
    da = jitter(gate.vjp(a, jitter(np.einsum("shi,sh->si", down[e], dys))))
    np.add.at(grads["gate_up_proj"], e, da[:, :, None] * xs[:, None, :])
    np.add.at(grads["hidden_states"], tok, np.einsum("snh,sn->sh", gate_up[e], da))
    if b1 is not None:
        np.add.at(grads["gate_up_bias"], e, da)
    if b2 is not None:
        np.add.at(grads["down_bias"], e, dys)
    return {n: jitter(v) for n, v in ({"out": out} | grads).items()}


# --- the problem and its strategy -------------------------------------------------------------------------------

@dataclass
class Problem:
    """A drawn problem: its parameters and its inputs rounded to their dtypes (held in float64)."""

    params: dict
    arrays: dict[str, np.ndarray]
    grad_output: np.ndarray

    @property
    def E(self) -> int:
        return self.params["E"]

    @property
    def activation(self) -> str:
        return self.params["activation"]

    @property
    def tolerance(self) -> float:
        return max(SPEC.tolerance_for(self.params[n]) for n in ("weights", "hidden_states", "top_k_weights"))

    @property
    def has_bad_ids(self) -> bool:
        idx = self.arrays["top_k_index"]
        return bool(((idx < -1) | (idx >= self.E)).any())

    def dtype_of(self, name: str) -> str:
        return self.params.get(name, self.params["weights"])

    @property
    def gate(self) -> Gate:
        return CUSTOM_GATES.get(self.activation) or NAMED_GATES[self.activation]

    def activation_for(self, framework: str):
        return self.gate.torch_fn if framework == "torch" else self.gate.jax_fn

    @functools.cached_property
    def expected(self) -> dict[str, np.ndarray]:
        """moe_shared's float64 reference (slot_reference for custom gates), with every id outside [-1, E) an empty
        slot: what an unchecked call computes."""
        idx = self.arrays["top_k_index"]
        arrays = self.arrays | {"top_k_index": np.where((idx >= -1) & (idx < self.E), idx, -1)}
        if self.activation in CUSTOM_GATES:
            return slot_reference(arrays, self.grad_output, self.gate)
        kw = dict(activation=self.activation, gate_up_bias=arrays.get("gate_up_bias"),
                  down_bias=arrays.get("down_bias"))
        args = [arrays[n] for n in ARGS]
        return ({"out": reference.experts_forward(*args, **kw)}
                | reference.experts_backward(*args, self.grad_output, **kw))

    @functools.cached_property
    def rounding_noise(self) -> dict[str, float]:
        """How far (L2) each result of slot_reference moves when every input, intermediate and result is rounded
        with a relative error of the unit roundoff of the problem's least precise dtype (random signs; the larger
        of three draws): the error expected of a correct backend, large where a result is a sum that cancels."""
        rng = np.random.default_rng(0)
        u = max(UNIT_ROUNDOFF[self.params[n]] for n in ("weights", "hidden_states", "top_k_weights"))
        exact = slot_reference(self.arrays, self.grad_output, self.gate)
        noise = dict.fromkeys(exact, 0.0)
        for _ in range(3):
            moved = slot_reference(self.arrays, self.grad_output, self.gate,
                                   jitter=lambda v: v * (1.0 + u * rng.choice([-1.0, 1.0], v.shape)))
            for name in noise:
                noise[name] = max(noise[name], float(np.linalg.norm((moved[name] - exact[name]).ravel())))
        return noise


def _round(a: np.ndarray, dtype: str) -> np.ndarray:
    return a.astype(NUMPY_DTYPES[dtype]).astype(np.float64)


def _routing(rng: np.random.Generator, kind: str, T: int, E: int, k: int) -> np.ndarray:
    order = np.argsort(rng.random((T, E)), axis=1)
    if kind == "uniform":
        return order[:, :k]
    if kind == "repeats":
        return rng.integers(0, E, (T, k))
    if kind == "skewed":  # one expert in every token's slots, at a random position
        hot = int(rng.integers(E))
        rest = np.array([row[row != hot] for row in order]).reshape(T, E - 1)[:, : k - 1]
        idx = np.concatenate([np.full((T, 1), hot), rest], axis=1)
        return np.take_along_axis(idx, np.argsort(rng.random((T, k)), axis=1), axis=1)
    used = rng.permutation(E)[: int(rng.integers(k, E + 1))]  # "idle": the other experts get nothing
    return np.stack([rng.permutation(used)[:k] for _ in range(T)]) if T else np.zeros((0, k), np.int64)


def build_problem(params: dict) -> Problem:
    """The inputs of ``params`` (a draw of ``problem_params``), from its seed."""
    p = params
    T, H, I, E, k = (p[n] for n in "THIEk")
    rng = np.random.default_rng(p["seed"])
    idx = _routing(rng, p["routing"], T, E, k).astype(np.int64)
    if p["empty_fraction"]:
        idx[rng.random((T, k)) < p["empty_fraction"]] = -1
    if p["bad_ids"] and T:
        bad = rng.random((T, k)) < 0.3
        bad[rng.integers(T), rng.integers(k)] = True
        idx[bad] = rng.choice([E, E + 1, 2 * E + 5, -2, -E - 3], size=int(bad.sum()))
    N = (CUSTOM_GATES.get(p["activation"]) or NAMED_GATES[p["activation"]]).width * I
    logits = rng.standard_normal((T, k))
    arrays = {
        "hidden_states": _round(rng.standard_normal((T, H)), p["hidden_states"]),
        "top_k_index": idx.astype(p["index_dtype"]),
        "top_k_weights": _round(np.exp(logits) / np.exp(logits).sum(1, keepdims=True), p["top_k_weights"]),
        "gate_up_proj": _round(rng.standard_normal((E, N, H)) / np.sqrt(H), p["weights"]),
        "down_proj": _round(rng.standard_normal((E, H, I)) / np.sqrt(I), p["weights"]),
    }
    if p["bias"]:
        arrays["gate_up_bias"] = _round(0.1 * rng.standard_normal((E, N)), p["weights"])
        arrays["down_bias"] = _round(0.1 * rng.standard_normal((E, H)), p["weights"])
    return Problem(params, arrays, _round(rng.standard_normal((T, H)), p["hidden_states"]))


@st.composite
def problem_params(draw) -> dict:
    """The parameters of a problem; its arrays come from ``seed`` (``build_problem``)."""
    E = draw(st.integers(1, 8))
    weights = draw(st.sampled_from(list(NUMPY_DTYPES)))
    per_token = st.sampled_from(list(NUMPY_DTYPES)) if draw(st.booleans()) else st.just(weights)  # mixed dtypes
    return dict(
        T=draw(st.integers(0, 24)), H=draw(st.integers(1, 24)), I=draw(st.integers(1, 16)), E=E,
        k=draw(st.integers(1, min(E, 4))),
        weights=weights, hidden_states=draw(per_token), top_k_weights=draw(per_token),
        index_dtype=draw(st.sampled_from(["int32", "int64"])),
        activation=draw(st.sampled_from(list(NAMED_GATES) + list(CUSTOM_GATES))), bias=draw(st.booleans()),
        routing=draw(st.sampled_from(["uniform", "skewed", "idle", "repeats"])),
        empty_fraction=draw(st.sampled_from([0.0, 0.0, 0.25, 0.25, 0.5, 1.0])), bad_ids=draw(st.booleans()),
        layout=draw(st.sampled_from(["contiguous", "step", "transposed"])), seed=draw(st.integers(0, 2**32 - 1)),
    )


def fuzz(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _params(**changes) -> dict:
    """A regression example: a float32 silu problem with ``changes``."""
    return dict(T=0, H=1, I=1, E=1, k=1, weights="float32", hidden_states="float32", top_k_weights="float32",
                index_dtype="int32", activation="silu", bias=False, routing="uniform", empty_fraction=0.0,
                bad_ids=False, layout="contiguous", seed=0) | changes


def check_close(problem: Problem, actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], who: str) -> None:
    """Each result within the spec tolerance (relative L2) of ``expected``, or within NOISE_FACTOR times its
    rounding noise (see the module docstring)."""
    assert set(actual) == {"out"} | {n for n in DIFF_ARGS if n in problem.arrays}, (who, sorted(actual))
    tol = problem.tolerance
    for name, value in actual.items():
        assert value.shape == expected[name].shape, (who, name, value.shape)
        err = relative_l2(value, expected[name])
        if err <= tol:
            continue
        diff = float(np.linalg.norm((value - expected[name]).ravel()))
        assert diff <= NOISE_FACTOR * problem.rounding_noise[name], (
            f"{who}: {name} relative L2 error {err:.3e} > {tol:.0e}, and its L2 error {diff:.3e} > "
            f"{NOISE_FACTOR} x its rounding noise {problem.rounding_noise[name]:.3e}")


def _id_error(problem: Problem) -> str:
    return rf"top_k_index: expected expert ids in \[-1, {problem.E}\)"


# --- torch ------------------------------------------------------------------------------------------------------

def _torch_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "step":  # a view with a step of 2 on every axis into a larger buffer
        big = torch.zeros(tuple(2 * s + 1 for s in t.shape), dtype=t.dtype)
        view = big[tuple(slice(1, None, 2) for _ in t.shape)]
        view.copy_(t)
        return view
    if layout == "transposed" and t.dim() >= 2:
        return t.mT.contiguous().mT
    return t


def torch_inputs(problem: Problem) -> dict[str, torch.Tensor]:
    out = {}
    for name, a in problem.arrays.items():
        t = torch.from_numpy(np.ascontiguousarray(a))
        if name != "top_k_index":
            t = t.to(TORCH_DTYPES[problem.dtype_of(name)])
        out[name] = _torch_layout(t, problem.params["layout"]).requires_grad_(name != "top_k_index")
    return out


def torch_results(problem: Problem, backend: str, forward=None) -> dict[str, np.ndarray]:
    """Forward and every gradient, ids unchecked (validate=False); ``forward``: a backend module's function called
    directly instead (it checks no ids)."""
    tensors = torch_inputs(problem)
    if forward is None:
        forward = partial(moe_torch.experts_forward, implementation=backend, validate=False)
    out = forward(**tensors, activation=problem.activation_for("torch"))
    assert out.dtype == TORCH_DTYPES[problem.params["hidden_states"]] and out.shape == problem.grad_output.shape
    out.backward(torch.from_numpy(problem.grad_output).to(out.dtype))
    results = {"out": out.detach().double().numpy()}
    for name, t in tensors.items():
        if name in DIFF_ARGS:
            assert t.grad is None or t.grad.dtype == t.dtype, (name, t.grad.dtype)
            results[name] = np.zeros(t.shape) if t.grad is None else t.grad.double().numpy()
    return results


def check_ids(problem: Problem, framework: str, backend: str) -> None:
    """Out-of-range ids raise when checked: with validate=True and by default (host-visible CPU inputs)."""
    module, inputs = {"torch": (moe_torch, torch_inputs), "jax": (moe_jax, jax_inputs)}[framework]
    for validate in (True, None):
        with pytest.raises(ValueError, match=_id_error(problem)):
            module.experts_forward(**inputs(problem), implementation=backend,
                                   activation=problem.activation_for(framework), validate=validate)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@fuzz(TORCH_EXAMPLES)
@given(params=problem_params())
# torch grouped_mm ran F.grouped_mm on the down projection (K = I aligned) with unaligned output rows (N = H), which
# its backward cannot take: "RuntimeError: strides should be multiple of 16 bytes"
@example(params=_params(T=0, H=1, I=4))
@example(params=_params(T=5, H=18, I=8, E=3, k=2, bias=True))
@example(params=_params(T=5, H=12, I=8, E=3, k=2, weights="bfloat16", hidden_states="bfloat16",
                        top_k_weights="bfloat16"))
def test_torch_backend_matches_the_reference(backend, params):
    problem = build_problem(params)
    if problem.activation in CUSTOM_GATES and not _takes_callables("torch", backend):
        return
    if problem.has_bad_ids:
        check_ids(problem, "torch", backend)
    check_close(problem, torch_results(problem, backend), problem.expected, f"torch {backend}")


@fuzz(TRITON_EXAMPLES)
@given(params=problem_params())
@example(params=_params(T=0, H=3, I=5, E=2, k=2, bias=True))
# the torch binding passed strided hidden_states to the kernels, which read rows of H (a wrong result), and gave the
# plan a bias's own row stride while handing the kernels a contiguous copy of it
@example(params=_params(T=9, H=20, I=12, E=5, k=3, weights="bfloat16", hidden_states="float32", routing="idle",
                        empty_fraction=0.25, bad_ids=True, layout="transposed"))
@example(params=_params(T=6, H=16, I=8, E=3, k=2, bias=True, layout="transposed"))
@example(params=_params(T=6, H=16, I=8, E=3, k=2, bias=True, layout="step"))
def test_triton_kernels_match_the_reference(params):
    """The shared Triton kernels under the interpreter, through the torch binding's module function, on the same
    draws (a few: the interpreter runs each program on the host): forward and every gradient; out-of-range ids are
    empty slots there (the module function checks none). Named activations only (the kernels take no callables)."""
    import triton_interpreter  # noqa: F401  (the GPU's bfloat16 dot and rounding)
    from moe_torch.backends import triton as triton_backend
    problem = build_problem(params)
    if problem.activation in CUSTOM_GATES:
        return
    check_close(problem, torch_results(problem, "triton", forward=triton_backend.experts_forward),
                problem.expected, "torch triton (interpreter)")


@fuzz(TRITON_EXAMPLES // 2)
@given(params=problem_params())
@example(params=_params(T=7, H=12, I=8, E=3, k=2, weights="bfloat16", hidden_states="float32", bias=True,
                        empty_fraction=0.25))
def test_triton_kernels_give_torch_and_jax_the_same_bits(params):
    """The same draws through the JAX binding (jitted, its kernels under the interpreter): the same kernels with
    the same configs as torch's, so the same bits, forward and every gradient."""
    import triton_interpreter
    from moe_jax.backends import triton as jax_triton
    from moe_torch.backends import triton as torch_triton
    problem = build_problem(params)
    if problem.activation in CUSTOM_GATES:
        return
    want = torch_results(problem, "triton", forward=torch_triton.experts_forward)
    arrays = jax_inputs(problem)
    diff = {n: a for n, a in arrays.items() if n in DIFF_ARGS}

    def f(d):
        return jax_triton.experts_forward(**(arrays | d), activation=problem.activation_for("jax"))

    with jax_triton.use_launcher(triton_interpreter.jax_interpreter_launch):
        out, vjp = jax.vjp(jax.jit(f), diff)
        grads = jax.jit(vjp)(jnp.asarray(problem.grad_output).astype(out.dtype))[0]
    got = {n: np.asarray(v.astype(jnp.float32), np.float64) for n, v in ({"out": out} | grads).items()}
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@fuzz(SLOT_EXAMPLES)
@given(params=problem_params())
@example(params=_params(T=6, H=16, I=8, E=3, k=2, bias=True, layout="transposed", empty_fraction=0.25))
def test_batched_mm_slot_products_match_the_reference(params):
    """torch ``batched_mm`` with its CUDA way, the per-slot products on cuBLAS pointer arrays (moe_torch.slot_blas),
    here through test_slot_blas's stand-in for cublasGemmBatchedEx, which reads and writes the memory the pointers
    name; H and I rounded up to multiples of 8 so the addresses are aligned and the way applies (except to strided
    rows), the batch entries in expert order from two slots on (ORDERED_FROM_SLOTS_PER_EXPERT 0). Forward and every gradient."""
    from test_slot_blas import FakeGemmBatched
    from moe_torch import slot_blas
    from moe_torch.backends import batched_mm
    params = params | {"H": -(-params["H"] // 8) * 8, "I": -(-params["I"] // 8) * 8}
    problem = build_problem(params)
    gemm = FakeGemmBatched()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slot_blas, "DEVICES", ("cpu",))
        patch.setattr(slot_blas, "_gemm_batched", lambda: gemm)
        patch.setattr(slot_blas, "_blas_handle", lambda: 0)
        patch.setattr(slot_blas, "ORDERED_FROM_SLOTS_PER_EXPERT", 0)
        patch.setattr(batched_mm, "IN_PLACE_DEVICES", ())
        results = torch_results(problem, "batched_mm")
    check_close(problem, results, problem.expected, "torch batched_mm (slot products)")
    assert bool(gemm.calls) == (problem.params["T"] > 0 and params["layout"] != "step")


@fuzz(SLOT_EXAMPLES)
@given(params=problem_params())
@example(params=_params(T=0, H=8, I=8, E=3, k=2))
def test_grouped_mm_training_step_matches_the_reference(params):
    """torch ``grouped_mm`` with its CUDA way in training (one autograd node, ``moe_torch.training_step``; the
    weight gradients as K-grouped matmuls) here on the CPU: forward and every gradient; biases and gate callables
    keep the composed path."""
    from moe_torch import training_step
    from moe_torch.backends import grouped_mm
    problem = build_problem(params)
    if problem.activation in CUSTOM_GATES:
        return
    steps, apply = [], training_step.apply
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grouped_mm, "TRAINING_STEP_DEVICES", ("cpu",))
        patch.setattr(grouped_mm, "K_GROUPED_DEVICES", ("cpu",))
        patch.setattr(training_step, "apply", lambda *a: steps.append(1) or apply(*a))
        results = torch_results(problem, "grouped_mm")
    check_close(problem, results, problem.expected, "torch grouped_mm (training step)")
    assert len(steps) == (not params["bias"])


# --- JAX --------------------------------------------------------------------------------------------------------

def jax_inputs(problem: Problem) -> dict:
    return {n: jnp.asarray(a) if n == "top_k_index" else jnp.asarray(a).astype(JAX_DTYPES[problem.dtype_of(n)])
            for n, a in problem.arrays.items()}


def _jax_vjp(arrays: dict, grad_output, *, backend: str, activation):
    diff = {n: a for n, a in arrays.items() if n in DIFF_ARGS}

    def f(d):
        return moe_jax.experts_forward(**(arrays | d), implementation=backend, activation=activation, validate=False)

    out, vjp = jax.vjp(f, diff)
    return out, vjp(grad_output.astype(out.dtype))[0]


_jax_vjp_jit = jax.jit(_jax_vjp, static_argnames=("backend", "activation"))


def jax_results(problem: Problem, backend: str) -> dict[str, np.ndarray]:
    """Forward and every gradient, ids unchecked; jittable backends under jax.jit, as they run."""
    arrays = jax_inputs(problem)
    capability = moe_jax.BACKENDS.capability(backend)
    run = _jax_vjp_jit if capability is not None and capability.jit else _jax_vjp
    out, grads = run(arrays, jnp.asarray(problem.grad_output), backend=backend,
                     activation=problem.activation_for("jax"))
    assert out.dtype == JAX_DTYPES[problem.params["hidden_states"]] and out.shape == problem.grad_output.shape
    assert all(g.dtype == arrays[n].dtype for n, g in grads.items()), {n: g.dtype for n, g in grads.items()}
    return {n: np.asarray(v.astype(jnp.float32), np.float64) for n, v in ({"out": out} | grads).items()}


@pytest.mark.parametrize("backend", JAX_BACKENDS)
@fuzz(JAX_EXAMPLES)
@given(params=problem_params())
def test_jax_backend_matches_the_reference_and_torch(backend, params):
    """Every JAX backend against the reference; where torch has a backend of that name, torch on the same draw
    against the reference and against JAX."""
    problem = build_problem(params)
    in_torch = backend in TORCH_BACKENDS
    frameworks = ("jax", "torch") if in_torch else ("jax",)
    if problem.activation in CUSTOM_GATES and not all(_takes_callables(fw, backend) for fw in frameworks):
        return
    if problem.has_bad_ids:
        check_ids(problem, "jax", backend)
    expected = problem.expected
    j = jax_results(problem, backend)
    check_close(problem, j, expected, f"jax {backend}")
    if in_torch:
        if problem.has_bad_ids:
            check_ids(problem, "torch", backend)
        t = torch_results(problem, backend)
        check_close(problem, t, expected, f"torch {backend}")
        check_close(problem, j, t, f"{backend}: jax vs torch")


# --- many slots per expert ---------------------------------------------------------------------------------------

# Found while fuzzing: batched_mm (torch and JAX) summed the weight and bias gradients over an expert's slots in the
# weights' dtype (the transpose of its per-slot gather), JAX grouped_mm and ragged_dot the bias gradients: in
# bfloat16, with 2048 slots on one expert, 2-3x the tolerance off. The gathers now sum their gradients in float32.
@pytest.mark.parametrize("framework, backend", [
    (fw, b) for fw, backends in (("torch", TORCH_BACKENDS), ("jax", JAX_BACKENDS)) for b in backends])
def test_bfloat16_gradients_of_an_expert_with_many_slots(framework, backend):
    """2048 slots on one expert: every gradient is a long sum, which must be done in float32."""
    problem = build_problem(_params(T=2048, H=16, I=8, bias=True, weights="bfloat16", hidden_states="bfloat16",
                                    top_k_weights="bfloat16", seed=1))
    results = (torch_results if framework == "torch" else jax_results)(problem, backend)
    check_close(problem, results, problem.expected, f"{framework} {backend}")


# --- the slot-wise reference itself ----------------------------------------------------------------------------

@pytest.mark.parametrize("activation", SPEC.activations)
def test_slot_reference_equals_the_shared_reference(activation):
    """slot_reference (the reference of the custom gates and of the rounding noise) is moe_shared's reference."""
    rng = np.random.default_rng(0)
    T, H, I, E, k = 9, 6, 4, 5, 3
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :k]
    idx[0, 1] = idx[4] = -1
    arrays = {"hidden_states": rng.standard_normal((T, H)), "top_k_index": idx,
              "top_k_weights": rng.random((T, k)), "gate_up_proj": rng.standard_normal((E, 2 * I, H)),
              "down_proj": rng.standard_normal((E, H, I)), "gate_up_bias": rng.standard_normal((E, 2 * I)),
              "down_bias": rng.standard_normal((E, H))}
    dy = rng.standard_normal((T, H))
    ours = slot_reference(arrays, dy, NAMED_GATES[activation])
    kw = dict(activation=activation, gate_up_bias=arrays["gate_up_bias"], down_bias=arrays["down_bias"])
    args = [arrays[n] for n in ARGS]
    theirs = {"out": reference.experts_forward(*args, **kw)} | reference.experts_backward(*args, dy, **kw)
    assert set(ours) == set(theirs)
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-12, atol=1e-12, err_msg=name)
