"""batched_mm: one batched matmul per projection, a batch entry per slot on its expert's weights.

Fast for a handful of tokens (no sort, no host sync in the forward). On CUDA nothing is gathered: one cuBLAS batched
GEMM per projection whose batch entries point at each slot's expert weights where they lie (``moe_torch.slot_blas``,
where its dtypes and alignment hold; compiled, the opaque op ``moe_torch::slot_products``, or at up to
COMPILED_FUSED_SLOTS slots the gathered weights' batched matmul, which inductor fuses with the gather). On the CPU,
uncompiled, nothing is gathered either: each slot takes one matmul on its expert's weights in place (IN_PLACE_DEVICES;
in bfloat16 every slot's in one call of the CPU row kernel, ``moe_torch.expert_rows``). Compiled on the CPU, the
gathered weights' torch.bmm, which inductor fuses with the gather into one GEMV per slot reading its expert's weights
in place (no gathered buffer; transformers' batched_mm compiles to the same kernel), from one slot per expert on
over the slots in expert order (COMPILED_ORDERED_FROM_SLOTS_PER_EXPERT); elsewhere the weights are
gathered (T*k copies of an expert's) and run through torch.bmm. Training keeps no gathered weights: the backward
sums each expert's weight gradient as one matmul over its slots sorted by expert (float32 accumulation, no [T*k, N, K]
gradient; on CUDA one K-grouped ``F.grouped_mm``), and takes the input gradient on CUDA as one grouped matmul over those
sorted rows, on the CPU through the forward's way again (in place, or fused with the gather when compiled). Training
with a named activation and no biases runs as one autograd node (``moe_torch.training_step``: the composed path's ops
and bits, one node's host cost), or within the spec's training_graphs bound on CUDA as training graphs.
"""

from __future__ import annotations

import torch

from .. import expert_rows, slot_blas, training_step
from ..base import (Slots, add_bias, as_dtype, combine, combine_grads, expert_ends, gate, gate_grad,
                    gate_with_activation, masked_weights, sort_keys, sum_over_k, takes_grad, unsort_rows)
from .grouped_mm import grouped_linear, grouped_weight_grad

NAME = "batched_mm"
# devices where, uncompiled, each slot takes one matmul on its expert's weights where they lie: on the CPU, gathering
# the weights costs as much as the matmuls (qwen3-cpu forward: 6.1 against 19.2 ms at T=4, 90 against 294 at T=64)
IN_PLACE_DEVICES = ("cpu",)
SORTED_INPUT_GRAD = ("cuda",)  # devices whose backward takes the input gradient as a grouped matmul (see _SlotLinear)
# under torch.compile, up to this many slots take the gathered weights' batched matmul, which inductor fuses with the
# gather (no copy) into one kernel a projection, instead of slot_blas's opaque op (a pointer kernel and a cuBLAS call
# a projection, and a custom op's host cost per call). On the H100, qwen3-30b-a3b forward, single calls, ours /
# transformers' batched_mm in one process each (bench/results/nvidia-h100-80gb-hbm3/2026-12-07-compiled-threshold-*):
# at T=8 (64 slots) the fused form 1.04-1.05 without CUDA graphs (max-autotune-no-cudagraphs) against 1.49-1.55 for
# slot_blas, 1.03 against 0.98 with them (max-autotune); at T=16 slot_blas 0.83-0.87 with graphs, 1.14-1.16 without,
# the fused form 1.01 in both; at T=64 slot_blas 0.47 with graphs and 0.53 without, the fused form 1.01 (the
# gathered weights of 512 slots: transformers' own form, 1.6 ms)
COMPILED_FUSED_SLOTS = {"cuda": 64}
# compiled on these devices, from this many slots per expert, the gathered weights' GEMVs take the slots in expert
# order and their outputs go back to slot order (each slot's product unchanged): the slots of one expert then read
# its weights from the cache one after the other. qwen3-cpu's inference forward on a 2-core EPYC, compiled, six
# alternating rounds (tests/cpu_compiled_slot_order.py, bench/results/cpu-2core/2026-12-08-compiled-slot-order-ab-*):
# 9.18 against 9.67 ms at T=8 (64 slots), 15.9 against 17.3 at T=16, 61.8 against 72.4 at T=64, the same bits; the
# gate/up GEMVs alone at 32 slots (half a slot per expert) 2.98-3.16 against 2.78-2.88 ms (the sort costs more than
# the few repeated experts save)
COMPILED_ORDERED_FROM_SLOTS_PER_EXPERT = {"cpu": 1}


def _in_place(table: torch.Tensor) -> bool:
    return table.device.type in IN_PLACE_DEVICES and not torch.compiler.is_compiling()


def _on_slot_blas(x: torch.Tensor, table: torch.Tensor, slots: int) -> bool:
    """Whether ``slots`` per-slot products of ``x`` on ``table`` run on slot_blas (see COMPILED_FUSED_SLOTS)."""
    if torch.compiler.is_compiling() and slots <= COMPILED_FUSED_SLOTS.get(x.device.type, 0):
        return False
    return slot_blas.applies(x, table)


def _compiled_ordered(x: torch.Tensor, table: torch.Tensor, slots: int) -> bool:
    """Whether, compiled, ``slots`` products on ``table`` take the gathered weights' GEMVs in expert order (see
    COMPILED_ORDERED_FROM_SLOTS_PER_EXPERT)."""
    per_expert = COMPILED_ORDERED_FROM_SLOTS_PER_EXPERT.get(x.device.type)
    return (per_expert is not None and torch.compiler.is_compiling() and slots > 1
            and slots >= per_expert * table.shape[0])


def _slot_products(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, transpose: bool = False,
                   order: torch.Tensor | None = None):
    """out[s] = table[ids[s]] @ x[s] ([E, N, K], [S, K] -> [S, N]); ``transpose``: table[ids[s]].T @ x[s].
    ``order``: the slots in expert order where slot_blas runs its batch entries so, or where the compiled GEMVs
    take them so (``_entry_order``)."""
    if _in_place(table):
        if not transpose and expert_rows.applies(x, table):
            return _rows_on_kernel(x, table, ids, slots_per_row=1)
        out = x.new_empty(x.shape[0], table.shape[2] if transpose else table.shape[1])
        for s, e in enumerate(ids.tolist()):
            torch.mm(x[s:s + 1], table[e] if transpose else table[e].T, out=out[s:s + 1])
        return out
    matrices = table.transpose(1, 2) if transpose else table
    if _on_slot_blas(x, matrices, x.shape[0]):
        return slot_blas.products(x, matrices, ids, order=order)
    # one gather and one bmm: the fewest ops per call (decode is host-bound); compiled, inductor makes the two one
    # GEMV per slot reading its expert's weights in place (no gathered buffer), as it does transformers' batched_mm
    if order is not None:
        return unsort_rows(_gathered_products(x.index_select(0, order), table, ids.index_select(0, order),
                                              transpose), order)
    return _gathered_products(x, table, ids, transpose)


def _gathered_products(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, transpose: bool) -> torch.Tensor:
    return (torch.bmm(x.unsqueeze(1), table[ids]).squeeze(1) if transpose
            else torch.bmm(table[ids], x.unsqueeze(2)).squeeze(2))


class _SortedSlots:
    """The slots sorted by expert (stably): each sorted row's slot, each expert's end row."""

    def __init__(self, order: torch.Tensor, offs: torch.Tensor, num_experts: int):
        self.order, self.offs, self.num_experts = order, offs, num_experts

    @staticmethod
    def sort(ids: torch.Tensor, num_experts: int,
             order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, offs): each sorted row's slot and each expert's end row; ``order``: a stable sort's made already."""
        if order is None:
            sorted_ids, order, _ = sort_keys(ids, inverse=False)
        else:
            sorted_ids = ids.index_select(0, order)
        return order, expert_ends(sorted_ids, num_experts)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, self.order)


def _linear_grads(grad: torch.Tensor, sorted_x: torch.Tensor | None, table: torch.Tensor, ids: torch.Tensor,
                  slots: _SortedSlots | None, need_input: bool, need_table: bool):
    """The gradients of out[s] = table[ids[s]] @ x[s] from the output gradient [S, N]: (the input's [S, K], the
    operands of the table's [E, N, K] for ``_table_grad``), None where not needed. The output gradient's rows sorted
    by expert give the table's, and on the devices of ``SORTED_INPUT_GRAD`` the input's too, as one grouped matmul on
    the table as stored (no gathered weights); elsewhere the input's goes through the forward's way again.
    ``slots``: the slots sorted by expert, needed for the table's gradient and the sorted input gradient;
    ``sorted_x``: the input's rows in that order, needed for the table's gradient."""
    grad = grad.contiguous()
    sorted_input_grad = need_input and grad.device.type in SORTED_INPUT_GRAD
    grad_rows = slots.rows(grad) if need_table or sorted_input_grad else None
    grad_x = grad_table = None
    if need_input:
        if sorted_input_grad:  # grad[s] @ table[ids[s]] for the sorted rows, back to slot order
            grad_x = unsort_rows(grouped_linear(grad_rows, table.transpose(1, 2), slots.offs), slots.order)
        else:
            grad_x = _slot_products(grad, table, ids, transpose=True)
    if need_table:
        grad_table = (grad_rows, sorted_x, slots.offs, slots.num_experts)
    return grad_x, grad_table


def _table_grad(operands) -> torch.Tensor | None:
    """The table's gradient [E, N, K] from ``_linear_grads``' operands: one K-grouped matmul (None without)."""
    return None if operands is None else grouped_weight_grad(*operands)


def _entry_order(ids: torch.Tensor, x: torch.Tensor, table: torch.Tensor,
                 known: torch.Tensor | None = None) -> torch.Tensor | None:
    """The slots in expert order for slot_blas's batch entries where its products run and order them
    (``slot_blas.ordered``), or for the compiled GEMVs where they take them so (``_compiled_ordered``), else None;
    ``known``: a stable sort's order of ``ids`` made already."""
    if _compiled_ordered(x, table, ids.shape[0]):
        return known if known is not None else sort_keys(ids, inverse=False)[1]
    if not _on_slot_blas(x, table, ids.shape[0]):
        return None
    if known is None:
        return slot_blas.expert_order(ids, table.shape[0])
    return known if slot_blas.ordered(ids.shape[0], table.shape[0]) else None


def _needs_sort(device: torch.device, need_input: bool, need_table: bool) -> bool:
    return need_table or (need_input and device.type in SORTED_INPUT_GRAD)


class _SlotLinear(torch.autograd.Function):
    """out[s] = table[ids[s]] @ x[s], keeping no gathered weights for the backward (see _linear_grads)."""

    @staticmethod
    def forward(ctx, x, table, ids, order, offs):
        ctx.save_for_backward(x, table, ids, order, offs)
        return _slot_products(x, table, ids, order=_entry_order(ids, x, table, order))

    @staticmethod
    def backward(ctx, grad):
        x, table, ids, order, offs = ctx.saved_tensors
        need_input, need_table = ctx.needs_input_grad[:2]
        slots = (_SortedSlots(order, offs, table.shape[0]) if _needs_sort(grad.device, need_input, need_table)
                 else None)
        sorted_x = slots.rows(x) if need_table else None
        grad_x, table_operands = _linear_grads(grad, sorted_x, table, ids, slots, need_input, need_table)
        return grad_x, _table_grad(table_operands), None, None, None


def _slot_linear(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, sorted_slots,
                 order: torch.Tensor | None) -> torch.Tensor:
    """``sorted_slots``: (order, offs) of the slots sorted by expert, made once for both projections' backward;
    ``order``: the slots in expert order for slot_blas (``_entry_order``) where nothing is differentiated."""
    if takes_grad(x, table):
        return _SlotLinear.apply(x, table, ids, *sorted_slots)
    return _slot_products(x, table, ids, order=order)


def _first_projection(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, slots: Slots, sorted_slots,
                      order: torch.Tensor | None) -> torch.Tensor:
    """table[ids[s]] @ x[s // k] for every slot s; differentiated through a row per slot, whose gradient sums a
    token's k slots in float32 (a sum over k, no scatter). ``order``: as for ``_slot_linear``."""
    if takes_grad(x, table):
        return _SlotLinear.apply(_per_slot(x, slots.T, slots.k), table, ids, *sorted_slots)
    return _token_products(x, table, ids, slots.T, slots.k, per_slot=False, order=order)


def _token_products(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, T: int, k: int,
                    per_slot: bool, order: torch.Tensor | None = None) -> torch.Tensor:
    """table[ids[s]] @ x[s // k] for every slot s, not differentiated. On the CPU row kernel: each slot's row read
    from x (no copy per slot; the same products either way). Uncompiled without ``per_slot``: each token's k
    gathered matrices as one [k*N, K] matrix times the token's row (no copy of x per slot); else a row per slot (the
    products the differentiated path computes), which compiled is also the inference form: one GEMV per slot,
    each reading its expert's weights, the form inductor fuses with the gather (as in transformers' batched_mm)."""
    if _in_place(table) and expert_rows.applies(x, table):
        return _rows_on_kernel(x, table, ids, slots_per_row=k)
    if _on_slot_blas(x, table, T * k):  # each slot's row read from x: the products of the per-slot path, no copy of x
        return slot_blas.products(x, table, ids, rows_per_x=k, order=order)
    if not per_slot and not _in_place(table) and not torch.compiler.is_compiling():
        N, K = table.shape[1:]
        return torch.bmm(table[ids].reshape(T, k * N, K), x.unsqueeze(2)).view(T * k, N)
    return _slot_products(_per_slot(x, T, k), table, ids, order=order)


def _rows_on_kernel(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, slots_per_row: int) -> torch.Tensor:
    """table[ids[s]] @ x[s // slots_per_row] for every slot s on the CPU row kernel: one row per group, the
    weights read in place."""
    slots = ids.shape[0]
    x_row = range(slots) if slots_per_row == 1 else [s // slots_per_row for s in range(slots)]
    return expert_rows.grouped_rows(x, table, slots, x_row, range(slots), [1] * slots, ids.tolist()).to(x.dtype)


def _step_forward(x, top_k_weights, gate_up_proj, down_proj, ids, empty, activation, T, k, needs):
    """The training step's forward (``training_step.Step``): (the sum over k in float32, what its backward reads:
    the masked routing weights, h = [g; u], act(g), a, y and the slots' expert order or None)."""
    E, H, I = down_proj.shape
    order = _entry_order(ids, x, gate_up_proj)
    h = _token_products(x, gate_up_proj, ids, T, k, per_slot=needs[0] or needs[2], order=order)
    act, a = gate_with_activation(h, activation, I)
    y = _slot_products(a, down_proj, ids, order=order).view(T, k, H)
    weights = masked_weights(top_k_weights.reshape(T, k), empty)
    return sum_over_k(y, weights, empty), (weights, h, act, a, y, order)


def _step_backward(grad, x, gate_up_proj, down_proj, ids, empty, kept, activation, T, k, needs, hidden_dtype):
    """The training step's backward up to its weight gradients (``training_step.Step``): (d hidden_states, d routing
    weights [T, k], the operands of d gate_up_proj and of d down_proj), None where ``needs`` says so. The slots are
    sorted by expert once for both projections (in the forward where slot_blas orders its batch entries by expert)."""
    weights, h, act, a, y, order = kept
    need_x, need_weights, need_gate_up, need_down = needs
    E, H, I = down_proj.shape
    grad_y, grad_weights = combine_grads(grad, y, weights, empty, need_x or need_gate_up or need_down, need_weights)
    grad_x = gate_up_operands = down_operands = None
    if grad_y is not None:
        slots = None
        if _needs_sort(grad.device, True, need_gate_up or need_down):
            slots = _SortedSlots(*_SortedSlots.sort(ids, E, order), E)  # the forward's entry order, if any
        sorted_a = slots.rows(a) if need_down else None
        grad_a, down_operands = _linear_grads(grad_y.view(T * k, H), sorted_a, down_proj, ids, slots,
                                              need_x or need_gate_up, need_down)
        if grad_a is not None:
            grad_h = gate_grad(grad_a, h, act, activation, I)
            # the sorted slots' token rows: the rows of _per_slot(x) in that order, without that copy
            sorted_x = (x.index_select(0, torch.div(slots.order, k, rounding_mode="floor")) if need_gate_up
                        else None)
            grad_x_slots, gate_up_operands = _linear_grads(grad_h, sorted_x, gate_up_proj, ids, slots, need_x,
                                                           need_gate_up)
            if grad_x_slots is not None:  # torch sums a half-precision expand's k rows in float32
                grad_x = as_dtype(grad_x_slots.view(T, k, x.shape[1]).sum(1), hidden_dtype)
    return grad_x, grad_weights, gate_up_operands, down_operands


STEP = training_step.Step(_step_forward, _step_backward, grouped_weight_grad)


def _per_slot(x: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """[T*k, K]: each token's row once per slot."""
    return x.unsqueeze(1).expand(T, k, x.shape[1]).reshape(T * k, x.shape[1])


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    if training_step.wanted(activation, gate_up_bias, down_bias, hidden_states, top_k_weights, gate_up_proj,
                            down_proj):
        return training_step.apply(STEP, NAME, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                   activation)
    slots = Slots(top_k_index, down_proj.shape[0])
    return _composed_forward(hidden_states, slots, top_k_weights, gate_up_proj, down_proj, activation, gate_up_bias,
                             down_bias)


def _composed_forward(hidden_states, slots, top_k_weights, gate_up_proj, down_proj, activation, gate_up_bias,
                      down_bias):
    """Inference, and training with biases or a gate callable: one step after the other, autograd recording
    each."""
    E, H, I = down_proj.shape
    ids = slots.safe_ids
    sorted_slots = (None, None)  # one sort for both projections' backward, where one needs it
    if takes_grad(gate_up_proj, down_proj) or (hidden_states.device.type in SORTED_INPUT_GRAD
                                               and takes_grad(hidden_states, gate_up_proj, gate_up_bias)):
        sorted_slots = _SortedSlots.sort(ids, E)
    x = hidden_states.to(gate_up_proj.dtype)
    order = _entry_order(ids, x, gate_up_proj, sorted_slots[0])
    h = _first_projection(x, gate_up_proj, ids, slots, sorted_slots, order)
    a = gate(activation, add_bias(h, gate_up_bias, ids), I)
    y = add_bias(_slot_linear(a.contiguous(), down_proj, ids, sorted_slots, order), down_bias, ids)
    return combine(y, slots, top_k_weights, hidden_states.dtype)
