"""Flax NNX experts module with runtime backend switching.

Shape legend: T tokens, H hidden, I intermediate, E experts, k top-k. Parameters use the transformers / moe_torch
layout (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), so weights move 1:1 (see ``moe_jax.convert``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from moe_shared import check_activation
from moe_shared.switching import apply_request, auto_backend, expert_bytes, summarize

from . import parallel
from .api import BACKENDS, experts_forward
from .base import device_class, is_traced, platform_of
from .parallel import AUTO


def _check_backend(name) -> None:
    if name != AUTO:
        BACKENDS[name]


def resolve_backend(backend: str, hidden_states, top_k_index, gate_up_proj, down_proj) -> str:
    """The backend a call runs: ``backend`` itself, or for "auto" the spec's decode switch (batched_mm while the
    weights it gathers, T*k times one expert's, are at most the threshold of the device class, grouped_mm beyond).
    Shapes are static under jit, so the choice is made at trace time."""
    if backend != AUTO:
        return backend
    weight_bytes = expert_bytes(gate_up_proj.shape, down_proj.shape, gate_up_proj.dtype.itemsize)
    return auto_backend("jax", device_class(platform_of(hidden_states)), math.prod(top_k_index.shape), weight_bytes)


class DroppedSlots(nnx.Variable):
    """Running count of the routed slots an expert-parallel exchange dropped (over its capacity)."""


class ExpertShardedParam(nnx.Param):
    """A parameter sharded on E over a mesh axis (its ``mesh`` and ``out_sharding`` metadata): concrete values set
    later, such as a loaded state dict, are placed the same way."""

    def set_value(self, value, **kwargs):
        meta = self.get_metadata()
        if isinstance(value, (jax.Array, np.ndarray)) and not is_traced(value):
            value = jax.device_put(value, NamedSharding(meta["mesh"], meta["out_sharding"]))
        super().set_value(value, **kwargs)


class Experts(nnx.Module):
    """E gated-MLP experts run by a named backend, or by default "auto": at each trace, batched_mm while the
    routed slots T*k are at most the spec's decode threshold for the device (decode sizes on a GPU; never on the
    CPU), grouped_mm beyond it (on a GPU the Triton grouped kernel).

    ``__call__(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``. ``dtype`` is the
    computation dtype (None: the parameters'); ``param_dtype`` the storage dtype of the parameters.

    Expert parallelism: with a ``mesh``, the parameters are sharded on E over its axis ``expert_axis`` and calls
    run ``moe_jax.parallel.experts_forward`` (tokens split over the same axis; ``capacity_factor`` as there).
    ``dropped_slots`` then counts the slots dropped over the capacity, summed over calls (0 with the default
    capacity, which never drops).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 activation: str | Callable = "silu", bias: bool = False, backend: str = AUTO,
                 dtype=None, param_dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None,
                 expert_axis: str = "expert", capacity_factor: float | None = None, rngs: nnx.Rngs):
        for arg, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                           ("intermediate_size", intermediate_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg}: expected a positive int, got {value!r}")
        check_activation(activation)
        _check_backend(backend)
        E, H, I = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.activation = activation
        self.backend = backend
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.mesh, self.expert_axis, self.capacity_factor = mesh, expert_axis, capacity_factor
        if mesh is not None:
            parallel.check_mesh(mesh, expert_axis, num_experts, capacity_factor)
            self.dropped_slots = DroppedSlots(jnp.zeros((), jnp.int32))

        def uniform(shape, fan_in):
            bound = 1.0 / math.sqrt(fan_in)
            value = jax.random.uniform(rngs.params(), shape, param_dtype, -bound, bound)
            if mesh is None:
                return nnx.Param(value)
            return ExpertShardedParam(value, out_sharding=parallel.expert_spec(expert_axis, len(shape)), mesh=mesh,
                                      eager_sharding=True)

        self.gate_up_proj = uniform((E, 2 * I, H), H)
        self.down_proj = uniform((E, H, I), I)
        self.gate_up_bias = uniform((E, 2 * I), H) if bias else None
        self.down_bias = uniform((E, H), I) if bias else None

    def set_backend(self, backend: str) -> None:
        _check_backend(backend)
        self.backend = backend

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        params = [p if p is None else p.get_value() for p in (self.gate_up_proj, self.down_proj, self.gate_up_bias,
                                                        self.down_bias)]
        if self.dtype is not None:
            hidden_states = hidden_states.astype(self.dtype)
            params = [p if p is None else p.astype(self.dtype) for p in params]
        gate_up, down, gate_up_bias, down_bias = params
        if self.mesh is not None:
            out, dropped = parallel.experts_forward(
                hidden_states, top_k_index, top_k_weights, gate_up, down, mesh=self.mesh, axis=self.expert_axis,
                implementation=self.backend, activation=self.activation, gate_up_bias=gate_up_bias,
                down_bias=down_bias, capacity_factor=self.capacity_factor)
            self.dropped_slots.set_value(self.dropped_slots.get_value() + dropped)
            return out
        return experts_forward(hidden_states, top_k_index, top_k_weights, gate_up, down,
                               implementation=resolve_backend(self.backend, hidden_states, top_k_index, gate_up, down),
                               activation=self.activation, gate_up_bias=gate_up_bias, down_bias=down_bias)


def _experts_modules(model) -> dict[str, Experts]:
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model: expected a flax.nnx.Module, got {type(model).__name__}")
    found = {".".join(map(str, path)): node for path, node in nnx.iter_graph(model) if isinstance(node, Experts)}
    if not found:
        raise ValueError(f"model: expected a module holding moe_jax.flax_moe.Experts modules, got a "
                         f"{type(model).__name__} with none")
    return found


def get_backend(model) -> dict[str, str | None]:
    """``{"": top, "<sub-module>": backend, ...}``; passing it to ``set_backend`` restores it."""
    return summarize({p: m.backend for p, m in _experts_modules(model).items()})


def set_backend(model, name_or_dict: str | Mapping[str, str | None]) -> None:
    """A plain name applies to every Experts module; a dict maps sub-module names ("" = top level) to backends,
    the most specific name wins, and modules no key covers keep theirs."""
    modules = _experts_modules(model)
    requested = [name_or_dict] if isinstance(name_or_dict, str) else [
        v for v in getattr(name_or_dict, "values", lambda: [])() if v is not None]
    for name in requested:
        _check_backend(name)
    for path, backend in apply_request({p: m.backend for p, m in modules.items()}, name_or_dict).items():
        modules[path].backend = backend
