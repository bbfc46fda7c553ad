"""SonicMoE's kernel steps composed for the experts contract, written once for both frameworks.

moe_torch's and moe_jax's ``sonicmoe`` backends both run ``forward`` and ``backward`` below on torch tensors (moe_jax
on zero-copy views of XLA's buffers, on XLA's stream), with every buffer allocated by the caller from the tables of
``forward_buffers`` / ``backward_buffers``. So both frameworks launch the same SonicMoE kernels with the same
arguments on the same memory layout, and get the same bits. This module imports neither framework: it only calls
methods of the tensors it is given and the step functions of ``load_steps`` (SonicMoE's, which import torch).

The routing metadata (slots grouped by expert, on the device, no host sync) comes first, from the shared Triton
kernels of ``moe_shared.kernels`` (``plan.sonic_routing_plan``), which each binding launches as it launches the
``triton`` backend's (moe_torch: triton's C launcher; moe_jax: Triton custom calls before the callback): SonicMoE's
own routing step cost 0.14-0.24 ms of host time per call on the H200, three Python-launched Triton kernels. The
steps after it are those of SonicMoE's fixed-top-k layer (``sonicmoe.functional``): the gate/up grouped GEMM with the
token gather and the gated activation fused, the down grouped GEMM, and a per-token weighted sum over the k slots
(no atomics). The weights are passed as they are stored, as strided views: ``gate_up_proj`` [E, 2I, H] is
SonicMoE's concatenated ``w1`` (2I, H, E), ``down_proj`` [E, H, I] its ``w2`` (H, I, E).

Empty slots (-1) and out-of-range ids never reach the kernels: the routing gives such a slot a row of expert 0 and
the routing weight 0, so it adds 0 * (a finite expert output) = exactly zero to its token, exactly zero to every
weight gradient (its activation gradient is scaled by that 0), and its routing-weight gradient is set to zero.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace

from .kernels import plan as kernel_plans

WEIGHTS = "weights"  # dtype role: the experts' dtype
FLOAT32 = "float32"
INT32 = "int32"

ACTIVATIONS = {"silu": "swiglu"}
"""The contract's activation -> SonicMoE's gated activation. Its GeGLU uses the tanh form of GELU (the contract's
is the erf form) and its gated GEMM has no ReGLU, so only silu maps."""

ROUTING = kernel_plans.SONIC_ROUTING
"""The routing metadata SonicMoE's steps read (from ``routing``)."""

RESIDUALS = ROUTING + ("preact",)
"""What the backward reads of the forward: the routing metadata and the pre-activations."""


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: str  # WEIGHTS, FLOAT32 or INT32


def routing_plan(T: int, k: int, E: int) -> kernel_plans.Plan:
    """The shared Triton kernels' plan that gives ``ROUTING`` from ``ids`` and ``w`` [T*k] (``routing``)."""
    return kernel_plans.sonic_routing_plan(T, k, E)


def routing(env: Mapping) -> dict:
    """``ROUTING`` from the buffers of ``routing_plan``'s run (its sort's ``starts`` are SonicMoE's offsets)."""
    return {name: env["starts" if name == "offsets" else name] for name in ROUTING}


def routing_buffers(T: int, k: int, E: int) -> tuple[Buffer, ...]:
    """The ``ROUTING`` buffers ``routing`` gives, in that order."""
    S = T * k
    return (Buffer("scores", (S,), FLOAT32), Buffer("offsets", (E + 1,), INT32), Buffer("x_gather", (S,), INT32),
            Buffer("s_scatter", (S,), INT32), Buffer("s_reverse", (S,), INT32))


def forward_buffers(T: int, H: int, I: int, E: int, k: int, training: bool) -> tuple[Buffer, ...]:
    """Every buffer the forward steps write: ``out`` [T, H] first, then ``preact`` (training), then scratch."""
    S = T * k
    preact = (Buffer("preact", (S, 2 * I), WEIGHTS),) if training else ()
    scratch = (Buffer("postact", (S, I), WEIGHTS), Buffer("slot_out", (S, H), WEIGHTS))
    return (Buffer("out", (T, H), WEIGHTS),) + preact + scratch


GRADIENTS = ("dx", "d_scores", "d_gate_up", "d_down", "d_gate_up_bias", "d_down_bias")


def backward_buffers(T: int, H: int, I: int, E: int, k: int, gate_up_bias: bool,
                     down_bias: bool) -> tuple[Buffer, ...]:
    """Every buffer the backward writes: the gradients (``GRADIENTS`` order, biases only when present; the
    routing-weight gradient ``d_scores`` [T*k] in float32), then scratch."""
    S = T * k
    grads = (Buffer("dx", (T, H), WEIGHTS), Buffer("d_scores", (S,), FLOAT32), Buffer("d_gate_up", (E, 2 * I, H), WEIGHTS),
             Buffer("d_down", (E, H, I), WEIGHTS))
    grads += (Buffer("d_gate_up_bias", (E, 2 * I), WEIGHTS),) if gate_up_bias else ()
    grads += (Buffer("d_down_bias", (E, H), WEIGHTS),) if down_bias else ()
    scratch = (Buffer("d_preact", (S, 2 * I), WEIGHTS), Buffer("postact", (S, I), WEIGHTS),
               Buffer("dx_slots", (S, H), WEIGHTS))
    return grads + scratch


def check_biases(backend: str, rule, intermediate: int, gate_up_bias: bool, down_bias: bool) -> None:
    """ValueError for biases on an I below ``rule["min_I"]`` (the spec's ``biases`` of the backend)."""
    if (gate_up_bias or down_bias) and intermediate < rule["min_I"]:
        arg = "gate_up_bias" if gate_up_bias else "down_bias"
        raise ValueError(f"{arg}: implementation {backend!r} takes biases with I >= {rule['min_I']} (its bias-gradient "
                         f"kernel tiles 2I by at least {2 * rule['min_I']}), got I = {intermediate}")


def beneath_the_op(step):
    """The Python function a torch custom op (``torch.library.custom_op``) was made from, else ``step`` itself.

    SonicMoE registers each step as a custom op. Both bindings call the steps where torch's dispatcher has nothing
    to do: inside moe_torch's own opaque op or its eager path with no autograd, or inside a JAX callback. There the
    op layers (autograd, ADInplaceOrView, the backend's Python wrapper) only add host time: 0.07-0.10 ms per
    qwen3-30b-a3b forward on the H200 (tests/device_results/nvidia-h200-sonicmoe-host-lean.json)."""
    return getattr(step, "_init_fn", step)


def load_steps(kernels: Mapping[str, str], package: str | None = None) -> SimpleNamespace:
    """The step functions named in the spec (``step = "module:function"``), imported, each taken from beneath its
    custom op (``beneath_the_op``); with ``package``, from that package in place of the named modules' top-level
    one (a kernel-hub build of SonicMoE has its own module name). ImportError names every step the package
    lacks."""
    found, missing = {}, []
    for step, where in kernels.items():
        module, _, function = where.partition(":")
        if package is not None:
            module = ".".join([package, *module.split(".")[1:]])
        try:
            found[step] = beneath_the_op(getattr(importlib.import_module(module), function))
        except (ImportError, AttributeError):
            missing.append(f"{module}:{function}")
    if missing:
        raise ImportError(f"implementation 'sonicmoe' composes SonicMoE 0.1.2.post1's steps; "
                          f"{package or 'the installed package'} lacks {', '.join(missing)}: pip install --no-deps "
                          "'sonic-moe==0.1.2.post1'")
    return SimpleNamespace(**found)


def _valid(ids, E: int):
    return (ids >= 0) & (ids < E)


def forward(steps, x, routed: Mapping, k: int, gate_up, down, gate_up_bias, down_bias, buffers: Mapping,
            activation: str) -> None:
    """Fill ``buffers`` (from ``forward_buffers``; ``preact`` present when training). x [T, H] contiguous in the
    weights' dtype, ``routed`` the routing metadata (``routing``) of its T*k slots, weights as stored ([E, 2I, H]
    and [E, H, I], contiguous)."""
    H = down.shape[1]
    if x.shape[0] == 0:
        return
    offsets = routed["offsets"]
    preact = buffers.get("preact")
    steps.up(x, gate_up.permute(1, 2, 0), preact, buffers["postact"], gate_up_bias, offsets, routed["x_gather"],
             ACTIVATIONS[activation], preact is None, True)
    steps.down(down.permute(1, 2, 0), buffers["postact"], buffers["slot_out"], down_bias, offsets)
    steps.combine(buffers["slot_out"], buffers["out"], routed["scores"], routed["s_reverse"], None, k, H, False)


def backward(steps, dout, x, ids, gate_up, down, gate_up_bias, down_bias, residuals: Mapping, buffers: Mapping,
             activation: str) -> None:
    """Fill ``buffers`` (from ``backward_buffers``) with the gradients for ``dout`` [T, H] (contiguous, the weights'
    dtype), from the forward's ``residuals``."""
    T, k = ids.shape
    E, H, _ = down.shape
    if T == 0:
        for name in GRADIENTS:
            if name in buffers:
                buffers[name].zero_()
        return
    w1, w2 = gate_up.permute(1, 2, 0), down.permute(1, 2, 0)
    offsets, x_gather = residuals["offsets"], residuals["x_gather"]
    steps.down_backward(dout, residuals["preact"], w2, buffers["d_preact"], buffers["d_scores"], down_bias,
                        buffers.get("d_down_bias"), buffers["postact"], residuals["scores"], offsets, x_gather,
                        residuals["s_scatter"], ACTIVATIONS[activation])
    steps.down_backward_weight(dout, buffers["postact"], buffers["d_down"].permute(1, 2, 0), offsets, x_gather)
    steps.up_backward(w1, buffers["dx_slots"], buffers["d_preact"], buffers.get("d_gate_up_bias"), offsets, True,
                      True)
    steps.up_backward_weight(x, buffers["d_gate_up"].permute(1, 2, 0), buffers["d_preact"], offsets, x_gather, True,
                             True)
    steps.token_sum(buffers["dx"], buffers["dx_slots"], residuals["s_reverse"], None, k, H, False)
    buffers["d_scores"].masked_fill_(~_valid(ids, E).reshape(-1), 0)
