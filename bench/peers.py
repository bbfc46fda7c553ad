"""Peer series: other libraries' experts implementations, timed on the benchmark's own inputs.

A peer runs when its package is importable and is reported as ``<library>:<name>`` next to our backends (each
record says ``peer: true`` and its ``library``):

- ``transformers:eager``, ``transformers:batched_mm``, ``transformers:grouped_mm`` (torch): transformers' own experts
  functions, called on a transformers experts module (``Qwen3MoeExperts``, the [E, 2I, H] / [E, H, I] layout of
  the contract) that holds the benchmark's weight tensors, with no copy. ``eager`` is the module class's own
  forward, the others come from ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``.
- ``tokamax:ragged_dot`` (JAX): the sorted formulation (slots sorted by expert, one grouped matmul per projection,
  gathered back, summed over k in float32) with ``tokamax.ragged_dot`` as the grouped matmul, its default
  implementation choice (mosaic, triton, then xla); the weights are handed over in its [E, K, N] layout once.

Each peer has a ``counterpart``: our backend of the same name, whose spec entry decides how it is compiled, so
that the two are compared under the same rules.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Peer:
    name: str  # the series' backend name, "<library>:<counterpart>"
    framework: str
    library: str  # the package that provides it (import name)
    counterpart: str  # our backend of the same name
    make: Callable[..., Callable]  # (framework-specific setup) -> forward(x, index, w, gate_up, down)

    def unavailable(self) -> str | None:
        """None if the peer's package is importable, else why it does not run."""
        if importlib.util.find_spec(self.library) is None:
            return f"peer {self.name}: the package {self.library!r} is not installed"
        return None


# --- transformers ------------------------------------------------------------------------------------------------

def _transformers_module(experts: int, hidden: int, intermediate: int):
    """A transformers Qwen3-MoE experts module without weights of its own (built on the meta device)."""
    import torch
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=experts,
                            hidden_act="silu")
    with torch.device("meta"):
        module = Qwen3MoeExperts(config)
    for name in ("gate_up_proj", "down_proj"):
        module._parameters.pop(name)  # plain tensor attributes from now on: the benchmark's weights
    return module


def _transformers_function(name: str) -> Callable:
    from transformers.integrations import moe as hf_moe
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    if name == "eager":
        return Qwen3MoeExperts.forward.__wrapped__  # the class's own loop, under @use_experts_implementation
    return hf_moe.ALL_EXPERTS_FUNCTIONS[name]


def transformers_peer(name: str) -> Callable[[int, int, int], Callable]:
    def make(experts: int, hidden: int, intermediate: int) -> Callable:
        module = _transformers_module(experts, hidden, intermediate)
        module.config._experts_implementation = name
        function = _transformers_function(name)

        def forward(x, index, w, gate_up, down):
            module.gate_up_proj, module.down_proj = gate_up, down
            return function(module, x, index, w)

        return forward

    return make


# --- tokamax -----------------------------------------------------------------------------------------------------

def tokamax_peer(name: str) -> Callable[[], Callable]:
    def make() -> Callable:
        import jax
        import jax.numpy as jnp
        import tokamax

        def grouped(a, w_kn, group_sizes):
            return tokamax.ragged_dot(a, w_kn, group_sizes, preferred_element_type=jnp.float32).astype(a.dtype)

        def forward(x, index, w, gate_up_kn, down_kn):
            T, k = index.shape
            E, _, H = down_kn.shape
            ids = index.reshape(-1)
            order = jnp.argsort(ids, stable=True)
            group_sizes = jnp.bincount(ids, length=E).astype(jnp.int32)
            xs = x.astype(gate_up_kn.dtype)[order // k]
            h = grouped(xs, gate_up_kn, group_sizes)
            I = h.shape[1] // 2
            y = grouped(jax.nn.silu(h[:, :I]) * h[:, I:], down_kn, group_sizes)
            out = jnp.zeros_like(y, dtype=jnp.float32).at[order].set(y.astype(jnp.float32))
            weighted = out.reshape(T, k, H) * w.reshape(T, k, 1).astype(jnp.float32)
            return weighted.sum(axis=1).astype(x.dtype)

        return forward

    return make


def tokamax_weights(gate_up: Any, down: Any) -> tuple[Any, Any]:
    """Our [E, N, K] weights in ragged_dot's [E, K, N] layout (done once per config, outside the timing)."""
    import jax.numpy as jnp
    return jnp.swapaxes(gate_up, 1, 2).copy(), jnp.swapaxes(down, 1, 2).copy()


PEERS: dict[str, Peer] = {p.name: p for p in (
    *(Peer(f"transformers:{n}", "torch", "transformers", n, transformers_peer(n))
      for n in ("eager", "batched_mm", "grouped_mm")),
    Peer("tokamax:ragged_dot", "jax", "tokamax", "ragged_dot", tokamax_peer("ragged_dot")),
)}


def peers_of(framework: str) -> dict[str, Peer]:
    return {n: p for n, p in PEERS.items() if p.framework == framework}


def library_of(framework: str, backend: str) -> str:
    """The library that provides a series: the peer's, else ours (moe_torch / moe_jax)."""
    peer = PEERS.get(backend)
    return peer.library if peer is not None else f"moe_{framework}"
