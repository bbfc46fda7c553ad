"""The sorted formulation shared by grouped_mm and ragged_dot: slots sorted by expert, one grouped matmul per
projection (``grouped_matmul`` with a per-platform kernel table), results gathered back to slot order."""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from .base import Slots, combine, gate
from .grouped_matmul import grouped_matmul


def sorted_experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                           activation, gate_up_bias, down_bias, kernels: Mapping[str, str]):
    E, H, I = down_proj.shape
    slots = Slots(top_k_index, E)
    key = jnp.where(slots.valid, slots.ids, E)
    order = jnp.argsort(key, stable=True)
    sorted_ids = key[order]
    group_sizes = jnp.zeros(E, jnp.int32).at[key].add(1, mode="drop")
    live = (sorted_ids < E)[:, None]
    safe_ids = jnp.minimum(sorted_ids, E - 1)

    x = jnp.where(live, hidden_states.astype(gate_up_proj.dtype)[order // slots.k], 0)
    h = grouped_matmul(x, gate_up_proj, group_sizes, kernels=kernels)
    if gate_up_bias is not None:
        h = h + gate_up_bias[safe_ids]
    a = gate(activation, jnp.where(live, h, 0), I)
    y = grouped_matmul(a, down_proj, group_sizes, kernels=kernels)
    if down_bias is not None:
        y = y + down_bias[safe_ids]
    y = jnp.where(live, y, 0)
    restore = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return combine(y[restore], slots, top_k_weights, hidden_states.dtype)
