"""eager: a Python loop over the experts that received tokens (a host sync; not fullgraph-compatible).

Each expert's rows are weighted and added into float32 token rows (``index_add_``, one expert after the other: the
same bits on every run), so nothing [T*k, H] is made at inference; every temporary is one expert's rows. Training
gathers the token rows once (their gradient sums each token's k slots in float32) and takes the weights apart with
``unbind`` (one gradient buffer per weight, not one per expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base import Slots, TokenRows, gate, sort_by_expert, takes_grad

NAME = "eager"


def _per_expert(t: torch.Tensor | None):
    """``t[e]`` for each expert: views (indexable like ``t``); taken apart once where autograd records it."""
    return t.unbind(0) if takes_grad(t) else t


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    E, H, I = down_proj.shape
    slots = Slots(top_k_index, E)
    x = hidden_states.to(gate_up_proj.dtype)
    sorted_ids, order, restore = sort_by_expert(slots)
    counts = torch.bincount(sorted_ids, minlength=E + 1).tolist()  # the host sync; [E] counts the empty slots
    token = order // slots.k
    weight = slots.mask(top_k_weights.reshape(-1)).index_select(0, order)
    if takes_grad(x):
        rows_of_experts = TokenRows.gather(x, token, restore, slots.empty, slots.k).split(counts)
    else:
        rows_of_experts = (None,) * (E + 1)
    gate_up, down, gate_up_b, down_b = map(_per_expert, (gate_up_proj, down_proj, gate_up_bias, down_bias))
    out = torch.zeros(slots.T, H, dtype=torch.float32, device=x.device)
    start = 0
    for e, (count, rows) in enumerate(zip(counts[:E], rows_of_experts)):
        if not count:
            continue
        at = slice(start, start + count)
        start += count
        rows = x.index_select(0, token[at]) if rows is None else rows
        h = F.linear(rows, gate_up[e], None if gate_up_bias is None else gate_up_b[e])
        y = F.linear(gate(activation, h, I), down[e], None if down_bias is None else down_b[e])
        out = out.index_add_(0, token[at], y * weight[at, None].float())  # the product in float32
    if not out.requires_grad and takes_grad(weight):  # no slot reached an expert: zeros autograd can go through
        out = out + weight.sum()  # only empty slots, whose weights are zero
    return out.to(hidden_states.dtype)
