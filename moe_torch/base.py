"""Helpers every torch backend shares: argument description, routing slots, gating and the combine."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_shared import ArrayInfo

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,  # erf form
    "relu": F.relu,
}

_DEVICE_CLASSES = {"cpu": "cpu", "cuda": "cuda"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def info(t: torch.Tensor | None) -> ArrayInfo | None:
    return None if t is None else ArrayInfo(tuple(t.shape), dtype_name(t.dtype))


def device_class(device: torch.device) -> str:
    """The spec's device class of a torch device ("cpu", "cuda"; other types are named as they are)."""
    return _DEVICE_CLASSES.get(device.type, device.type)


def gate(activation: str | Callable, h: torch.Tensor, intermediate: int) -> torch.Tensor:
    """act(g) * u for [g; u] = h, or the custom gate callable applied to h."""
    if callable(activation):
        return activation(h)
    g, u = h[..., :intermediate], h[..., intermediate:]
    return ACTIVATIONS[activation](g) * u


class Slots:
    """The T*k routed slots, flattened token-major: slot s belongs to token s // k.

    Ids outside [0, E) (the empty slot -1, or anything unchecked) are empty: ``safe_ids`` maps them to expert 0 so
    that no gather reads out of bounds, and ``valid`` masks them out of the result and of every gradient.
    """

    def __init__(self, top_k_index: torch.Tensor, num_experts: int):
        self.T, self.k = top_k_index.shape
        self.ids = top_k_index.reshape(-1).long()
        self.valid = (self.ids >= 0) & (self.ids < num_experts)
        self.safe_ids = torch.where(self.valid, self.ids, 0)
        self.num_experts = num_experts

    @property
    def count(self) -> int:
        return self.T * self.k

    def token_of_slot(self) -> torch.Tensor:
        return torch.arange(self.count, device=self.ids.device) // self.k


def combine(y: torch.Tensor, slots: Slots, top_k_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """sum_j w[t, j] * y[t*k + j] in float32 (deterministic: no scatter), empty slots exactly zero."""
    H = y.shape[-1]
    w = torch.where(slots.valid, top_k_weights.reshape(-1).float(), 0.0)
    y = torch.where(slots.valid[:, None], y.float(), 0.0)
    return (y * w[:, None]).view(slots.T, slots.k, H).sum(dim=1).to(out_dtype)


class _GatherRows(torch.autograd.Function):
    """table[index] whose gradient sums each row's contributions in float32 (autograd's own would add them in the
    table's dtype: a long bfloat16 sum)."""

    @staticmethod
    def forward(ctx, table, index):
        ctx.save_for_backward(index)
        ctx.table = (table.shape, table.dtype)
        return table[index]

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        shape, dtype = ctx.table
        total = grad.new_zeros(shape, dtype=torch.float32).index_add_(0, index.reshape(-1),
                                                                      grad.reshape(-1, *shape[1:]).float())
        return total.to(dtype), None


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` (rows); for a half-precision table that takes gradients, the gradient is summed in float32."""
    if table.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled() and table.requires_grad:
        return _GatherRows.apply(table, index)
    return table[index]


def add_bias(h: torch.Tensor, bias: torch.Tensor | None, expert_ids: torch.Tensor) -> torch.Tensor:
    return h if bias is None else h + gather_rows(bias, expert_ids)
