"""ragged_dot: the sorted formulation with jax.lax.ragged_dot_general on every platform (the reference grouped
path; on CPU it expands to a dense masked matmul over all experts)."""

from __future__ import annotations

from functools import partial

from ..sorted import sorted_experts_forward

NAME = "ragged_dot"
KERNELS = {"default": "ragged_dot"}

experts_forward = partial(sorted_experts_forward, kernels=KERNELS)
