"""batched_mm: gather every slot's expert weights and run torch.bmm per projection.

Fast for a handful of tokens (no sort, no host sync in the forward); the gathered weights are T*k copies of an
expert's. On the CPU the slots go through in chunks whose gathered weights stay in cache (a few MB each, never one
huge buffer). Training keeps no gathered weights: the backward sums each expert's weight gradient as one matmul over
its slots sorted by expert (float32 accumulation, no [T*k, N, K] gradient; on CUDA one K-grouped
``F.grouped_mm``), and takes the input gradient on CUDA as one grouped matmul over those sorted rows, on the CPU by
gathering the weights again in chunks.
"""

from __future__ import annotations

import torch

from ..base import Slots, add_bias, combine, expert_ends, gate, sort_keys, takes_grad, unsort_rows
from .grouped_mm import grouped_linear, grouped_weight_grad

NAME = "batched_mm"
CHUNK_BYTES = {"cpu": 4 << 20}  # gathered weights per torch.bmm; one bmm for every slot on other devices
SORTED_INPUT_GRAD = ("cuda",)  # devices whose backward takes the input gradient as a grouped matmul (see _SlotLinear)


def _chunks(slots: int, table: torch.Tensor) -> list[slice] | None:
    """The slot ranges whose gathered weights fit CHUNK_BYTES; None for one range of every slot."""
    limit = CHUNK_BYTES.get(table.device.type)
    size = slots if limit is None else max(1, limit // max(1, table[0].numel() * table.element_size()))
    return None if size >= slots else [slice(start, start + size) for start in range(0, slots, size)]


def _slot_products(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, transpose: bool = False):
    """out[s] = table[ids[s]] @ x[s] ([E, N, K], [S, K] -> [S, N]); ``transpose``: table[ids[s]].T @ x[s]."""
    chunks = _chunks(x.shape[0], table)
    if chunks is None:  # one gather, one bmm, no slicing: the fewest ops per call (decode is host-bound)
        return (torch.bmm(x.unsqueeze(1), table[ids]).squeeze(1) if transpose
                else torch.bmm(table[ids], x.unsqueeze(2)).squeeze(2))
    out = x.new_empty(x.shape[0], table.shape[2] if transpose else table.shape[1])
    for part in chunks:
        weights = table[ids[part]]
        if transpose:
            torch.bmm(x[part].unsqueeze(1), weights, out=out[part].unsqueeze(1))
        else:
            torch.bmm(weights, x[part].unsqueeze(2), out=out[part].unsqueeze(2))
    return out


class _SortedSlots:
    """The slots sorted by expert (stably): each sorted row's slot, each expert's end row."""

    def __init__(self, order: torch.Tensor, offs: torch.Tensor, num_experts: int):
        self.order, self.offs, self.num_experts = order, offs, num_experts

    @staticmethod
    def sort(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, offs): each sorted row's slot and each expert's end row."""
        sorted_ids, order, _ = sort_keys(ids, inverse=False)
        return order, expert_ends(sorted_ids, num_experts)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, self.order)


def _table_grad(grad_rows: torch.Tensor, x: torch.Tensor, slots: _SortedSlots) -> torch.Tensor:
    """sum over the slots s of expert e of grad[s] x[s]^T, for every e ([E, N, K]), from the output gradient's rows
    in expert order: one matmul per expert over its rows (float32 accumulation, rounded once; zero for an idle
    expert; no [T*k, N, K] gradient and nothing accumulated across calls; on CUDA one K-grouped F.grouped_mm, see
    grouped_weight_grad)."""
    return grouped_weight_grad(grad_rows, slots.rows(x), slots.offs, slots.num_experts)


class _SlotLinear(torch.autograd.Function):
    """out[s] = table[ids[s]] @ x[s], keeping no gathered weights for the backward. Backward: the output gradient's
    rows sorted by expert give the weight gradient, and on the devices of ``SORTED_INPUT_GRAD`` the input gradient
    too, as one grouped matmul on the weights as stored (no gathered weights at all); elsewhere the input gradient
    gathers the weights again, in cache-sized chunks."""

    @staticmethod
    def forward(ctx, x, table, ids, order, offs):
        ctx.save_for_backward(x, table, ids, order, offs)
        return _slot_products(x, table, ids)

    @staticmethod
    def backward(ctx, grad):
        x, table, ids, order, offs = ctx.saved_tensors
        grad = grad.contiguous()
        sorted_input_grad = grad.device.type in SORTED_INPUT_GRAD and ctx.needs_input_grad[0]
        slots = _SortedSlots(order, offs, table.shape[0]) if ctx.needs_input_grad[1] or sorted_input_grad else None
        grad_rows = slots.rows(grad) if slots is not None else None
        grad_x = grad_table = None
        if ctx.needs_input_grad[0]:
            if sorted_input_grad:  # grad[s] @ table[ids[s]] for the sorted rows, back to slot order
                grad_x = unsort_rows(grouped_linear(grad_rows, table.transpose(1, 2), slots.offs), slots.order)
            else:
                grad_x = _slot_products(grad, table, ids, transpose=True)
        if ctx.needs_input_grad[1]:
            grad_table = _table_grad(grad_rows, x, slots)
        return grad_x, grad_table, None, None, None


def _slot_linear(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, sorted_slots) -> torch.Tensor:
    """``sorted_slots``: (order, offs) of the slots sorted by expert, made once for both projections' backward."""
    if takes_grad(x, table):
        return _SlotLinear.apply(x, table, ids, *sorted_slots)
    return _slot_products(x, table, ids)


def _first_projection(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, slots: Slots,
                      sorted_slots) -> torch.Tensor:
    """table[ids[s]] @ x[s // k] for every slot s. At inference on one chunk: each token's k gathered matrices as
    one [k*N, K] matrix times the token's row (no copy of x per slot); else through a row per slot, whose gradient
    sums a token's k slots in float32 (a sum over k, no scatter)."""
    T, k, (N, K) = slots.T, slots.k, table.shape[1:]
    if not takes_grad(x, table) and _chunks(slots.count, table) is None:
        return torch.bmm(table[ids].reshape(T, k * N, K), x.unsqueeze(2)).view(T * k, N)
    return _slot_linear(x.unsqueeze(1).expand(T, k, K).reshape(T * k, K), table, ids, sorted_slots)


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    E, H, I = down_proj.shape
    slots = Slots(top_k_index, E)
    ids = slots.safe_ids
    sorted_slots = (None, None)  # one sort for both projections' backward, where one needs it
    if takes_grad(gate_up_proj, down_proj) or (hidden_states.device.type in SORTED_INPUT_GRAD
                                               and takes_grad(hidden_states, gate_up_proj, gate_up_bias)):
        sorted_slots = _SortedSlots.sort(ids, E)
    x = hidden_states.to(gate_up_proj.dtype)
    h = _first_projection(x, gate_up_proj, ids, slots, sorted_slots)
    a = gate(activation, add_bias(h, gate_up_bias, ids), I)
    y = add_bias(_slot_linear(a.contiguous(), down_proj, ids, sorted_slots), down_bias, ids)
    return combine(y, slots, top_k_weights, hidden_states.dtype)
