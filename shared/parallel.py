"""Expert-parallel rules shared by moe_torch and moe_jax: the even split of the experts over the ranks of a group
and the capacity of a fixed-size exchange buffer.

Rank r of W owns the experts [r * E / W, (r + 1) * E / W); a slot routed to expert e goes to rank e // (E / W).
"""

from __future__ import annotations

import math


def experts_per_rank(num_experts: int, world_size: int) -> int:
    """E / W, the number of experts each rank owns; ValueError unless W divides E."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    if num_experts % world_size:
        raise ValueError(f"num_experts: expected a multiple of the world size {world_size} (the experts are split "
                         f"evenly over the ranks), got {num_experts}")
    return num_experts // world_size


def slot_capacity(slots: int, world_size: int, capacity_factor: float | None = None) -> int:
    """How many of its ``slots`` routed slots one rank may send to each rank through a fixed-size exchange.

    ``capacity_factor=None``: all of them, so that no slot is ever dropped (the buffers hold W * slots rows).
    Otherwise ``ceil(capacity_factor * slots / W)``, at most ``slots``: 1.0 fits a perfectly balanced routing.
    Slots beyond the capacity are dropped (computed as empty slots) and counted.
    """
    if capacity_factor is None:
        return slots
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or \
            not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor: expected None or a positive finite number, got {capacity_factor!r}")
    return min(slots, math.ceil(capacity_factor * slots / world_size))
