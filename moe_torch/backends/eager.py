"""eager: a Python loop over the experts that received tokens (a host sync; not fullgraph-compatible)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base import Slots, combine, gate

NAME = "eager"


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    E, H, I = down_proj.shape
    slots = Slots(top_k_index, E)
    x = hidden_states.to(gate_up_proj.dtype)
    hit_ids = torch.where(slots.valid, slots.ids, E)
    counts = torch.bincount(hit_ids, minlength=E + 1)[:E]
    positions, outputs = [], []
    for e in counts.nonzero().flatten().tolist():
        pos = (hit_ids == e).nonzero().flatten()
        h = F.linear(x[pos // slots.k], gate_up_proj[e], None if gate_up_bias is None else gate_up_bias[e])
        outputs.append(F.linear(gate(activation, h, I), down_proj[e], None if down_bias is None else down_bias[e]))
        positions.append(pos)
    y = x.new_zeros(slots.count, H)
    if positions:
        y = y.index_copy(0, torch.cat(positions), torch.cat(outputs))
    return combine(y, slots, top_k_weights, hidden_states.dtype)
