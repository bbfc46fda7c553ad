"""The sorted formulation shared by grouped_mm and ragged_dot: slots sorted by expert, then per platform either one
grouped matmul per projection (``grouped_matmul`` with a per-platform kernel table), results gathered back to slot
order, or a kernel that runs the whole expert MLP over the sorted rows (``expert_loop``)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import jax.numpy as jnp
from jax import lax

from .base import Slots, combine, gate, gather_rows
from .expert_loop import experts_mlp
from .grouped_matmul import JAX_PLATFORMS, grouped_matmul, platform_present

MLP_KERNELS = {"expert_loop": experts_mlp}  # kernels of the whole expert MLP (gate/up, activation, down, combine)


def _with_zero_row(a):
    return jnp.concatenate([a, jnp.zeros((1, a.shape[1]), a.dtype)])


def _grouped(hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, order, sorted_ids,
             group_sizes, *, slots: Slots, activation, kernels: Mapping[str, str]):
    E, H, I = down_proj.shape
    # Empty slots sort last (id E), past every group. They gather an appended zero token row (index T) and zero
    # bias rows (index E), so whatever a kernel leaves in their rows only reaches the appended rows' gradients,
    # which are dropped; the combine zeroes their outputs exactly.
    token = jnp.where(sorted_ids < E, order // slots.k, slots.T)
    x = _with_zero_row(hidden_states.astype(gate_up_proj.dtype))[token]
    h = grouped_matmul(x, gate_up_proj, group_sizes, kernels=kernels)
    if gate_up_bias is not None:
        h = h + gather_rows(_with_zero_row(gate_up_bias), sorted_ids)
    y = grouped_matmul(gate(activation, h, I), down_proj, group_sizes, kernels=kernels)
    if down_bias is not None:
        y = y + gather_rows(_with_zero_row(down_bias), sorted_ids)
    restore = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return combine(y[restore], slots, top_k_weights, hidden_states.dtype)


def _whole_mlp(hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, order, sorted_ids,
               group_sizes, *, slots: Slots, activation, kernel):
    weights = jnp.where(slots.valid, top_k_weights.reshape(-1).astype(jnp.float32), 0.0)[order]
    out = kernel(hidden_states.astype(gate_up_proj.dtype), weights, order, group_sizes, gate_up_proj, down_proj,
                 gate_up_bias, down_bias, activation=activation, k=slots.k)
    return out.astype(hidden_states.dtype)


def sorted_experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                           activation, gate_up_bias, down_bias, kernels: Mapping[str, str]):
    E = down_proj.shape[0]
    slots = Slots(top_k_index, E)
    key = jnp.where(slots.valid, slots.ids, E)
    order = jnp.argsort(key, stable=True)
    sorted_ids = key[order]
    group_sizes = jnp.zeros(E, jnp.int32).at[key].add(1, mode="drop")
    args = (hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, order, sorted_ids,
            group_sizes)
    grouped = partial(_grouped, slots=slots, activation=activation, kernels=kernels)
    whole = {JAX_PLATFORMS[dc]: partial(_whole_mlp, slots=slots, activation=activation, kernel=MLP_KERNELS[name])
             for dc, name in kernels.items()
             if name in MLP_KERNELS and dc != "default" and platform_present(JAX_PLATFORMS[dc])}
    if not whole:
        return grouped(*args)
    return lax.platform_dependent(*args, default=grouped, **whole)
