"""batched_mm: gather every slot's expert weights and contract them per slot in one einsum per projection."""

from __future__ import annotations

from ..base import Slots, add_bias, combine, gate, gather_rows, linear

NAME = "batched_mm"


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    E, H, I = down_proj.shape
    slots = Slots(top_k_index, E)
    x = hidden_states.astype(gate_up_proj.dtype)[slots.token_of_slot()]
    h = add_bias(linear(x, gather_rows(gate_up_proj, slots.safe_ids)), gate_up_bias, slots.safe_ids)
    y = add_bias(linear(gate(activation, h, I), gather_rows(down_proj, slots.safe_ids)), down_bias, slots.safe_ids)
    return combine(y, slots, top_k_weights, hidden_states.dtype)
