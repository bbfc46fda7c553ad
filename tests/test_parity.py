"""Torch <-> JAX: the same random cases through both frameworks for every shared backend name, forward and
gradients; each framework against the float64 reference and against the other, with the shared tolerance."""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from moe_shared import reference, relative_l2
from support import SPEC, cpu_backends, random_case
from test_jax import forward_and_grads, to_jax
from test_torch import run, to_torch

SHARED = sorted(set(cpu_backends("torch")) & set(cpu_backends("jax")))
CASES = {
    "T0": dict(T=0, H=16, I=8, E=4, k=2, bias=True),
    "T1": dict(T=1, H=16, I=8, E=4, k=2, bias=False),
    "uniform-T33": dict(T=33, H=24, I=16, E=6, k=2, bias=True),
    "one-expert-T20": dict(T=20, H=16, I=8, E=5, k=3, bias=True, one_expert=True),
    "empty-slots-T17": dict(T=17, H=20, I=12, E=4, k=2, bias=True, empty_fraction=0.3),
    "kE-T9": dict(T=9, H=16, I=8, E=4, k=4, bias=False),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", SHARED)
def test_torch_and_jax_agree(backend, name, dtype):
    arrays, dy = random_case(zlib.crc32(name.encode()), **CASES[name])
    activation = "gelu" if "kE" in name else "silu"
    tensors = to_torch(arrays, dtype, requires_grad=True)
    t_out, t_grads = run(tensors, backend, activation, grad_output=to_torch({"g": dy}, dtype)["g"])
    values = to_jax(arrays, dtype)
    j_out, j_grads = forward_and_grads(values, backend, activation, jnp.asarray(dy).astype(values["hidden_states"].dtype),
                                       jit=backend != "eager")
    # both in the case dtype: compare against the reference computed on the rounded inputs
    rounded = {n: np.asarray(v.astype(jnp.float32)) if n != "top_k_index" else np.asarray(v)
               for n, v in values.items()}
    dy_rounded = np.asarray(jnp.asarray(dy).astype(values["hidden_states"].dtype).astype(jnp.float32))
    kw = dict(activation=activation, gate_up_bias=rounded.get("gate_up_bias"), down_bias=rounded.get("down_bias"))
    args = [rounded[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")]
    expected = {"out": reference.experts_forward(*args, **kw)}
    expected |= {n: g for n, g in reference.experts_backward(*args, dy_rounded, **kw).items()}
    tol = SPEC.tolerance_for(dtype)
    pairs = {"out": (t_out.detach().float().numpy(), np.asarray(j_out.astype(jnp.float32)))}
    pairs |= {n: (t_grads[n].float().numpy(), np.asarray(j_grads[n].astype(jnp.float32))) for n in t_grads}
    assert set(t_grads) == set(j_grads)
    for n, (t_val, j_val) in pairs.items():
        assert relative_l2(t_val, expected[n]) <= tol, (n, "torch")
        assert relative_l2(j_val, expected[n]) <= tol, (n, "jax")
        assert relative_l2(j_val, t_val) <= tol, (n, "torch vs jax")
