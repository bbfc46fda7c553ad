"""The sorted formulation shared by grouped_mm and ragged_dot: slots sorted by expert, one grouped matmul per
projection (``grouped_matmul`` with a per-platform kernel table), results gathered back to slot order."""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from .base import Slots, combine, gate, gather_rows
from .grouped_matmul import grouped_matmul


def _with_zero_row(a):
    return jnp.concatenate([a, jnp.zeros((1, a.shape[1]), a.dtype)])


def sorted_experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                           activation, gate_up_bias, down_bias, kernels: Mapping[str, str]):
    E, H, I = down_proj.shape
    slots = Slots(top_k_index, E)
    key = jnp.where(slots.valid, slots.ids, E)
    order = jnp.argsort(key, stable=True)
    sorted_ids = key[order]
    group_sizes = jnp.zeros(E, jnp.int32).at[key].add(1, mode="drop")

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
