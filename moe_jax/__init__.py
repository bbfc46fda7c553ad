"""moe_jax: MoE expert backends for JAX on the shared moe_shared contract (never imports torch)."""

from . import parallel
from .api import BACKENDS, available_backends, experts_forward, register

__all__ = ["BACKENDS", "available_backends", "experts_forward", "parallel", "register"]
