"""batched_mm: gather every slot's expert weights and run one torch.bmm per projection.

Fast for a handful of tokens (no sort, no host sync); memory grows as T*k copies of an expert's weights.
"""

from __future__ import annotations

import torch

from ..base import Slots, add_bias, combine, gate, gather_rows

NAME = "batched_mm"


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    E, H, I = down_proj.shape
    slots = Slots(top_k_index, E)
    x = hidden_states.to(gate_up_proj.dtype)[slots.token_of_slot()]
    h = torch.bmm(gather_rows(gate_up_proj, slots.safe_ids), x.unsqueeze(-1)).squeeze(-1)
    a = gate(activation, add_bias(h, gate_up_bias, slots.safe_ids), I)
    y = add_bias(torch.bmm(gather_rows(down_proj, slots.safe_ids), a.unsqueeze(-1)).squeeze(-1), down_bias,
                 slots.safe_ids)
    return combine(y, slots, top_k_weights, hidden_states.dtype)
