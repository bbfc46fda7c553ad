"""DeepGEMM's contiguous grouped layout, in NumPy: the reference both frameworks' device code is tested against.

The S = T*k slots are sorted by expert, stably (an expert's rows keep its slots' order). Expert e's rows start at
``starts[e]``, a multiple of ``alignment``, and fill ``counts[e]`` rows; the rest of its last block, and every row
after the last group, is padding, marked -1 in the int32 per-row ``grouped_layout`` the kernels read. The inverse
map ``slot_rows[s]`` is slot s's row, or M (one past the last row) for an empty or out-of-range slot, which gets
no row. M is a static upper bound fixed by S, E and the alignment, so the device code needs no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def padded_rows(slots: int, experts: int, alignment: int) -> int:
    """Rows enough for any routing of ``slots`` slots over ``experts`` experts: at most min(E, S) experts are hit,
    and each wastes at most ``alignment - 1`` rows of its last block."""
    return (slots + min(experts, slots) * (alignment - 1)) // alignment * alignment


class ContiguousLayout(NamedTuple):
    slot_rows: np.ndarray  # [S]: each slot's row, M for an empty slot
    grouped_layout: np.ndarray  # [M] int32: each row's expert, -1 for padding
    starts: np.ndarray  # [E]: each expert's first row (a multiple of the alignment)


def contiguous_layout(top_k_index, experts: int, alignment: int) -> ContiguousLayout:
    """The layout of the slots of ``top_k_index`` [T, k] (ids outside [0, experts) are empty slots)."""
    ids = np.asarray(top_k_index).reshape(-1)
    rows = padded_rows(ids.size, experts, alignment)
    valid = (ids >= 0) & (ids < experts)
    counts = np.bincount(ids[valid], minlength=experts)
    sizes = -(-counts // alignment) * alignment
    starts = np.cumsum(sizes) - sizes
    slot_rows = np.full(ids.size, rows, np.int64)
    grouped_layout = np.full(rows, -1, np.int32)
    filled = np.zeros(experts, np.int64)
    for slot in np.flatnonzero(valid):
        expert = ids[slot]
        slot_rows[slot] = starts[expert] + filled[expert]
        grouped_layout[slot_rows[slot]] = expert
        filled[expert] += 1
    return ContiguousLayout(slot_rows, grouped_layout, starts)


def check_alignment(backend: str, kernel_alignment: int, alignment: int) -> None:
    """RuntimeError unless groups starting at multiples of ``alignment`` satisfy the kernel's own alignment."""
    if alignment % kernel_alignment:
        raise RuntimeError(f"implementation {backend!r} lays groups out at multiples of {alignment} rows, which the "
                           f"kernel's contiguous-layout alignment {kernel_alignment} does not divide")
