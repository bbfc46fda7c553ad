"""Helpers every JAX backend shares: argument description, platform, routing slots, gating and the combine."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from moe_shared import ArrayInfo

ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu,
    "gelu": partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
}
HIGHEST = lax.Precision.HIGHEST  # float32 matmuls stay float32 (no TF32), as in torch
_DEVICE_CLASSES = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "tpu": "tpu"}


def info(a) -> ArrayInfo | None:
    return None if a is None else ArrayInfo(tuple(a.shape), jnp.dtype(a.dtype).name)


def is_traced(a) -> bool:
    return isinstance(a, jax.core.Tracer)


def platform_of(a) -> str:
    """The platform of a concrete array; under a trace, the default backend's."""
    if not is_traced(a) and hasattr(a, "devices"):
        return next(iter(a.devices())).platform
    return jax.default_backend()


def device_class(platform: str) -> str:
    return _DEVICE_CLASSES.get(platform, platform)


def gate(activation: str | Callable, h, intermediate: int):
    """act(g) * u for [g; u] = h, or the custom gate callable applied to h."""
    if callable(activation):
        return activation(h)
    return ACTIVATIONS[activation](h[..., :intermediate]) * h[..., intermediate:]


def linear(x, w):
    """x [S, K] by w [S, N, K] per slot -> [S, N] (float32 accumulation, result in x's dtype)."""
    return jnp.einsum("sk,snk->sn", x, w, precision=HIGHEST, preferred_element_type=jnp.float32).astype(x.dtype)


class Slots:
    """The T*k routed slots, token-major. Ids outside [0, E) are empty: ``safe_ids`` maps them to expert 0 so no
    gather reads out of bounds, and ``valid`` masks them out of the result and every gradient."""

    def __init__(self, top_k_index, num_experts: int):
        self.T, self.k = top_k_index.shape
        self.ids = top_k_index.reshape(-1).astype(jnp.int32)
        self.valid = (self.ids >= 0) & (self.ids < num_experts)
        self.safe_ids = jnp.where(self.valid, self.ids, 0)
        self.num_experts = num_experts

    @property
    def count(self) -> int:
        return self.T * self.k

    def token_of_slot(self):
        return jnp.arange(self.count, dtype=jnp.int32) // self.k


def combine(y, slots: Slots, top_k_weights, out_dtype):
    """sum_j w[t, j] * y[t*k + j] in float32, empty slots exactly zero."""
    w = jnp.where(slots.valid, top_k_weights.reshape(-1).astype(jnp.float32), 0.0)
    y = jnp.where(slots.valid[:, None], y.astype(jnp.float32), 0.0)
    return (y * w[:, None]).reshape(slots.T, slots.k, y.shape[-1]).sum(axis=1).astype(out_dtype)


@jax.custom_vjp
def _gather_rows_f32_grad(table, index):
    return table[index]


def _gather_rows_fwd(table, index):
    return table[index], (table, index)


def _gather_rows_bwd(saved, grad):
    table, index = saved
    total = jnp.zeros(table.shape, jnp.float32).at[index].add(grad.astype(jnp.float32))
    return total.astype(table.dtype), None


_gather_rows_f32_grad.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def gather_rows(table, index):
    """``table[index]`` (rows); for a half-precision table the gradient sums each row's contributions in float32
    (the gather's own transpose adds them in the table's dtype: a long bfloat16 sum)."""
    if jnp.dtype(table.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return _gather_rows_f32_grad(table, index)
    return table[index]


def add_bias(h, bias, expert_ids):
    return h if bias is None else h + gather_rows(bias, expert_ids)
