"""The CPU row kernel for torch: few rows per expert times the expert's bfloat16 weights read where they lie, either
orientation, and the weight gradients of rows grouped by expert (``weight_grads``).

At decode, ``torch.mm`` on an expert's weights (oneDNN) takes as long for one row as for 16 or 32: qwen3-cpu's
gate/up weights [768, 1024] on a 2-core Xeon with AMX, 79-85 us per expert at 1 to 16 rows, against 47-50 us on
this kernel (98 against 59 at 32 rows, 131-135 against 92 at 64). The kernel is ``moe_shared/kernels/expert_rows.h``
(AMX tiles where the CPU has them, else AVX512-BF16 dot products), the same one moe_jax's expert loop runs;
``expert_rows.cc`` binds it as a C entry point (called through ctypes) that takes a whole list of groups per call
and shares their work on torch's own OpenMP team (``torch.get_num_threads()`` threads, the caller among them).
It is built on first use (``moe_shared.native``).

``MOE_TORCH_ROW_KERNEL``: ``auto`` (default) uses it where the host has AVX512-BF16 and the build succeeds, else
``torch.mm`` (with a warning when the build failed); ``on`` raises ``RuntimeError`` with the reason where it cannot
run; ``off`` never uses it. ``MOE_TORCH_ROW_KERNEL_AMX=0``: no AMX. Used for bfloat16 on the CPU, where nothing it
computes is differentiated by autograd; under torch.compile grouped_mm reaches it through an opaque op.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import torch

from moe_shared import native

SOURCE = Path(__file__).with_name("expert_rows.cc")
VARIABLE = "MOE_TORCH_ROW_KERNEL"
PROFILER_NAME = "moe_torch::expert_rows"
# mean rows per group under which a grouped matmul runs on the kernel (by amx()): qwen3-cpu gate/up on a 2-core Xeon
# with AMX, per expert, with the float32 output's allocation, against torch.mm: 57 against 80 us at 1 row, 59 against
# 85 at 16, 103 against 133 at 64, 172 against 184 at 128; grouped_mm's whole bfloat16 forward 26 against 30-33 ms
# at T=512 (64 rows per expert), 57-59 against 54-56 at T=1024 (128). Without AMX, on a 2-core EPYC, gate/up and
# down per expert against torch.mm: 123 against 174 us at 1 row, 225 against 256 at 16, 353 against 334 at 32;
# grouped_mm's whole forward 14.8 against 16.9 ms at T=64 (8 rows), 16.9 against 17.8 at T=128, 26.3 against 21.3
# at T=192 (24 rows). With the kernel's sums reduced in registers (expert_rows.h's Sum4), three interleaved rounds,
# fastest: 21.0 against 25.7 ms at T=192, 21.2 against 24.4 at 224, 22.6-25.2 against 25.2-25.5 at 256, 24.2
# against 28.0 at 288 (36 rows); from 40 rows a tie or a loss: 35.8 against 28.0 at 320, 30.1-38.4 against
# 31.2-31.6 at 384, 34.2 against 35.3 at 448, 36.9 against 37.5 at 512
MEAN_ROWS = {True: 128, False: 40}
# the same for the other orientation (rows times an expert's weights, not transposed: a backward's products through
# the weights) and for weight gradients (moe_weight_grads: each expert's written once in bfloat16), by amx(). Without
# AMX, on a 2-core EPYC, grouped_mm's qwen3-cpu training step (three interleaved rounds, fastest): with the other
# orientation on the kernel, 17.7 against 19.3 ms at T=4, 30.0 against 30.5 at T=16 (2 rows), but 63.9 against 53.0
# at 16 rows and 99.6 against 72.6 at 32; with the weight gradients on it, 19.3 against 25.2 at T=4, 30.5 against
# 43.6 at 16, 45.0 against 47.1 at 64, 53.0 against 51.9 at 128, 72.6 against 86.2 at 256 (qwen3-cpu's gate/up
# gradient alone: 4.9, 6.5, 12.4 ms at 2, 8, 32 rows per expert against 7.8, 8.6, 15.3 for torch.mm per expert).
# With AMX, not measured against oneDNN's AMX matmuls: 0, never
TRANSPOSED_MEAN_ROWS = {True: 0, False: 8}
WEIGHT_GRADS_MEAN_ROWS = {True: 0, False: None}
_LIBRARY: dict[str, Callable[..., int | None]] = {}  # entry name: its ctypes function
_INDEX = ctypes.POINTER(ctypes.c_int64)
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ENTRIES = {  # name: (result, arguments)
    "moe_grouped_rows": (_INT, [_P, _I64, _P, _P, _I64, _I64, _I64, _INDEX, _INDEX, _INDEX, _INDEX, _INT, _INT,
                                _INT]),
    "moe_weight_grads": (None, [_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT]),
    "moe_combine_slots": (None, [_P, _I64, _P, _P, _P, _P, _INT, _I64, _I64, _I64, _INT]),
    "moe_zero_bytes": (None, [_P, _I64]),
}


@cache
def unavailable() -> str | None:
    """Why the row kernel cannot run on this host (None: it is built and loaded)."""
    library, reason = native.load(SOURCE, key="c-abi", flags=("-fopenmp",))
    if library is not None:
        for name, (result, arguments) in _ENTRIES.items():
            entry = getattr(library, name)
            entry.restype, entry.argtypes = result, arguments
            _LIBRARY[name] = entry
    return reason


def enabled() -> bool:
    """Whether moe_torch's CPU paths use the row kernel (see ``MOE_TORCH_ROW_KERNEL``)."""
    return native.enabled(VARIABLE, unavailable, "moe_torch runs torch.mm on each expert's rows")


def amx() -> bool:
    """Whether the kernel runs on AMX tiles (``native.amx``), else on AVX512-BF16 dot products."""
    return native.amx(VARIABLE)


def _takes(x: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` [*, K] times ``table`` [E, N, K] (each row by one expert's weights,
    transposed): the CPU, bfloat16, K-contiguous rows, nothing that autograd differentiates."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and table.dtype == torch.bfloat16 and x.dim() == 2
            and table.dim() == 3 and x.stride(-1) == 1 and table.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or table.requires_grad)))


def applies(x: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether ``x`` times ``table`` can run on the kernel here, in eager mode (see ``_takes``)."""
    return not torch.compiler.is_compiling() and _takes(x, table) and enabled()


@torch.compiler.assume_constant_result
def _enabled_when_compiled() -> bool:
    return enabled()


def applies_compiled(x: torch.Tensor, table: torch.Tensor) -> bool:
    """Under torch.compile: whether ``x`` times ``table`` goes through an opaque op that runs it as eager mode does
    (on the kernel or not, by the rows per expert of each call)."""
    return torch.compiler.is_compiling() and _takes(x, table) and _enabled_when_compiled()


def _under(bounds: dict, rows: int, groups: int) -> bool:
    bound = bounds[amx()]
    return bound is None or rows < bound * max(groups, 1)


def expert_groups(offs: torch.Tensor, bounds: dict = MEAN_ROWS) -> tuple[list[int], list[int], list[int]] | None:
    """(first row, rows, expert) of each expert with rows, from the int32 end offsets ``offs`` of rows sorted by
    expert (one host read), if the mean rows per such expert is under this host's bound in ``bounds`` (MEAN_ROWS,
    TRANSPOSED_MEAN_ROWS); else None."""
    starts, counts, experts, start = [], [], [], 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            starts.append(start), counts.append(end - start), experts.append(e)
        start = end
    return (starts, counts, experts) if _under(bounds, start, len(counts)) else None


def grouped_rows(x: torch.Tensor, table: torch.Tensor, out_rows: int, x_row: Sequence[int], out_row: Sequence[int],
                 rows: Sequence[int], expert: Sequence[int], *, transposed: bool = False) -> torch.Tensor:
    """float32 [out_rows, N]: for each group g, ``rows[g]`` rows of ``x`` from ``x_row[g]`` times
    ``table[expert[g]]`` [N, K] transposed, written from row ``out_row[g]``; with ``transposed``, rows of x [*, N]
    times ``table[expert[g]]`` into [out_rows, K]. Rows no group writes are left as allocated. Call where
    ``applies(x, table)``; the groups must lie inside ``x`` and the output."""
    N, K = table.shape[1:]
    out = torch.empty(out_rows, K if transposed else N, dtype=torch.float32)
    groups = len(rows)
    if groups == 0 or N == 0:
        return out
    arrays = [(ctypes.c_int64 * groups)(*values) for values in (x_row, out_row, rows, expert)]
    with torch.profiler.record_function(PROFILER_NAME):  # what the profiler shows (ctypes calls are not ops)
        refused = _LIBRARY["moe_grouped_rows"](x.data_ptr(), x.stride(0), table.data_ptr(), out.data_ptr(), N, K,
                                               groups, *arrays, int(transposed), int(amx()), torch.get_num_threads())
    if refused:
        raise RuntimeError("moe_torch's CPU row kernel: the kernel refused AMX tile data")
    return out


def weight_grads_apply(rows: torch.Tensor, inputs: torch.Tensor, num_experts: int) -> bool:
    """Whether ``weight_grads`` takes these here, in eager mode: contiguous bfloat16 CPU rows, the library enabled,
    under WEIGHT_GRADS_MEAN_ROWS rows per expert."""
    return (rows.device.type == "cpu" and rows.dtype == inputs.dtype == torch.bfloat16 and rows.dim() == 2
            and inputs.dim() == 2 and rows.shape[0] == inputs.shape[0] and rows.is_contiguous()
            and inputs.is_contiguous() and not torch.compiler.is_compiling() and enabled()
            and _under(WEIGHT_GRADS_MEAN_ROWS, rows.shape[0], num_experts))


def weight_grads(rows: torch.Tensor, inputs: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, *,
                 zero_idle: bool) -> None:
    """Into ``out`` [E, N, K] (bfloat16, contiguous): for each expert e with rows, ``rows[its rows].T @
    inputs[its rows]`` for rows [R, N] and inputs [R, K] grouped by expert at the int32 end offsets ``offs``, summed
    in float32 and rounded once (``weight_grads.h``); the other experts' zeros with ``zero_idle`` (written, or their
    pages released where not in memory: ``zero_pages.h``), else left as they are (a buffer known to be zeros). Call
    where ``weight_grads_apply(rows, inputs, E)``."""
    E, N, K = out.shape
    end = offs.to(torch.int32).contiguous()
    start = torch.cat([end.new_zeros(1), end[:-1]])
    right_row = torch.arange(rows.shape[0], dtype=torch.int32)
    with torch.profiler.record_function("moe_torch::weight_grads"):
        _LIBRARY["moe_weight_grads"](rows.data_ptr(), inputs.data_ptr(), right_row.data_ptr(), start.data_ptr(),
                                     end.data_ptr(), out.data_ptr(), E, N, K, int(zero_idle),
                                     torch.get_num_threads())


def combines(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether ``combine_slots`` takes these, in eager mode: bfloat16 CPU rows with unit column stride, int64 order,
    bfloat16 weights (each product exact in float32), a bfloat16 or float32 output, nothing that autograd
    differentiates, the library enabled."""
    return (y.device.type == "cpu" and y.dtype == weights.dtype == torch.bfloat16 and y.dim() == 2
            and order.dtype == torch.int64 and order.numel() == y.shape[0]
            and y.stride(-1) == 1 and out_dtype in (torch.bfloat16, torch.float32)
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad)) and enabled())


def combine_slots(y: torch.Tensor, order: torch.Tensor, empty: torch.Tensor | None, weights: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in ``out_dtype``: sum_j weights[t, j] * (the row of y holding slot t * k + j) for weights [T, k], where
    ``order`` (int64 [T * k], a permutation) is the slot of each row of y; in float32 in slot order from the first
    slot's product, rounded once; a slot with ``empty`` (bool [T * k], or None) set adds +0 (``slot_rows.h``). The
    same bits as ``base.sum_over_k`` on the rows in slot order. Call where ``combines(y, order, weights,
    out_dtype)``."""
    T, k = weights.shape
    order, weights = order.contiguous(), weights.contiguous()
    empty = None if empty is None else empty.contiguous()
    out = torch.empty(T, y.shape[1], dtype=out_dtype)
    if out.numel():
        with torch.profiler.record_function("moe_torch::combine_slots"):
            _LIBRARY["moe_combine_slots"](y.data_ptr(), y.stride(0), order.data_ptr(),
                                          None if empty is None else empty.data_ptr(), weights.data_ptr(),
                                          out.data_ptr(), int(out_dtype == torch.float32), T, k, y.shape[1],
                                          torch.get_num_threads())
    return out


def zero_(t: torch.Tensor) -> torch.Tensor:
    """``t.zero_()``; for a contiguous CPU tensor, from the library where it is enabled: a large one's pages that
    are not in memory are released rather than written, the others written (``zero_pages.h``, which JAX's
    ``moe_zeros`` and ``moe_weight_grads`` run; torch's own weight gradients lie on pages of their own instead,
    ``base.cpu_buffer``). Here the tests point it at memory of their choosing, a private file mapping included."""
    if t.device.type != "cpu" or not t.is_contiguous() or torch.compiler.is_compiling() or not enabled():
        return t.zero_()
    if t.numel():
        _LIBRARY["moe_zero_bytes"](t.data_ptr(), t.nbytes)
    return t
