"""triton (JAX): the fused MoE Triton kernels of ``moe_shared.kernels``, the same ones moe_torch launches.

Each step of the shared launch plans (``moe_shared.kernels.plan``) is one custom call into this package's Triton
launcher on XLA's stream (``moe_jax.triton_call``: the cubin moe_torch runs, with the global scratch the kernels'
tensor descriptors need);
the forward, the input gradients and the weight gradients are separate calls inside one ``jax.custom_vjp``. Works
under ``jax.jit``; every size is static there, so the plan (grids, tile configs) is fixed when the program is
traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from moe_shared import load_spec, requirements
from moe_shared.kernels import plan as plans

NAME = "triton"
SUPPORT = load_spec().backends[NAME].support("jax")


@dataclass(frozen=True)
class Launcher:
    """How the plan steps are launched: ``launch(kernel, step, arguments, output ShapeDtypeStructs) -> output
    arrays``, and whether it gives kernels their global scratch (where tensor descriptors are built)."""

    launch: Callable[[object, plans.Step, list, list], list]
    tensor_descriptors: bool = False


def _xla_launch(kernel, step: plans.Step, args: list, out_shapes: list, graphed: bool = False) -> list:
    from moe_jax import triton_call
    target = triton_call.GRAPHED_LAUNCH_TARGET if graphed else triton_call.LAUNCH_TARGET
    return triton_call.launch(kernel, step.grid, args, out_shapes, dict(step.constants), num_warps=step.num_warps,
                              num_stages=step.num_stages, zeroed=step.zeroed, target=target)


def _jaxlib_launch(kernel, step: plans.Step, args: list, out_shapes: list) -> list:
    from moe_jax import triton_call
    return triton_call.launch_jaxlib(kernel, step.grid, args, out_shapes, dict(step.constants),
                                     num_warps=step.num_warps, num_stages=step.num_stages, zeroed=step.zeroed)


XLA_LAUNCHER = Launcher(_xla_launch, tensor_descriptors=True)
"""Each step a custom call into this package's Triton launcher (``moe_jax.triton_call.launch``: the cubin moe_torch
runs, registered once, named by an id), the kernels given their global scratch. (jax_triton's ``triton_call``
gives them a null pointer there: a kernel building a tensor descriptor faults,
tests/device_results/nvidia-h200-triton-descriptors.json, and the pointer loads it leaves cost up to 12%,
mixtral-8x7b T=4096 forward, tests/device_results/nvidia-h100-triton-launchers.json.)"""

GRAPHED_LAUNCHER = Launcher(partial(_xla_launch, graphed=True), tensor_descriptors=True)
"""``XLA_LAUNCHER``'s calls marked command-buffer compatible: XLA may trace them, with the fusions around them,
into a CUDA graph it replays while the buffers' addresses repeat (fewer host launches at decode)."""

JAXLIB_LAUNCHER = Launcher(_jaxlib_launch, tensor_descriptors=True)
"""Each step a custom call into jaxlib's Triton launcher (``moe_jax.triton_call.launch_jaxlib``), with the same
global scratch; kept for comparison."""

_launcher: Launcher = XLA_LAUNCHER


@contextlib.contextmanager
def use_launcher(launcher: Launcher | Callable) -> Iterator[None]:
    """Launch the kernels through ``launcher`` inside the block, a ``Launcher`` or a bare launch function (no
    global scratch: no tensor descriptors); the tests run the kernels under the Triton interpreter this way. The
    default is ``XLA_LAUNCHER``."""
    global _launcher
    previous, _launcher = _launcher, launcher if isinstance(launcher, Launcher) else Launcher(launcher)
    try:
        yield
    finally:
        _launcher = previous


def _kernels():
    requirements.import_required(NAME, SUPPORT.requires, "triton")
    from moe_shared.kernels import moe
    return moe


def _device_name() -> str:
    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else device.platform


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def problem_of(x, top_k_index, gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
               deterministic: bool = True) -> plans.Problem:
    E, H, I = down_proj.shape
    return plans.Problem(
        T=x.shape[0], H=H, I=I, E=E, k=top_k_index.shape[1], activation=activation,
        dtype=jnp.dtype(gate_up_proj.dtype).name, gate_up_strides=_contiguous_strides(gate_up_proj.shape),
        down_strides=_contiguous_strides(down_proj.shape),
        gate_up_bias_stride=None if gate_up_bias is None else gate_up_bias.shape[1],
        down_bias_stride=None if down_bias is None else down_bias.shape[1], device=_device_name(),
        deterministic=deterministic, tma=_launcher.tensor_descriptors)


def run_plan(plan: plans.Plan, env: dict, dtypes: dict | None = None) -> dict:
    """Launch every step of ``plan`` on the arrays of ``env`` (buffer name -> array); returns ``env`` with the
    buffers the steps created. A step with an empty grid (no tokens) gives zeros. ``dtypes`` maps the plan's dtype
    roles to JAX dtypes (default: from the experts inputs in ``env``)."""
    if dtypes is None:
        dtypes = {plans.WEIGHTS: env["gate_up"].dtype, plans.HIDDEN: env["x"].dtype, plans.ROUTING: env["w"].dtype}
    dtypes = {plans.FLOAT32: jnp.float32, plans.INT32: jnp.int32} | dtypes
    kernels = _kernels() if any(step.grid for step in plan.steps) else None
    for step in plan.steps:
        shapes = [jax.ShapeDtypeStruct(b.shape, dtypes[b.dtype]) for b in step.outputs]
        if step.grid:
            args = [env[a] if isinstance(a, str) else a for a in step.inputs]
            outputs = _launcher.launch(getattr(kernels, step.kernel), step, args, shapes)
        else:
            outputs = [jnp.zeros(s.shape, s.dtype) for s in shapes]
        env.update((b.name, out) for b, out in zip(step.outputs, outputs))
    return env


def _inputs(x, ids, w, gate_up, down, gate_up_bias, down_bias) -> dict:
    env = {"x": x, "ids": ids.reshape(-1), "w": w.reshape(-1), "gate_up": gate_up, "down": down}
    if gate_up_bias is not None:
        env["gate_up_bias"] = gate_up_bias
    if down_bias is not None:
        env["down_bias"] = down_bias
    return env


def _run_forward(args, activation: str, training: bool, deterministic: bool = True):
    plan = plans.forward_plan(problem_of(*args[:2], *args[3:], activation, deterministic), training=training)
    env = run_plan(plan, _inputs(*args))
    return env[plan.output].astype(args[0].dtype), tuple(env[n] for n in plan.residuals)


@partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _experts(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, deterministic):
    return _run_forward((x, ids, w, gate_up, down, gate_up_bias, down_bias), activation, training=False,
                        deterministic=deterministic)[0]


def _experts_fwd(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, deterministic):
    args = (x, ids, w, gate_up, down, gate_up_bias, down_bias)
    out, residuals = _run_forward(args, activation, training=True)
    return out, (args, residuals)


def _experts_bwd(activation, deterministic, saved, dout):
    args, residuals = saved
    x, ids, w, gate_up, down, gate_up_bias, down_bias = args
    plan = plans.backward_plan(problem_of(x, ids, gate_up, down, gate_up_bias, down_bias, activation))
    forward = plans.forward_plan(problem_of(x, ids, gate_up, down, gate_up_bias, down_bias, activation),
                                 training=True)
    env = _inputs(*args) | dict(zip(forward.residuals, residuals)) | {"dout": dout}
    env = run_plan(plan, env)
    grads = {arg: env.get(buffer) for arg, buffer in plans.GRADIENTS.items()}
    return (grads["hidden_states"], None, grads["top_k_weights"].reshape(w.shape), grads["gate_up_proj"],
            grads["down_proj"], grads["gate_up_bias"], grads["down_bias"])


_experts.defvjp(_experts_fwd, _experts_bwd)


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None, deterministic=True):
    """The common signature; ``deterministic=False`` as in moe_torch's triton backend (atomic combine, inference
    only: a differentiated forward is always the deterministic one)."""
    SUPPORT.check_activation(NAME, activation)
    return _experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                    activation, deterministic)


# --- a plain grouped matmul: moe_jax grouped_mm's kernel on GPU --------------------------------------------------

def _b_view_strides(w, transpose_w: bool) -> tuple[int, int, int]:
    """(expert, k, n) strides of B[e] as a [K, N] view of w: [E, N, K] when transpose_w, else [E, K, N]."""
    e, first, second = _contiguous_strides(w.shape)
    return (e, second, first) if transpose_w else (e, first, second)


def _grouped_env(a, w, group_sizes) -> dict:
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])
    order = jnp.arange(max(a.shape[0], 1), dtype=jnp.int32)
    return {"a": a, "b": w, "counts": sizes, "starts": starts, "order": order, "x": a, "w": a}


def _grouped_forward(x, w, group_sizes, transpose_w: bool):
    S, K = x.shape
    N = w.shape[1] if transpose_w else w.shape[2]
    plan = plans.grouped_matmul_plan(S, N, K, w.shape[0], _b_view_strides(w, transpose_w), jnp.dtype(w.dtype).name,
                                     _device_name())
    env = run_plan(plan, _grouped_env(x, w, group_sizes), {plans.WEIGHTS: w.dtype})
    return env[plan.output]


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(x, w, group_sizes, transpose_w: bool = True):
    """``x`` [S, K] rows sorted by expert times ``w[e]`` ([E, N, K] transposed, or [E, K, N]) for the row counts
    ``group_sizes`` [E]; rows past their sum are zeros. The Triton grouped GEMM of ``moe_shared.kernels``."""
    return _grouped_forward(x, w, group_sizes, transpose_w)


def _grouped_fwd(x, w, group_sizes, transpose_w):
    return _grouped_forward(x, w, group_sizes, transpose_w), (x, w, group_sizes)


def _grouped_bwd(transpose_w, saved, dy):
    x, w, group_sizes = saved
    dx = _grouped_forward(dy, w, group_sizes, not transpose_w)
    left, right = (dy, x) if transpose_w else (x, dy)
    plan = plans.grouped_matmul_wgrad_plan(x.shape[0], left.shape[1], right.shape[1], w.shape[0],
                                           jnp.dtype(w.dtype).name, _device_name())
    env = _grouped_env(x, w, group_sizes) | {"l": left, "r": right}
    return dx, run_plan(plan, env, {plans.WEIGHTS: w.dtype})[plan.output], None


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)
