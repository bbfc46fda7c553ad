"""sonicmoe: SonicMoE's CuTe DSL grouped GEMMs (PyPI sonic-moe with quack-kernels), forward and backward.

Runs ``moe_shared.sonic_steps`` (the composition of SonicMoE's kernel steps that moe_jax's ``sonicmoe`` runs too)
on buffers allocated here: routing metadata on the device (the shared Triton kernels, launched as the ``triton``
backend launches them), the gate/up GEMM with the token gather and SwiGLU fused, the down GEMM, a per-token
weighted sum; the backward gives the gradients of the hidden states, the routing weights,
both weight tensors and the biases. The weights are read as stored (``gate_up_proj`` [E, 2I, H] is SonicMoE's
concatenated layout): no per-call weight copy. The forward and backward are custom ops with fake implementations,
so ``torch.compile(fullgraph=True)`` takes them as opaque ops (SonicMoE's own layer functions refuse to be
compiled). quack autotunes and compiles its GEMMs at the first call of each shape (seconds to tens of seconds).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moe_shared import load_spec, requirements, sonic_steps
from moe_shared.contract import check_kernel_inputs

from ..base import dtype_name, op_free_training
from . import triton as triton_kernels

NAME = "sonicmoe"
PACKAGE = "sonicmoe"
SUPPORT = load_spec().backends[NAME].support("torch")

_DTYPES = {sonic_steps.FLOAT32: torch.float32, sonic_steps.INT32: torch.int32}
_READY: dict[torch.device, SimpleNamespace] = {}


def runtime(device: torch.device) -> SimpleNamespace:
    """SonicMoE's step functions, once every requirement holds for ``device`` (the first call raises what is
    missing: RuntimeError for the device, ImportError for the packages)."""
    if device not in _READY:
        if device.type != "cuda":
            raise RuntimeError(f"implementation {NAME!r} runs on {list(SUPPORT.devices)}, got a tensor on {device}")
        module = requirements.load_cuda_package(NAME, SUPPORT.requires, PACKAGE,
                                                torch.cuda.get_device_capability(device), f"a tensor on {device}")
        _READY[device] = sonic_steps.load_steps(SUPPORT.details["kernels"], module.__name__)
    return _READY[device]


def _allocate(buffers, weights_dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    dtypes = _DTYPES | {sonic_steps.WEIGHTS: weights_dtype}
    return {b.name: torch.empty(b.shape, dtype=dtypes[b.dtype], device=device) for b in buffers}


def _forward_buffers(x, ids, down, training: bool):
    E, H, I = down.shape
    return sonic_steps.forward_buffers(x.shape[0], H, I, E, ids.shape[1], training)


def _routing(ids, w, num_experts: int) -> dict[str, torch.Tensor]:
    T, k = ids.shape
    env = triton_kernels.run_plan(sonic_steps.routing_plan(T, k, num_experts),
                                  {"ids": ids.reshape(-1).contiguous(), "w": w.reshape(-1).contiguous()}, {})
    return sonic_steps.routing(env)


def _forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, training) -> dict[str, torch.Tensor]:
    """The forward's buffers (``sonic_steps.forward_buffers``) and the routing metadata (``sonic_steps.ROUTING``)."""
    routed = _routing(ids, w, down.shape[0])
    buffers = _allocate(_forward_buffers(x, ids, down, training), gate_up.dtype, x.device)
    sonic_steps.forward(runtime(x.device), x, routed, ids.shape[1], gate_up, down, gate_up_bias, down_bias, buffers,
                        activation)
    return buffers | routed


@torch.library.custom_op("moe_torch::sonicmoe_experts", mutates_args=())
def sonicmoe_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                     activation: str) -> torch.Tensor:
    """The inference forward: [T, H] in the weights' dtype."""
    return _forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, training=False)["out"]


@sonicmoe_experts.register_fake
def _(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation):
    return x.new_empty(x.shape[0], down.shape[1])


def _training_forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation) -> list[torch.Tensor]:
    buffers = _forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, training=True)
    return [buffers["out"]] + [buffers[n] for n in sonic_steps.RESIDUALS]


@torch.library.custom_op("moe_torch::sonicmoe_experts_train", mutates_args=())
def sonicmoe_experts_train(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                           down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                           activation: str) -> list[torch.Tensor]:
    """The training forward: the output, then the residuals the backward reads (``sonic_steps.RESIDUALS``)."""
    return _training_forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation)


def _fakes(buffers, names, weights_dtype, device):
    dtypes = _DTYPES | {sonic_steps.WEIGHTS: weights_dtype}
    found = {b.name: b for b in buffers}
    return [torch.empty(found[n].shape, dtype=dtypes[found[n].dtype], device=device) for n in names if n in found]


@sonicmoe_experts_train.register_fake
def _(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation):
    buffers = _forward_buffers(x, ids, down, True) + sonic_steps.routing_buffers(*ids.shape, down.shape[0])
    return _fakes(buffers, ("out",) + sonic_steps.RESIDUALS, gate_up.dtype, x.device)


def _backward_buffers(x, ids, down, gate_up_bias, down_bias):
    E, H, I = down.shape
    return sonic_steps.backward_buffers(x.shape[0], H, I, E, ids.shape[1], gate_up_bias is not None,
                                        down_bias is not None)


@torch.library.custom_op("moe_torch::sonicmoe_experts_backward", mutates_args=())
def sonicmoe_experts_backward(dout: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                              down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                              residuals: list[torch.Tensor], activation: str) -> list[torch.Tensor]:
    """The gradients of ``sonic_steps.GRADIENTS`` (biases only when present)."""
    return _backward_gradients(dout, x, ids, gate_up, down, gate_up_bias, down_bias, residuals, activation)


def _backward_gradients(dout, x, ids, gate_up, down, gate_up_bias, down_bias, residuals, activation):
    buffers = _allocate(_backward_buffers(x, ids, down, gate_up_bias, down_bias), gate_up.dtype, x.device)
    sonic_steps.backward(runtime(x.device), dout.to(gate_up.dtype).contiguous(), x, ids, gate_up, down, gate_up_bias,
                         down_bias, dict(zip(sonic_steps.RESIDUALS, residuals)), buffers, activation)
    return [buffers[n] for n in sonic_steps.GRADIENTS if n in buffers]


@sonicmoe_experts_backward.register_fake
def _(dout, x, ids, gate_up, down, gate_up_bias, down_bias, residuals, activation):
    return _fakes(_backward_buffers(x, ids, down, gate_up_bias, down_bias), sonic_steps.GRADIENTS, gate_up.dtype,
                  x.device)


def _setup_context(ctx, inputs, output):
    x, ids, w, gate_up, down, gate_up_bias, down_bias, activation = inputs
    ctx.activation = activation
    ctx.has_bias = (gate_up_bias is not None, down_bias is not None)
    ctx.w = (w.shape, w.dtype)
    ctx.save_for_backward(x, ids, gate_up, down, gate_up_bias, down_bias, *output[1:])


def _backward(ctx, grads):
    return _input_gradients(ctx, grads[0], sonicmoe_experts_backward)


def _input_gradients(ctx, dout, backward):
    """The gradients of the op's inputs from ``backward`` (the backward op, or its function in eager mode)."""
    x, ids, gate_up, down, gate_up_bias, down_bias, *residuals = ctx.saved_tensors
    dx, d_scores, d_gate_up, d_down, *bias_grads = backward(
        dout, x, ids, gate_up, down, gate_up_bias, down_bias, residuals, ctx.activation)
    d_gate_up_bias = bias_grads.pop(0) if ctx.has_bias[0] else None
    d_down_bias = bias_grads.pop(0) if ctx.has_bias[1] else None
    shape, dtype = ctx.w
    return dx, None, d_scores.view(shape).to(dtype), d_gate_up, d_down, d_gate_up_bias, d_down_bias, None


sonicmoe_experts_train.register_autograd(_backward, setup_context=_setup_context)


_EagerTraining = op_free_training(_training_forward, _setup_context,
                                  lambda ctx, dout: _input_gradients(ctx, dout, _backward_gradients))
"""Training in eager mode: the training ops' functions without the op dispatch."""


def check_inputs(gate_up_proj, down_proj, gate_up_bias, down_bias, activation) -> None:
    """What SonicMoE's kernels cannot take raises ValueError before any work: the activation, the weights' dtype,
    H and I (multiples of 8), biases on a small I."""
    check_kernel_inputs(NAME, SUPPORT, activation, dtype_name(gate_up_proj.dtype),
                        gate_up_proj.shape, down_proj.shape)
    sonic_steps.check_biases(NAME, SUPPORT.details["biases"], down_proj.shape[2], gate_up_bias is not None,
                             down_bias is not None)


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    check_inputs(gate_up_proj, down_proj, gate_up_bias, down_bias, activation)
    if not torch.compiler.is_compiling():  # compiled, the custom op checks when it first runs
        runtime(gate_up_proj.device)
    args = (hidden_states.to(gate_up_proj.dtype).contiguous(), top_k_index, top_k_weights,
            gate_up_proj.contiguous(), down_proj.contiguous(),
            None if gate_up_bias is None else gate_up_bias.contiguous(),
            None if down_bias is None else down_bias.contiguous())
    compiling = torch.compiler.is_compiling()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        if compiling:
            return sonicmoe_experts_train(*args, activation)[0].to(hidden_states.dtype)
        return _EagerTraining.apply(*args, activation).to(hidden_states.dtype)
    if compiling:
        return sonicmoe_experts(*args, activation).to(hidden_states.dtype)
    return _forward(*args, activation, training=False)["out"].to(hidden_states.dtype)  # eager: no op dispatch
