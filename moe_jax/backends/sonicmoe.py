"""sonicmoe (JAX): SonicMoE's kernels, the ones moe_torch's ``sonicmoe`` runs, from JAX, forward and backward.

The routing metadata comes from the shared Triton kernels (``moe_shared.sonic_steps.routing_plan``, launched with
moe_jax's Triton launcher as the ``triton`` backend launches them); then the forward and the backward are one
``jax.experimental.buffer_callback`` each, on XLA's stream: the callback views XLA's buffers with DLPack (no copies)
and runs ``moe_shared.sonic_steps`` (the same composition of SonicMoE's steps as moe_torch, on the same buffer
tables) with torch's current stream set to XLA's (``moe_jax.torch_bridge``). Every buffer, scratch included, is an
output of the callback, so XLA allocates all of it. ``jax.custom_vjp`` joins them; the forward under
differentiation keeps the residuals the backward reads. Works under ``jax.jit``. torch is imported by this backend
alone, at its first call.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax.experimental.buffer_callback import buffer_callback

from moe_shared import load_spec, requirements, sonic_steps
from moe_shared.contract import check_kernel_inputs
from moe_shared.spec import version_tuple

from .. import torch_bridge
from ..base import device_class, platform_of
from . import triton as triton_kernels

NAME = "sonicmoe"
PACKAGE = "sonicmoe"
SUPPORT = load_spec().backends[NAME].support("jax")

_READY: dict[str, SimpleNamespace] = {}


def runtime(platform: str) -> SimpleNamespace:
    """SonicMoE's step functions, once every requirement holds for ``platform`` (the first call raises what is
    missing)."""
    if platform not in _READY:
        if device_class(platform) not in SUPPORT.devices:
            raise RuntimeError(f"implementation {NAME!r} runs on {list(SUPPORT.devices)}, got the {platform} platform")
        device = jax.devices(platform)[0]
        requirements.import_required(NAME, SUPPORT.requires, "torch")
        requirements.import_required(NAME, SUPPORT.requires, "triton")  # the shared routing kernels
        module = requirements.load_cuda_package(NAME, SUPPORT.requires, PACKAGE,
                                                version_tuple(device.compute_capability)[:2],
                                                f"the {platform} platform ({device.device_kind})")
        _READY[platform] = sonic_steps.load_steps(SUPPORT.details["kernels"], module.__name__)
    return _READY[platform]


def _result_types(buffers, weights_dtype) -> dict[str, jax.ShapeDtypeStruct]:
    dtypes = {sonic_steps.WEIGHTS: weights_dtype, sonic_steps.FLOAT32: jnp.float32, sonic_steps.INT32: jnp.int32}
    return {b.name: jax.ShapeDtypeStruct(b.shape, dtypes[b.dtype]) for b in buffers}


def _inputs(**arrays) -> dict:
    return {name: a for name, a in arrays.items() if a is not None}


def _forward_callback(steps: SimpleNamespace, activation: str, k: int):
    return torch_bridge.graphed_callback(lambda t, routed, out: sonic_steps.forward(
        steps, t["x"], routed, k, t["gate_up"], t["down"], t.get("gate_up_bias"), t.get("down_bias"), out, activation))


def _backward_callback(steps: SimpleNamespace, activation: str):
    return torch_bridge.graphed_callback(lambda t, residuals, out: sonic_steps.backward(
        steps, t["dout"], t["x"], t["ids"], t["gate_up"], t["down"], t.get("gate_up_bias"), t.get("down_bias"),
        residuals, out, activation))


def _routing(ids, w, num_experts: int) -> dict:
    T, k = ids.shape
    env = triton_kernels.run_plan(sonic_steps.routing_plan(T, k, num_experts),
                                  {"ids": ids.reshape(-1), "w": w.reshape(-1)}, {})
    return sonic_steps.routing(env)


def _run_forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, training: bool) -> dict:
    """The forward's buffers (``sonic_steps.forward_buffers``) and the routing metadata (``sonic_steps.ROUTING``)."""
    E, H, I = down.shape
    T, k = ids.shape
    buffers = sonic_steps.forward_buffers(T, H, I, E, k, training)
    types = _result_types(buffers, gate_up.dtype)
    if T == 0:
        routed = _result_types(sonic_steps.routing_buffers(T, k, E), gate_up.dtype)
        return {name: jnp.zeros(t.shape, t.dtype) for name, t in (types | routed).items()}
    steps = runtime(platform_of(gate_up))
    routed = _routing(ids, w, E)
    call = buffer_callback(_forward_callback(steps, activation, k), types)
    found = call(_inputs(x=x, gate_up=gate_up, down=down, gate_up_bias=gate_up_bias, down_bias=down_bias), routed)
    return found | routed


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def _experts(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation):
    return _run_forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, training=False)["out"]


def _experts_fwd(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation):
    found = _run_forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, training=True)
    residuals = {name: found[name] for name in sonic_steps.RESIDUALS}
    return found["out"], (x, ids, w, gate_up, down, gate_up_bias, down_bias, residuals)


def _experts_bwd(activation, saved, dout):
    x, ids, w, gate_up, down, gate_up_bias, down_bias, residuals = saved
    E, H, I = down.shape
    buffers = sonic_steps.backward_buffers(x.shape[0], H, I, E, ids.shape[1], gate_up_bias is not None,
                                           down_bias is not None)
    types = _result_types(buffers, gate_up.dtype)
    if x.shape[0] == 0:
        grads = {name: jnp.zeros(t.shape, t.dtype) for name, t in types.items()}
    else:
        call = buffer_callback(_backward_callback(runtime(platform_of(gate_up)), activation), types)
        grads = call(_inputs(dout=dout.astype(gate_up.dtype), x=x, ids=ids, gate_up=gate_up, down=down,
                             gate_up_bias=gate_up_bias, down_bias=down_bias), residuals)
    return (grads["dx"], None, grads["d_scores"].reshape(w.shape).astype(w.dtype), grads["d_gate_up"],
            grads["d_down"], grads.get("d_gate_up_bias"), grads.get("d_down_bias"))


_experts.defvjp(_experts_fwd, _experts_bwd)


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    check_kernel_inputs(NAME, SUPPORT, activation, jnp.dtype(gate_up_proj.dtype).name,
                        gate_up_proj.shape, down_proj.shape)
    sonic_steps.check_biases(NAME, SUPPORT.details["biases"], down_proj.shape[2], gate_up_bias is not None,
                             down_bias is not None)
    x = hidden_states.astype(gate_up_proj.dtype)
    out = _experts(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation)
    return out.astype(hidden_states.dtype)
