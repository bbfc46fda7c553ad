"""grouped_mm: slots sorted by expert, one grouped matmul per projection; the kernel per platform is the spec's
(``backends.grouped_mm.jax.kernel``): the Triton grouped GEMM on CUDA, jax.lax.ragged_dot_general on TPU, and on CPU
the expert loop, which runs the whole expert MLP per block of sorted rows (``moe_jax.expert_loop``)."""

from __future__ import annotations

from functools import partial

from moe_shared import load_spec

from ..sorted import sorted_experts_forward

NAME = "grouped_mm"
KERNELS = dict(load_spec().backends[NAME].support("jax").details["kernel"])

experts_forward = partial(sorted_experts_forward, kernels=KERNELS)
