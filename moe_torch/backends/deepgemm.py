"""deepgemm: DeepGEMM's m-grouped bf16 GEMMs (the sgl-deep-gemm package, imported as deep_gemm) on its contiguous
layout. Inference only.

Routing runs on the device with no host sync: a stable sort of the slots by expert, each expert's rows starting at a
multiple of 128 in a buffer of a static upper bound of rows (``moe_shared.contiguous_layout``), padding rows marked
-1 in the int32 per-row ``grouped_layout`` (DeepGEMM skips blocks that start with one). Token rows are copied into
their slots' rows, the gate/up GEMM, the gated activation and the down GEMM run, and the combine gathers each slot's
row back and sums over k in float32 in a fixed order. Empty and out-of-range slots get no row (they read the down
GEMM's extra last row, zeroed, so the combine masks only their weights); padding rows of the GEMM outputs are never
used. Each GEMM is the custom op ``moe_torch::deepgemm_grouped_gemm`` (opaque to the
compiler, with a fake implementation), so ``torch.compile(fullgraph=True)`` traces the rest.

Inference only: the weight gradients would need DeepGEMM's k-grouped GEMM (``k_grouped_bf16_gemm_tn_contiguous``
in sgl-deep-gemm 0.1.4.post1). On SM90 it writes float32 [E, N, K] gradients, twice the bf16 weights (30 GB for
DeepSeek-V3's gate/up), its K groups (each expert's rows) must be multiples of 128 with zeroed padding, and its
plain form takes the per-expert row counts as a host list, a device-to-host sync in every backward (the prefix-sum
form that might avoid it is unverified). ``grouped_mm`` and ``triton`` train at full speed in bf16; a
differentiated call here raises RuntimeError naming them.
"""

from __future__ import annotations

from types import ModuleType

import torch

from moe_shared import load_spec, requirements
from moe_shared.contiguous_layout import check_alignment, padded_rows
from moe_shared.contract import check_kernel_inputs

from ..base import Slots, add_bias, combine, dtype_name, gate, sort_by_expert

NAME = "deepgemm"
PACKAGE = "deep_gemm"
SUPPORT = load_spec().backends[NAME].support("torch")
ALIGNMENT = SUPPORT.details["layout"]["group_alignment"]
KERNELS = SUPPORT.details["kernels"]

_READY: dict[torch.device, ModuleType] = {}


def runtime(device: torch.device) -> ModuleType:
    """deep_gemm, once every requirement holds for ``device`` (the first call raises what is missing)."""
    if device not in _READY:
        if device.type != "cuda":
            raise RuntimeError(f"implementation {NAME!r} runs on {list(SUPPORT.devices)}, got a tensor on {device}")
        module = requirements.load_cuda_package(NAME, SUPPORT.requires, PACKAGE,
                                                torch.cuda.get_device_capability(device), f"a tensor on {device}")
        check_alignment(NAME, int(module.get_mk_alignment_for_contiguous_layout()), ALIGNMENT)
        _READY[device] = module
    return _READY[device]


class Layout:
    """The contiguous layout of the slots (see ``moe_shared.contiguous_layout``), built on their device; ``slots``:
    the routed slots it was built from."""

    def __init__(self, top_k_index: torch.Tensor, num_experts: int, alignment: int = ALIGNMENT):
        self.slots = slots = Slots(top_k_index.long(), num_experts)
        S, E, device = slots.count, num_experts, slots.ids.device
        self.rows = padded_rows(S, E, alignment)
        sorted_ids, order, _ = sort_by_expert(slots, inverse=False)
        first = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=device))  # each expert's first sorted slot
        counts = first[1:] - first[:-1]
        sizes = (counts + alignment - 1) // alignment * alignment
        self.starts = torch.cumsum(sizes, 0) - sizes
        expert = sorted_ids.clamp(max=E - 1)
        position = torch.arange(S, device=device)
        sorted_rows = (self.starts[expert] + position - first[expert]).masked_fill(sorted_ids >= E, self.rows)
        self.slot_rows = torch.empty_like(sorted_rows).scatter_(0, order, sorted_rows)
        expert_of_slot = (slots.ids if slots.empty is None else slots.ids.masked_fill(slots.empty, -1)).int()
        self.grouped_layout = torch.full((self.rows + 1,), -1, dtype=torch.int32, device=device).index_put_(
            (self.slot_rows,), expert_of_slot)[: self.rows]  # empty slots all write -1 into the extra row


def _weights_operand(w: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(DeepGEMM function, B operand) for w [E, N, K]: K-major weights as they are, N-major ones (w.mT contiguous)
    in place through the nn kernel, any other strides copied."""
    if w.mT.is_contiguous() and not w.is_contiguous():
        return KERNELS["n_major"], w.mT
    return KERNELS["k_major"], w.contiguous()


@torch.library.custom_op("moe_torch::deepgemm_grouped_gemm", mutates_args=())
def deepgemm_grouped_gemm(a: torch.Tensor, w: torch.Tensor, grouped_layout: torch.Tensor) -> torch.Tensor:
    """``a`` [M + 1, K] rows in the contiguous layout times ``w[e]`` [N, K] of each row's expert ``e`` in
    ``grouped_layout`` [M] -> [M + 1, N]. Rows marked -1 and the extra last row are undefined."""
    rows = grouped_layout.shape[0]
    d = a.new_empty(rows + 1, w.shape[1])
    if rows:
        kernel, b = _weights_operand(w)
        getattr(runtime(a.device), kernel)(a[:rows], b, d[:rows], grouped_layout)
    return d


@deepgemm_grouped_gemm.register_fake
def _(a, w, grouped_layout):
    return a.new_empty(grouped_layout.shape[0] + 1, w.shape[1])


def check_inputs(hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation) -> None:
    """What DeepGEMM's kernels cannot take raises before any work: ValueError for the activation, the weights'
    dtype and the K of each GEMM; RuntimeError under autograd."""
    check_kernel_inputs(NAME, SUPPORT, activation, dtype_name(gate_up_proj.dtype),
                        gate_up_proj.shape, down_proj.shape)
    args = (hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        raise SUPPORT.training_error(NAME, load_spec().trainers("torch"))


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    check_inputs(hidden_states, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation)
    if not torch.compiler.is_compiling():  # compiled, the custom op checks when it first runs
        runtime(gate_up_proj.device)
    E, H, I = down_proj.shape
    layout = Layout(top_k_index, E)
    slots = layout.slots
    x = hidden_states.to(gate_up_proj.dtype).index_select(0, slots.token_of_slot())
    a = x.new_empty(layout.rows + 1, H).index_copy_(0, layout.slot_rows, x)
    h = deepgemm_grouped_gemm(a, gate_up_proj, layout.grouped_layout).index_select(0, layout.slot_rows)
    act = gate(activation, add_bias(h, gate_up_bias, slots.safe_ids), I)
    a = act.new_empty(layout.rows + 1, I).index_copy_(0, layout.slot_rows, act)
    y = deepgemm_grouped_gemm(a, down_proj, layout.grouped_layout)
    y[-1].zero_()  # the row of every empty slot
    y = add_bias(y.index_select(0, layout.slot_rows), down_bias, slots.safe_ids)
    return combine(y, slots, top_k_weights, hidden_states.dtype, empty_rows_zero=down_bias is None)
