"""batched_mm: gather every slot's expert weights and run torch.bmm per projection.

Fast for a handful of tokens (no sort, no host sync in the forward); the gathered weights are T*k copies of an
expert's. On the CPU the slots go through in chunks whose gathered weights stay in cache (a few MB each, never one
huge buffer). Training keeps no gathered weights: the backward gathers them again for the input gradient, and sums
each expert's weight gradient as one matmul over its slots sorted by expert (float32 accumulation, no [T*k, N, K]
gradient; on CUDA one K-grouped ``F.grouped_mm``).
"""

from __future__ import annotations

import torch

from ..base import Slots, add_bias, combine, gate, takes_grad
from .grouped_mm import grouped_weight_grad

NAME = "batched_mm"
CHUNK_BYTES = {"cpu": 4 << 20}  # gathered weights per torch.bmm; one bmm for every slot on other devices


def _chunks(slots: int, table: torch.Tensor) -> list[slice]:
    limit = CHUNK_BYTES.get(table.device.type)
    size = slots if limit is None else max(1, limit // max(1, table[0].numel() * table.element_size()))
    return [slice(start, start + size) for start in range(0, slots, max(size, 1))]


def _slot_products(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, transpose: bool = False):
    """out[s] = table[ids[s]] @ x[s] ([E, N, K], [S, K] -> [S, N]); ``transpose``: table[ids[s]].T @ x[s]."""
    out = x.new_empty(x.shape[0], table.shape[2] if transpose else table.shape[1])
    for part in _chunks(x.shape[0], table):
        weights = table[ids[part]]
        if transpose:
            torch.bmm(x[part].unsqueeze(1), weights, out=out[part].unsqueeze(1))
        else:
            torch.bmm(weights, x[part].unsqueeze(2), out=out[part].unsqueeze(2))
    return out


def _table_grad(grad: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """sum over the slots s of expert e of grad[s] x[s]^T, for every e ([E, N, K]): the slots sorted by expert, one
    matmul per expert over its rows (float32 accumulation, rounded once; zero for an idle expert; no [T*k, N, K]
    gradient and nothing accumulated across calls; on CUDA one K-grouped F.grouped_mm, see grouped_weight_grad)."""
    E = table.shape[0]
    sorted_ids, order = torch.sort(ids, stable=True)
    bounds = torch.arange(1, E + 1, dtype=sorted_ids.dtype, device=sorted_ids.device)
    offs = torch.searchsorted(sorted_ids, bounds).to(torch.int32)
    return grouped_weight_grad(grad.index_select(0, order), x.index_select(0, order), offs, E)


class _SlotLinear(torch.autograd.Function):
    """out[s] = table[ids[s]] @ x[s], keeping no gathered weights for the backward."""

    @staticmethod
    def forward(ctx, x, table, ids):
        ctx.save_for_backward(x, table, ids)
        return _slot_products(x, table, ids)

    @staticmethod
    def backward(ctx, grad):
        x, table, ids = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _slot_products(grad, table, ids, transpose=True) if ctx.needs_input_grad[0] else None
        grad_table = _table_grad(grad, x, ids, table) if ctx.needs_input_grad[1] else None
        return grad_x, grad_table, None


def _slot_linear(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if takes_grad(x, table):
        return _SlotLinear.apply(x, table, ids)
    return _slot_products(x, table, ids)


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    E, H, I = down_proj.shape
    slots = Slots(top_k_index, E)
    ids = slots.safe_ids
    x = hidden_states.to(gate_up_proj.dtype)
    # each token's row once per slot; the gradient sums a token's k slots in float32 (a sum over k, no scatter)
    x = x.unsqueeze(1).expand(slots.T, slots.k, H).reshape(slots.count, H)
    a = gate(activation, add_bias(_slot_linear(x, gate_up_proj, ids), gate_up_bias, ids), I)
    y = add_bias(_slot_linear(a.contiguous(), down_proj, ids), down_bias, ids)
    return combine(y, slots, top_k_weights, hidden_states.dtype)
