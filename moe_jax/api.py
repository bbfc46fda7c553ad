"""The public function and the backend registry of moe_jax."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moe_shared import check_arguments, check_expert_ids
from moe_shared.registry import BackendRegistry

from . import backends
from .base import device_class, info, is_traced, platform_of

BACKENDS = BackendRegistry("jax")
for _module in backends.ALL:
    BACKENDS.register(_module.NAME, _module.experts_forward)

register = BACKENDS.register

_ARGS = ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_bias",
         "down_bias")


def check_requirements(implementation: str, platform: str, dtype) -> None:
    """Raise if the backend cannot run here: ImportError names the pip extra, RuntimeError the hardware."""
    BACKENDS.check(implementation, device_class=device_class(platform), where=f"the {platform} platform",
                   dtype=jnp.dtype(dtype).name)


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    implementation: str = "grouped_mm", activation: str | Callable = "silu",
                    gate_up_bias=None, down_bias=None, validate: bool | None = None):
    """Routed gated-MLP experts: ``out[t] = sum_j w[t,j] * (down[e] @ (act(g) * u) + b2[e])``.

    Shapes: hidden_states [T, H]; top_k_index [T, k] (int32/int64, -1 = empty slot); top_k_weights [T, k];
    gate_up_proj [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up); down_proj [E, H, I]; gate_up_bias [E, 2I];
    down_bias [E, H]. Returns [T, H] in hidden_states' dtype; the matmuls run in the weights' dtype.

    ``implementation`` names a registered backend (``BACKENDS``; static under jax.jit); it never falls back to
    another. ``activation``: "silu", "gelu" (erf) or "relu" as ``act(g) * u``, or a callable mapping the first
    projection [S, N] to [S, I]. ``validate`` checks expert ids; by default on for concrete CPU arrays, off under
    a trace and on accelerators. Unchecked out-of-range ids count as empty slots.
    """
    fn = BACKENDS[implementation]
    arrays = dict(zip(_ARGS, (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias,
                              down_bias)))
    for name, a in arrays.items():
        if a is not None and not isinstance(a, (jax.Array, np.ndarray)):
            raise ValueError(f"{name}: expected a jax.Array, got {type(a).__name__}")
    arrays = {n: None if a is None else jnp.asarray(a) for n, a in arrays.items()}
    dims = check_arguments(*(info(a) for a in arrays.values()), activation=activation)
    platform = platform_of(arrays["gate_up_proj"])
    check_requirements(implementation, platform, arrays["gate_up_proj"].dtype)
    index = arrays["top_k_index"]
    if validate is None:
        validate = not is_traced(index) and platform_of(index) == "cpu"
    if validate and dims.slots:
        if is_traced(index):
            raise ValueError("validate: expected concrete top_k_index for validate=True, got a traced array "
                             "(under jax.jit, check the ids outside or leave validate unset)")
        ids = np.asarray(index)
        check_expert_ids(int(ids.min()), int(ids.max()), dims.E)
    return fn(*(arrays[n] for n in _ARGS[:5]), activation=activation,
              gate_up_bias=arrays["gate_up_bias"], down_bias=arrays["down_bias"])


def available_backends(platform: str | None = None) -> dict[str, str | None]:
    """Every registered backend -> None if it can run on ``platform`` (default: JAX's default), else why not."""
    platform = platform or jax.default_backend()
    return BACKENDS.availability(lambda name, dtype: check_requirements(name, platform, dtype))
