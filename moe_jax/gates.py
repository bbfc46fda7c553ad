"""Custom gates (``activation=`` callables) for experts whose gating is not a plain ``act(g) * u``.

Each maps the first projection [S, 2I] in the concatenated layout (gate rows, then up rows) to [S, I].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def clamped_swiglu(alpha: float = 1.702, limit: float = 7.0):
    """GPT-OSS's gate: g clamped above at ``limit``, u clamped to [-limit, limit], ``(u + 1) * g * sigmoid(alpha g)``.

    Load GPT-OSS weights with ``convert.load_state_dict(..., is_transposed=True, interleaved=True)`` so that gate and
    up rows are concatenated as this gate expects."""

    def gate(h):
        g, u = jnp.split(h, 2, axis=-1)
        g = jnp.minimum(g, limit)
        u = jnp.clip(u, -limit, limit)
        return (u + 1) * (g * jax.nn.sigmoid(g * alpha))

    return gate
