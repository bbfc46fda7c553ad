"""Helpers every torch backend shares: argument description, routing slots, gating and the combine."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from moe_shared import ArrayInfo, native

from . import expert_rows

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


_HUGE_PAGE = 2 << 20


@functools.cache
def _madvise() -> Callable | None:
    """libc's madvise where the OS has transparent huge pages (Linux), else None."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


# CPU buffers from this size on get pages of their own (cpu_buffer)
FRESH_PAGES_FROM_BYTES = 4 << 20
# A fresh page costs a fault and a kernel-side clear at its first write (qwen3-cpu's gate/up weight gradient, 100 MB:
# 23 ms to zero on fresh pages, 7 ms on pages written before). cpu_buffer's buffers freed by their last tensor are
# kept for its next call of the same size, up to this many bytes in all (memory the process keeps, as torch's CUDA
# caching allocator does).
POOLED_BYTES_MAX = 1 << 30


class _PagePool:
    """Private anonymous mappings of freed cpu_buffer tensors, by size, for reuse (thread-safe: a tensor may be freed
    on any thread)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes, self.free = max_bytes, 0, {}
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap | None:
        with self.lock:
            kept = self.free.get(nbytes)
            if not kept:
                return None
            self.bytes -= nbytes
            return kept.pop()

    def give(self, pages: mmap.mmap) -> None:
        """Keep ``pages`` where the pool has room; else they are unmapped with their last reference (the array
        being freed still holds them: they cannot be closed here)."""
        with self.lock:
            if self.bytes + len(pages) <= self.max_bytes:
                self.free.setdefault(len(pages), []).append(pages)
                self.bytes += len(pages)


_PAGES = _PagePool(POOLED_BYTES_MAX)


def cpu_buffer(like: torch.Tensor, *shape: int) -> tuple[torch.Tensor, bool]:
    """A buffer for a large result: (a tensor of ``shape`` and ``like``'s dtype and device, whether it holds zeros).
    On the CPU from FRESH_PAGES_FROM_BYTES on it lies on private anonymous pages of its own (an mmap): fresh ones read
    as zeros and take memory only where written, so rows nothing writes (a weight gradient's idle experts) cost
    nothing (qwen3-cpu training at T=4: 27 of 68 ms went to writing those zeros); once its last tensor is freed
    the mapping is kept for the next buffer of that size (its pages written before: no first-touch faults; not
    zeros). With ``MOE_EXPERTS_HUGE_PAGES=1`` a fresh one's whole 2 MB pages are marked for transparent huge pages
    before anything touches them (a hint the OS may ignore; ``native.huge_pages_from_bytes``). Elsewhere
    ``like.new_empty(shape)`` (not zeros)."""
    nbytes = math.prod(shape) * like.element_size()
    if like.device.type != "cpu" or nbytes < FRESH_PAGES_FROM_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return like.new_empty(shape), False
    pages, fresh = _PAGES.take(nbytes), False
    if pages is None:
        pages, fresh = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), True
    array = np.frombuffer(pages, dtype=np.uint8)
    weakref.finalize(array, _PAGES.give, pages).atexit = False  # runs when the last tensor on them is freed
    out = torch.from_numpy(array).view(like.dtype).view(shape)
    from_bytes, madvise = native.huge_pages_from_bytes(), _madvise()
    if fresh and from_bytes is not None and out.nbytes >= from_bytes and madvise is not None:
        start = -(-out.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (out.data_ptr() + out.nbytes) // _HUGE_PAGE * _HUGE_PAGE
        madvise(start, end - start, mmap.MADV_HUGEPAGE)
    return out, fresh


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatch when ``t`` already has it (decode is host-bound)."""
    return t if t.dtype == dtype else t.to(dtype)


def takes_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on ``tensors``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# d act(g) / d g times a gradient: the ops autograd itself calls for ACTIVATIONS (the same bits)
ACTIVATION_GRADS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": torch.ops.aten.silu_backward,
    "gelu": torch.ops.aten.gelu_backward,
    "relu": lambda grad, g: torch.ops.aten.threshold_backward(grad, g, 0),
}


def op_free_training(forward: Callable, setup_context: Callable, backward: Callable) -> type:
    """An autograd.Function that runs a training custom op's functions without the op dispatch (eager mode; the same
    kernels and bits, less host time): ``forward(*inputs)`` gives the op's outputs (the result first),
    ``setup_context(ctx, inputs, outputs)`` is the one registered with the op, ``backward(ctx, grad)`` gives the
    inputs' gradients."""

    class OpFreeTraining(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            outputs = forward(*inputs)
            setup_context(ctx, inputs, outputs)
            return outputs[0]

        @staticmethod
        def backward(ctx, grad):
            return backward(ctx, grad)

    return OpFreeTraining


class _Gate(torch.autograd.Function):
    """act(g) * u for [g; u] = h. Backward: [dg, du] as one [..., 2I] gradient from the ops autograd would call (the
    same bits), without its zero-filled [..., 2I] buffer per half and their sum (4 kernels instead of 8)."""

    @staticmethod
    def forward(ctx, h, activation, intermediate):
        act, out = gate_with_activation(h, activation, intermediate)
        ctx.save_for_backward(h, act)
        ctx.gate = (activation, intermediate)
        return out

    @staticmethod
    def backward(ctx, grad):
        h, act = ctx.saved_tensors
        return gate_grad(grad, h, act, *ctx.gate), None, None


def gate_with_activation(h: torch.Tensor, activation: str, intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(g), act(g) * u) for [g; u] = h: the gate's output and what its gradient (gate_grad) reads."""
    act = ACTIVATIONS[activation](h[..., :intermediate])
    return act, act * h[..., intermediate:]


def gate_grad(grad: torch.Tensor, h: torch.Tensor, act: torch.Tensor, activation: str,
              intermediate: int) -> torch.Tensor:
    """d(act(g) * u) / d[g; u] times ``grad``, one [..., 2I] tensor, given h = [g; u] and act = act(g)."""
    g, u = h[..., :intermediate], h[..., intermediate:]
    return torch.cat([ACTIVATION_GRADS[activation](grad * u, g), grad * act], -1)


def gate(activation: str | Callable, h: torch.Tensor, intermediate: int) -> torch.Tensor:
    """act(g) * u for [g; u] = h, or the custom gate callable applied to h."""
    if callable(activation):
        return activation(h)
    if takes_grad(h):
        return _Gate.apply(h, activation, intermediate)
    return ACTIVATIONS[activation](h[..., :intermediate]).mul_(h[..., intermediate:])  # in place: nothing saved


_NOT_YET = object()


class Slots:
    """The T*k routed slots, flattened token-major: slot s belongs to token s // k.

    Ids outside [0, E) (the empty slot -1, or anything unchecked) are empty: ``safe_ids`` clamps them into [0, E)
    so that no gather reads out of bounds, and ``empty`` (true for those slots) masks them out of the result and of
    every gradient (two element-wise kernels: the clamp, and its comparison with the ids; the masks are
    ``masked_fill``s, one kernel each). On the CPU outside torch.compile one min/max tells whether there are any
    (no device sync); without any, ``empty`` is None and nothing is masked.
    """

    def __init__(self, top_k_index: torch.Tensor, num_experts: int):
        self.T, self.k = top_k_index.shape
        self.ids = top_k_index.reshape(-1)
        self.num_experts = num_experts
        if self._all_valid():
            self._empty, self._clamped = None, self.ids
        else:
            self._clamped = self.ids.clamp(0, num_experts - 1)
            self._empty = _NOT_YET

    @property
    def empty(self) -> torch.Tensor | None:
        """[T*k] bool, true for the empty slots; None where there are none. Made at its first use, so that a
        backend's first big gather is issued right after the clamp (decode waits on the host for it)."""
        if self._empty is _NOT_YET:
            self._empty = self._clamped != self.ids
        return self._empty

    def _all_valid(self) -> bool:
        if self.ids.device.type != "cpu" or torch.compiler.is_compiling():
            return False
        if not self.ids.numel():
            return True
        lowest, highest = torch.aminmax(self.ids)
        return int(lowest) >= 0 and int(highest) < self.num_experts

    @property
    def count(self) -> int:
        return self.T * self.k

    @property
    def safe_ids(self) -> torch.Tensor:
        return self._clamped

    def expert_key(self) -> torch.Tensor:
        """Each slot's expert, E for the empty ones (they sort last)."""
        return self.ids if self.empty is None else self.ids.masked_fill(self.empty, self.num_experts)

    def mask(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [T*k, ...] with the empty slots' entries zeroed."""
        if self.empty is None:
            return values
        return values.masked_fill(self.empty.view(-1, *(1,) * (values.dim() - 1)), 0)

    def token_of_slot(self) -> torch.Tensor:
        return torch.arange(self.count, device=self.ids.device) // self.k


def sort_keys(keys: torch.Tensor, inverse: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``keys`` sorted stably: (the sorted keys; the position of each sorted row; the sorted row of each position,
    or None without ``inverse``)."""
    sorted_keys, order = torch.sort(keys, stable=True)
    if not inverse:
        return sorted_keys, order, None
    restore = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return sorted_keys, order, restore


def sort_by_expert(slots: Slots, inverse: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The slots sorted by expert, stably, empty slots last: (the expert of each sorted row, E for empty slots; the
    slot of each sorted row; the sorted row of each slot, or None without ``inverse``)."""
    return sort_keys(slots.expert_key(), inverse)


def unsort_rows(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows in sorted order back in their original order (``order``: the original position of each sorted row): one
    write to distinct rows (an index_put without accumulation: deterministic, and allowed under
    ``torch.use_deterministic_algorithms``), no inverse permutation needed."""
    return torch.empty_like(rows).index_put_((order,), rows)


def expert_ends(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [E]: the end of each expert's rows among ``sorted_ids`` (rows of ids >= E lie past the last end)."""
    experts = torch.arange(1, num_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, experts, out_int32=True)


class RowGather(torch.autograd.Function):
    """A row gather differentiated without an accumulating scatter. Autograd turns indexing into an index_put with
    accumulate (atomics on CUDA: other bits on every run); the subclasses use what they know of their indices."""

    @staticmethod
    def rows(t, index):
        return t[index]

    @classmethod
    def gather(cls, t, index, *backward_args):
        """The gather, through this function where autograd records it, else plain (no autograd.Function cost)."""
        if torch.is_grad_enabled() and t.requires_grad:
            return cls.apply(t, index, *backward_args)
        return cls.rows(t, index)


class TokenRows(RowGather):
    """x[token]. Backward: each token's k slot gradients, put back in slot order through the permutation
    ``restore`` (nothing accumulates) and summed over k in float32 in a fixed order; empty slots (``empty`` true,
    rows past the grouped matmul's offsets) are dropped."""

    @staticmethod
    def rows(x, token):
        return x.index_select(0, token)

    @staticmethod
    def forward(ctx, x, token, restore, empty, k):
        ctx.save_for_backward(restore, empty)
        ctx.slot_shape = (x.shape[0], k, x.shape[1])  # [T, k, H]
        return TokenRows.rows(x, token)

    @staticmethod
    def backward(ctx, grad):
        restore, empty = ctx.saved_tensors
        per_slot = grad.index_select(0, restore)
        if empty is not None:
            per_slot.masked_fill_(empty[:, None], 0)
        # torch sums bfloat16 and float16 in float32 and rounds once
        return per_slot.view(ctx.slot_shape).sum(1), None, None, None, None


# elements of y up to which the combine runs as one product and one sum over k (a [T*k, H] float32 temporary; few
# kernels), per device type; beyond, k multiply-adds into one float32 [T, H] (no temporary; k times the kernels)
VECTORIZED_COMBINE_MAX = {"cpu": 2**17, "cuda": 2**24}


def sum_over_k(y: torch.Tensor, weights: torch.Tensor, empty: torch.Tensor | None,
               rows_zero: bool = False) -> torch.Tensor:
    """sum_j weights[:, j] * y[:, j] in float32 for y [T, k, H], the empty slots' terms exactly zero whatever their
    rows and weights hold (``rows_zero``: the caller made their rows zeros, so only their weights are masked). Up to
    VECTORIZED_COMBINE_MAX elements one product, its empty slots' rows zeroed in place, and one sum (three kernels);
    else k multiply-adds into one float32 [T, H] on masked rows and weights (no float32 [T*k, H] temporary; in half
    precision each product is exact in float32, so every term is rounded once, by the sum). Both give the same bits
    as masking first."""
    vectorized = y.numel() <= VECTORIZED_COMBINE_MAX.get(y.device.type, VECTORIZED_COMBINE_MAX["cpu"])
    if empty is not None and (rows_zero or not vectorized):
        weights = weights.masked_fill(empty, 0)
        if not rows_zero:
            y = y.masked_fill(empty.unsqueeze(2), 0)
        empty = None
    if vectorized:
        products = y * weights.float().unsqueeze(2)  # times float32 weights: float32 products
        if empty is not None:
            products.masked_fill_(empty.unsqueeze(2), 0)
        return products.sum(1)
    out = y[:, 0] * weights[:, 0, None].float()
    for j in range(1, weights.shape[1]):
        out.addcmul_(y[:, j], weights[:, j, None])
    return out


class _Combine(torch.autograd.Function):
    """sum_over_k of y [T, k, H], rounded to ``out_dtype``, the weights of empty slots taken as zero (masked here,
    so autograd adds no mask of its own to their gradient). Backward: each slot's row gradient w * grad (one product,
    rounded once) and each weight's gradient, a float32 dot product over H (zero for empty slots); nothing
    [T*k, H] in float32."""

    @staticmethod
    def forward(ctx, y, weights, empty, out_dtype):
        weights = masked_weights(weights, empty)
        ctx.save_for_backward(y, weights, empty)
        return sum_over_k(y, weights, empty).to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        y, weights, empty = ctx.saved_tensors
        return *combine_grads(grad, y, weights, empty, *ctx.needs_input_grad[:2]), None, None


def masked_weights(weights: torch.Tensor, empty: torch.Tensor | None) -> torch.Tensor:
    """The routing weights [T, k] with the empty slots' taken as zero."""
    return weights if empty is None else weights.masked_fill(empty, 0)


def combine_grads(grad: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, empty: torch.Tensor | None,
                  need_y: bool, need_weights: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of the combine's y [T, k, H] and its (masked) weights [T, k] from the output's ``grad`` [T, H]:
    each slot's w * grad (one product, rounded once) and each weight's float32 dot product over H (zero for empty
    slots)."""
    # one dtype: products and sums in it with float32 accumulation; mixed: in float32, rounded once at the end
    common = y.dtype if y.dtype == grad.dtype == weights.dtype else torch.float32
    grad, grad_y, grad_weights = as_dtype(grad, common), None, None
    if need_y:
        grad_y = as_dtype(as_dtype(weights, common).unsqueeze(2) * grad.unsqueeze(1), y.dtype)
    if need_weights:
        grad_weights = as_dtype(torch.bmm(as_dtype(y, common), grad.unsqueeze(2)).squeeze(2), weights.dtype)
        if empty is not None:
            grad_weights = grad_weights.masked_fill_(empty, 0)  # a fresh tensor: no copy first
    return grad_y, grad_weights


def combine_sorted(y: torch.Tensor, order: torch.Tensor, slots: Slots, top_k_weights: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """``combine`` of rows in expert order (``order``: the slot of each sorted row), where nothing takes gradients.
    On the CPU in bfloat16 the row library's ``combine_slots`` reads each slot's row where it lies (one pass, the
    same bits), else the rows go back to slot order first."""
    weights = top_k_weights.reshape(slots.T, slots.k)
    if expert_rows.combines(y, order, weights, out_dtype):
        return expert_rows.combine_slots(y, order, slots.empty, weights, out_dtype)
    return combine(unsort_rows(y, order), slots, top_k_weights, out_dtype)


def combine(y: torch.Tensor, slots: Slots, top_k_weights: torch.Tensor, out_dtype: torch.dtype,
            empty_rows_zero: bool = False) -> torch.Tensor:
    """sum_j w[t, j] * y[t*k + j] in float32 in a fixed order (deterministic: no scatter; the same bits with and
    without autograd); empty slots exactly zero, whatever their rows of ``y`` and their weights hold.
    ``empty_rows_zero``: the caller made the empty slots' rows zeros, so only their weights are masked (the same
    bits, no [T*k, H] mask)."""
    T, k = slots.T, slots.k
    empty = None if slots.empty is None else slots.empty.view(T, k)
    y = y.view(T, k, y.shape[-1])
    if takes_grad(y, top_k_weights):
        return _Combine.apply(y, top_k_weights.reshape(T, k), empty, out_dtype)
    return sum_over_k(y, top_k_weights.reshape(T, k), empty, rows_zero=empty_rows_zero).to(out_dtype)


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
