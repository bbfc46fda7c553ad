"""The per-slot pointer arrays of a batched GEMM over expert weights read in place, in one Triton kernel.

Batch entry b of ``pointers`` [3, entries] computes slot s = ``order[b]`` (s = b without an order) and gets, in
bytes: row 0 ``table + ids[s] * expert_bytes`` (the slot's expert matrix), row 1 ``x + (s // rows_per_x) *
x_row_bytes`` (its input row), row 2 ``out + s * out_row_bytes`` (its output row). Addresses and sizes are plain
integers; ``ids`` and ``order`` are read on the device, so the kernel needs no host sync and a CUDA graph captures
it. Imports only triton.
"""

import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _slot_pointers(ids, ids_stride, order, pointers, entries, rows_per_x, table, expert_bytes, x, x_row_bytes, out,
                   out_row_bytes, HAS_ORDER: tl.constexpr, BLOCK: tl.constexpr):
    entry = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = entry < entries
    if HAS_ORDER:
        slot = tl.load(order + entry, mask=inside, other=0).to(tl.int64)
    else:
        slot = entry
    expert = tl.load(ids + slot * ids_stride, mask=inside, other=0).to(tl.int64)
    tl.store(pointers + entry, table + expert * expert_bytes, mask=inside)
    tl.store(pointers + entries + entry, x + (slot // rows_per_x) * x_row_bytes, mask=inside)
    tl.store(pointers + 2 * entries + entry, out + slot * out_row_bytes, mask=inside)


def launch(ids, ids_stride: int, order, pointers, rows_per_x: int, table: int, expert_bytes: int, x: int,
           x_row_bytes: int, out: int, out_row_bytes: int) -> None:
    """Fill ``pointers`` ([3, entries] int64, contiguous) from ``ids`` (integers, ``ids_stride`` elements apart),
    ``order`` (contiguous integers, or None) and the byte addresses and sizes named in the module docstring; one
    launch on the current stream."""
    entries = pointers.shape[1]
    _slot_pointers[(triton.cdiv(entries, BLOCK),)](
        ids, ids_stride, ids if order is None else order, pointers, entries, rows_per_x, table, expert_bytes, x,
        x_row_bytes, out, out_row_bytes, HAS_ORDER=order is not None, BLOCK=BLOCK)
