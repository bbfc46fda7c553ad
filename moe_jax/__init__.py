"""moe_jax: MoE expert backends for JAX on the shared moe_shared contract (never imports torch).

Importing it sets glibc's allocator for JAX on the CPU first (``moe_jax.host_memory``: ``MOE_JAX_MALLOC``)."""

from . import host_memory

host_memory.apply()

from . import parallel  # noqa: E402
from .api import BACKENDS, available_backends, experts_forward, register  # noqa: E402

__all__ = ["BACKENDS", "available_backends", "experts_forward", "host_memory", "parallel", "register"]
