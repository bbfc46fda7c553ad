"""deepgemm (JAX): DeepGEMM's m-grouped bf16 GEMMs, the kernels moe_torch's ``deepgemm`` runs, from JAX. Inference
only, like the torch backend (see there why).

The contiguous layout (``moe_shared.contiguous_layout``) is built in jnp, with static shapes. Each GEMM is a
``jax.experimental.buffer_callback`` on XLA's stream: the callback views XLA's buffers with ``torch.from_dlpack``
(zero copy) and calls deep_gemm under ``torch.cuda.ExternalStream(ctx.stream)``, since DeepGEMM launches on torch's
current stream and allocates through torch. The gate/up callback also adds the bias and applies the gated
activation with torch's functions, the down callback adds the bias: the same torch operations on the same values
as moe_torch's backend, so both frameworks give the same bits for the same routing (up to the float32 sum over k).
torch is imported by this backend alone, at its first call. Works under ``jax.jit``; a differentiated call raises.
"""

from __future__ import annotations

from functools import partial
from types import ModuleType

import jax
import jax.numpy as jnp
from jax.experimental.buffer_callback import buffer_callback

from moe_shared import load_spec, requirements
from moe_shared.contiguous_layout import check_alignment, padded_rows
from moe_shared.contract import check_kernel_inputs
from moe_shared.spec import version_tuple

from .. import torch_bridge
from ..base import Slots, combine, device_class, platform_of

NAME = "deepgemm"
PACKAGE = "deep_gemm"
SUPPORT = load_spec().backends[NAME].support("jax")
ALIGNMENT = SUPPORT.details["layout"]["group_alignment"]
KERNEL = SUPPORT.details["kernels"]["k_major"]

_READY: dict[str, ModuleType] = {}


def runtime(platform: str) -> ModuleType:
    """deep_gemm, once every requirement holds for ``platform`` (the first call raises what is missing)."""
    if platform not in _READY:
        if device_class(platform) not in SUPPORT.devices:
            raise RuntimeError(f"implementation {NAME!r} runs on {list(SUPPORT.devices)}, got the {platform} platform")
        device = jax.devices(platform)[0]
        module = requirements.load_cuda_package(NAME, SUPPORT.requires, PACKAGE,
                                                version_tuple(device.compute_capability)[:2],
                                                f"the {platform} platform ({device.device_kind})")
        check_alignment(NAME, int(module.get_mk_alignment_for_contiguous_layout()), ALIGNMENT)
        _READY[platform] = module
    return _READY[platform]


class Layout:
    """The contiguous layout of the slots (see ``moe_shared.contiguous_layout``), in jnp."""

    def __init__(self, top_k_index, num_experts: int, alignment: int = ALIGNMENT):
        ids = top_k_index.reshape(-1).astype(jnp.int32)
        S, E = ids.shape[0], num_experts
        self.rows = padded_rows(S, E, alignment)
        valid = (ids >= 0) & (ids < E)
        keys = jnp.where(valid, ids, E)
        order = jnp.argsort(keys, stable=True)
        sorted_ids = keys[order]
        first = jnp.searchsorted(sorted_ids, jnp.arange(E + 1, dtype=jnp.int32)).astype(jnp.int32)
        counts = first[1:] - first[:-1]
        sizes = (counts + alignment - 1) // alignment * alignment
        self.starts = jnp.cumsum(sizes, dtype=jnp.int32) - sizes
        expert = jnp.minimum(sorted_ids, E - 1)
        position = jnp.arange(S, dtype=jnp.int32)
        sorted_rows = jnp.where(sorted_ids < E, self.starts[expert] + position - first[expert], self.rows)
        self.slot_rows = jnp.zeros(S, jnp.int32).at[order].set(sorted_rows)
        self.grouped_layout = jnp.full(self.rows, -1, jnp.int32).at[self.slot_rows].set(
            jnp.where(valid, ids, -1), mode="drop")


def _gemm_callback(module: ModuleType, activation: str | None, intermediate: int):
    """The buffer callback (ctx, out, a, w, grouped_layout[, bias]) of one GEMM: ``out`` = a @ w[e].T per row
    (+ bias[e]), through act(g) * u when ``activation`` names one."""

    def callback(ctx, out, a, w, grouped_layout, *bias):
        torch = torch_bridge.torch_module()
        with torch_bridge.on_xla_stream(ctx, out):
            out, a, w, grouped_layout, *bias = (torch.from_dlpack(b) for b in (out, a, w, grouped_layout, *bias))
            d = out if activation is None else a.new_empty(a.shape[0], w.shape[1])
            getattr(module, KERNEL)(a, w, d, grouped_layout)
            if bias:
                experts = grouped_layout.clamp(min=0).long()  # padding rows take expert 0's: never used
                d = d.add_(bias[0][experts]) if activation is None else d + bias[0][experts]
            if activation is not None:
                act = getattr(torch.nn.functional, activation)
                torch.mul(act(d[:, :intermediate]), d[:, intermediate:], out=out)

    return callback


def grouped_gemm(module: ModuleType, a, w, grouped_layout, bias=None, activation: str | None = None):
    """[M, K] rows in the contiguous layout by w [E, N, K] per row's expert -> [M, N] (or [M, N/2] through the
    gated ``activation``); rows marked -1 are undefined."""
    width = w.shape[1] // 2 if activation is not None else w.shape[1]
    if a.shape[0] == 0:
        return jnp.zeros((0, width), a.dtype)
    call = buffer_callback(_gemm_callback(module, activation, width), jax.ShapeDtypeStruct((a.shape[0], width),
                                                                                              a.dtype))
    return call(a, w, grouped_layout, *(() if bias is None else (bias,)))


def _forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation):
    module = runtime(platform_of(gate_up))
    E, H, I = down.shape
    slots = Slots(ids, E)
    layout = Layout(ids, E)
    row_token = jnp.zeros(layout.rows, jnp.int32).at[layout.slot_rows].set(slots.token_of_slot(), mode="drop")
    a = x.astype(gate_up.dtype)[row_token]  # padding rows hold token 0's row: never used
    act = grouped_gemm(module, a, gate_up, layout.grouped_layout, gate_up_bias, activation)
    y = grouped_gemm(module, act, down, layout.grouped_layout, down_bias)
    y = jnp.take(y, layout.slot_rows, axis=0, mode="fill", fill_value=0)  # empty slots: no row
    return combine(y, slots, w, x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def _experts(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation):
    return _forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation)


def _experts_fwd(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation):
    raise SUPPORT.training_error(NAME, load_spec().trainers("jax"))


def _experts_bwd(activation, residuals, dout):
    raise SUPPORT.training_error(NAME, load_spec().trainers("jax"))


_experts.defvjp(_experts_fwd, _experts_bwd)


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    check_kernel_inputs(NAME, SUPPORT, activation, jnp.dtype(gate_up_proj.dtype).name,
                        gate_up_proj.shape, down_proj.shape)
    return _experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                    activation)
