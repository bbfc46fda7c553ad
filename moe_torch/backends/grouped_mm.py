"""grouped_mm: sort the slots by expert, one grouped matmul per projection over per-expert offsets.

The grouped matmul is ``torch.nn.functional.grouped_mm`` where it supports the dtype, device and strides, else the
``moe_torch::grouped_mm_loop`` custom op (a per-expert loop, opaque to torch.compile); on the CPU in bfloat16 at
inference with few rows per expert, the CPU row kernel (``moe_torch.expert_rows``; compiled, through the opaque op
``moe_torch::eager_grouped_linear``). All are per-expert matmuls; the
combine is a gather back to slot order and a sum over k (no atomics on any device). The backward has no atomics
either: the row gathers carry their own gradients (a per-token sum over k in float32, a per-expert bias
sum as a one-hot matmul, the inverse permutation), so it gives the same bits on every run. On CUDA, uncompiled,
training with a named activation and no biases runs those same ops as one autograd node (``moe_torch.training_step``;
the weight gradients as K-grouped matmuls), or within the spec's training_graphs bound as training graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import expert_rows, training_step
from ..base import (RowGather, Slots, TokenRows, as_dtype, combine, combine_grads, combine_sorted, cpu_buffer,
                    expert_ends, gate, gate_grad, gate_with_activation, masked_weights, sort_by_expert, sort_keys,
                    sum_over_k, takes_grad)

NAME = "grouped_mm"
# F.grouped_mm's dtypes per device that pass every shared vector of that dtype (on CUDA float32 and float16 checked
# on the H200, torch 2.11: tests/device_results/nvidia-h200-native-dtypes.json; float32 runs without TF32)
NATIVE_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16),
                 "cuda": (torch.bfloat16, torch.float32, torch.float16)}
_COMPILED_NATIVE_DTYPES = (torch.bfloat16,)  # what inductor lowers grouped_mm for
_ALIGN = 16  # bytes: grouped_mm needs 16-byte aligned strides and base pointers
K_GROUPED_DEVICES = ("cuda",)  # grouped_weight_grad as one F.grouped_mm (on the CPU the per-expert loop is faster)
# devices where training with a named activation and no biases runs as one autograd node (``training_step``), outside
# torch.compile; elsewhere autograd records the composed path's nodes. On the CPU the step's forward runs outside
# autograd, so on the row kernel where it applies (qwen3-cpu training step on a 2-core EPYC, three interleaved rounds,
# fastest, with the kernel's weight gradients and products through the weights: 9.3 against 10.5 ms at T=1, 27.3
# against 33.3 at 16, 41.8 against 46.8 at 64, 79.8 against 85.3 at 256)
TRAINING_STEP_DEVICES = ("cuda", "cpu")


def _aligned(t: torch.Tensor, *dims: int) -> bool:
    size = t.element_size()
    # storage offsets cannot be read while tracing; compiled graphs see the parameters' own (aligned) storage
    offset_ok = torch.compiler.is_compiling() or (t.storage_offset() * size) % _ALIGN == 0
    return offset_ok and all((t.stride(d) * size) % _ALIGN == 0 for d in dims)


def _native_dtype(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether F.grouped_mm exists and takes both operands' dtype on their device (here, or under torch.compile)."""
    if not hasattr(F, "grouped_mm"):
        return False
    allowed = _COMPILED_NATIVE_DTYPES if torch.compiler.is_compiling() else NATIVE_DTYPES.get(a.device.type, ())
    return a.dtype in allowed and b.dtype == a.dtype


def native_supported(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether F.grouped_mm takes ``a`` [S, K] and ``w.transpose(1, 2)`` for w [E, N, K] as they are."""
    if not _native_dtype(a, w):
        return False
    b = w.transpose(1, 2)
    if not (a.stride(-1) == 1 and _aligned(a, 0)):
        return False
    column_major = b.stride(-2) == 1 and _aligned(b, 0, -1)
    row_major = b.stride(-1) == 1 and _aligned(b, 0, -2)
    return column_major or row_major


def k_grouped_supported(grad: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether F.grouped_mm takes ``grad.t()`` [N, R] and ``a`` [R, K] as they are (the K-grouped form: one
    [N, K] product per row group, the weight gradient of a grouped matmul)."""
    if not _native_dtype(a, grad):
        return False
    return grad.stride(-1) == 1 and a.stride(-1) == 1 and _aligned(grad, 0) and _aligned(a, 0)


@torch.library.custom_op("moe_torch::grouped_mm_loop", mutates_args=())
def grouped_mm_loop(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = a[rows of e] @ w[e].T for the row ranges ending at offs; rows past offs[-1] are zero."""
    out = a.new_zeros(a.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):  # one host sync for the whole loop
        if end > start:
            torch.mm(a[start:end], w[e].T, out=out[start:end])
        start = end
    return out


@grouped_mm_loop.register_fake
def _(a, w, offs):
    return a.new_empty(a.shape[0], w.shape[1])


def grouped_weight_grad(grad: torch.Tensor, a: torch.Tensor, offs: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E, N, K]: grad[rows of e].T @ a[rows of e] for the row ranges ending at offs (one matmul each, float32
    accumulation), zero for experts without rows; nothing accumulates across calls (the same bits every run). On the
    devices of ``K_GROUPED_DEVICES`` one K-grouped F.grouped_mm where it takes the rows (no host sync), else a loop
    (one host sync). Under torch.compile through the custom op ``moe_torch::grouped_weight_grad`` (opaque: the
    compiler could otherwise lay the transposed rows out unaligned); in eager mode the function itself, without
    the op's dispatch (the same bits)."""
    if torch.compiler.is_compiling():
        return _grouped_weight_grad_op(grad, a, offs, num_experts)
    return _weight_grad(grad, a, offs, num_experts)


def _weight_grad(grad: torch.Tensor, a: torch.Tensor, offs: torch.Tensor, num_experts: int) -> torch.Tensor:
    if grad.device.type in K_GROUPED_DEVICES and k_grouped_supported(grad, a):
        return F.grouped_mm(grad.t(), a, offs=offs)
    out, zeros = cpu_buffer(grad, num_experts, grad.shape[1], a.shape[1])
    if expert_rows.weight_grads_apply(grad, a, num_experts):  # every expert written in one call of the library
        expert_rows.weight_grads(grad, a, offs, out, zero_idle=not zeros)
        return out
    start, idle_from = 0, None  # idle experts are zeroed a run of consecutive ones at a time (decode: a few runs)
    for e, end in enumerate(offs.tolist()):  # one host sync for the whole loop
        if end > start:
            if idle_from is not None:
                out[idle_from:e].zero_()
                idle_from = None
            torch.mm(grad[start:end].T, a[start:end], out=out[e])
        elif idle_from is None and not zeros:
            idle_from = e
        start = end
    if idle_from is not None:
        out[idle_from:].zero_()
    return out


@torch.library.custom_op("moe_torch::grouped_weight_grad", mutates_args=())
def _grouped_weight_grad_op(grad: torch.Tensor, a: torch.Tensor, offs: torch.Tensor,
                            num_experts: int) -> torch.Tensor:
    return _weight_grad(grad, a, offs, num_experts)


@_grouped_weight_grad_op.register_fake
def _(grad, a, offs, num_experts):
    return grad.new_empty(num_experts, grad.shape[1], a.shape[1])


@torch.library.custom_op("moe_torch::grouped_mm_loop_backward", mutates_args=())
def grouped_mm_loop_backward(grad: torch.Tensor, a: torch.Tensor, w: torch.Tensor,
                             offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_a = torch.zeros_like(a)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(grad[start:end], w[e], out=grad_a[start:end])
        start = end
    return grad_a, grouped_weight_grad(grad, a, offs, w.shape[0])


@grouped_mm_loop_backward.register_fake
def _(grad, a, w, offs):
    return torch.empty_like(a), w.new_empty(w.shape)


def _loop_setup(ctx, inputs, output):
    a, w, offs = inputs
    ctx.save_for_backward(a, w, offs)


def _loop_backward(ctx, grad):
    a, w, offs = ctx.saved_tensors
    grad_a, grad_w = grouped_mm_loop_backward(grad.contiguous(), a, w, offs)
    return grad_a, grad_w, None


grouped_mm_loop.register_autograd(_loop_backward, setup_context=_loop_setup)


class _NativeGroupedLinear(torch.autograd.Function):
    """F.grouped_mm(a, w.T) with torch's input gradient (F.grouped_mm(grad, w)) and ``grouped_weight_grad`` for the
    weights': the same bits as F.grouped_mm's own backward, whose weight gradient on the CPU is written into fresh
    4 KB pages (this one's lie on pages kept for reuse, idle experts' on none at first: ``base.cpu_buffer``)."""

    @staticmethod
    def forward(ctx, a, w, offs):
        ctx.save_for_backward(a, w, offs)
        return F.grouped_mm(a, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        a, w, offs = ctx.saved_tensors
        need_a, need_w = ctx.needs_input_grad[:2]
        grad = grad.contiguous()
        grad_a = F.grouped_mm(grad, w, offs=offs) if need_a else None
        grad_w = grouped_weight_grad(grad, a, offs, w.shape[0]) if need_w else None
        return grad_a, grad_w, None


def grouped_linear(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[S, K] x [E, N, K] -> [S, N], rows grouped by expert at the int32 end offsets ``offs``: on the CPU row
    kernel at few rows per expert where it applies (``expert_rows``), else F.grouped_mm or the loop."""
    if expert_rows.applies(a, w):
        groups = expert_rows.expert_groups(offs)
        if groups is not None:
            starts, counts, experts = groups
            return expert_rows.grouped_rows(a, w, a.shape[0], starts, starts, counts, experts).to(a.dtype)
    elif expert_rows.applies(a, w.transpose(1, 2)):  # w a transposed view: a backward's product through the weights
        groups = expert_rows.expert_groups(offs, expert_rows.TRANSPOSED_MEAN_ROWS)
        if groups is not None:
            starts, counts, experts = groups
            return expert_rows.grouped_rows(a, w.transpose(1, 2), a.shape[0], starts, starts, counts, experts,
                                            transposed=True).to(a.dtype)
    elif expert_rows.applies_compiled(a, w):
        return _eager_grouped_linear(a, w, offs)
    # F.grouped_mm's backward also takes the output gradient [S, N]: its rows must be 16-byte aligned too
    differentiated = torch.is_grad_enabled() and (a.requires_grad or w.requires_grad)
    if native_supported(a, w) and not (differentiated and (w.shape[1] * a.element_size()) % _ALIGN):
        if differentiated and w.requires_grad and a.device.type not in K_GROUPED_DEVICES:
            return _NativeGroupedLinear.apply(a, w, offs)
        return F.grouped_mm(a, w.transpose(1, 2), offs=offs)
    return grouped_mm_loop(a.contiguous(), w, offs)


@torch.library.custom_op("moe_torch::eager_grouped_linear", mutates_args=())
def _eager_grouped_linear(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_linear as eager mode runs it, for torch.compile: the CPU row kernel where the call's rows per expert
    are few, else F.grouped_mm or the loop."""
    return grouped_linear(a, w, offs)


@_eager_grouped_linear.register_fake
def _(a, w, offs):
    return a.new_empty(a.shape[0], w.shape[1])


def _with_zero_row(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, t.shape[1])])


class _ExpertRows(RowGather):
    """bias[expert] with a zero row appended at index E. Backward: each expert's rows summed by a one-hot matmul
    (float32 accumulation); rows of id E (empty slots, past the grouped matmul's offsets) are dropped."""

    @staticmethod
    def rows(bias, expert):
        return _with_zero_row(bias)[expert]

    @staticmethod
    def forward(ctx, bias, expert):
        ctx.save_for_backward(expert)
        ctx.num_experts = bias.shape[0]
        return _ExpertRows.rows(bias, expert)

    @staticmethod
    def backward(ctx, grad):
        (expert,) = ctx.saved_tensors
        one_hot = expert == torch.arange(ctx.num_experts, device=expert.device, dtype=expert.dtype)[:, None]
        rows = grad.masked_fill((expert >= ctx.num_experts)[:, None], 0)
        return one_hot.to(grad.dtype) @ rows, None


class _Permute(RowGather):
    """y[index] for a permutation ``index`` whose inverse is ``inverse``. Backward: grad[inverse]."""

    @staticmethod
    def forward(ctx, y, index, inverse):
        ctx.save_for_backward(inverse)
        return _Permute.rows(y, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _step_forward(x, top_k_weights, gate_up_proj, down_proj, ids, empty, activation, T, k, needs):
    """The training step's forward (``training_step.Step``), the composed path's ops: (the sum over k in float32,
    what its backward reads: the masked routing weights, each sorted row's slot, each slot's sorted row, the experts'
    end rows, the sorted rows of x, h = [g; u], act(g), a, and y back in slot order)."""
    E, H, I = down_proj.shape
    keys = ids if empty is None else ids.masked_fill(empty.view(-1), E)  # empty slots sort last
    sorted_ids, order, restore = sort_keys(keys)
    offs = expert_ends(sorted_ids, E)
    rows = TokenRows.rows(x, torch.div(order, k, rounding_mode="floor"))
    h = grouped_linear(rows, gate_up_proj, offs)
    act, a = gate_with_activation(h, activation, I)
    y = _Permute.rows(grouped_linear(a, down_proj, offs), restore).view(T, k, H)
    weights = masked_weights(top_k_weights.reshape(T, k), empty)
    return sum_over_k(y, weights, empty), (weights, order, restore, offs, rows, h, act, a, y)


def _step_backward(grad, x, gate_up_proj, down_proj, ids, empty, kept, activation, T, k, needs, hidden_dtype):
    """The training step's backward up to its weight gradients (``training_step.Step``), the composed path's
    backward ops: (d hidden_states, d routing weights [T, k], the operands of d gate_up_proj and of d down_proj),
    None where ``needs`` says so."""
    weights, order, restore, offs, rows, h, act, a, y = kept
    need_x, need_weights, need_gate_up, need_down = needs
    E, H, I = down_proj.shape
    grad_y, grad_weights = combine_grads(grad, y, weights, empty, need_x or need_gate_up or need_down, need_weights)
    grad_x = gate_up_operands = down_operands = None
    if grad_y is not None:
        grad_y = grad_y.view(T * k, H).index_select(0, order)  # in expert order
        down_operands = (grad_y, a, offs, E) if need_down else None
        if need_x or need_gate_up:
            grad_h = gate_grad(grouped_linear(grad_y, down_proj.transpose(1, 2), offs), h, act, activation, I)
            gate_up_operands = (grad_h, rows, offs, E) if need_gate_up else None
            if need_x:  # TokenRows' backward: back to slot order, empty slots dropped, summed over k in float32
                per_slot = grouped_linear(grad_h, gate_up_proj.transpose(1, 2), offs).index_select(0, restore)
                if empty is not None:
                    per_slot.masked_fill_(empty.view(-1, 1), 0)
                grad_x = as_dtype(per_slot.view(T, k, x.shape[1]).sum(1), hidden_dtype)
    return grad_x, grad_weights, gate_up_operands, down_operands


STEP = training_step.Step(_step_forward, _step_backward, grouped_weight_grad)


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    if (hidden_states.device.type in TRAINING_STEP_DEVICES and not torch.compiler.is_compiling()
            and training_step.wanted(activation, gate_up_bias, down_bias, hidden_states, top_k_weights, gate_up_proj,
                                     down_proj)):
        return training_step.apply(STEP, NAME, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                   activation)
    E, H, I = down_proj.shape
    slots = Slots(top_k_index, E)
    differentiated = takes_grad(hidden_states, gate_up_proj, down_proj, gate_up_bias, down_bias)
    sorted_ids, order, restore = sort_by_expert(slots, inverse=differentiated)  # the inverse for the backward
    offs = expert_ends(sorted_ids, E)

    # Empty slots sort last (id E), past offs[-1], rows the grouped matmul never reads or writes. They gather their
    # own token's row and zero bias rows (an appended row at index E), and the gathers' backwards drop their
    # gradients, so whatever those rows hold never reaches a gradient; the combine zeroes their outputs exactly.
    token = order // slots.k
    x = TokenRows.gather(hidden_states.to(gate_up_proj.dtype), token, restore, slots.empty, slots.k)
    h = grouped_linear(x, gate_up_proj, offs)
    if gate_up_bias is not None:
        h = h + _ExpertRows.gather(gate_up_bias, sorted_ids)
    y = grouped_linear(gate(activation, h, I).contiguous(), down_proj, offs)
    if down_bias is not None:
        y = y + _ExpertRows.gather(down_bias, sorted_ids)
    if differentiated:  # back to slot order through a gather whose backward scatters nothing
        return combine(_Permute.gather(y, restore, order), slots, top_k_weights, hidden_states.dtype)
    return combine_sorted(y, order, slots, top_k_weights, hidden_states.dtype)
