"""triton: the fused MoE Triton kernels of ``moe_shared.kernels`` (the same ones moe_jax launches), as torch custom ops
under torch.compile and as plain functions (an autograd.Function for training) in eager mode: the same kernels.

The forward and backward run the shared launch plans (``moe_shared.kernels.plan``): a stable counting sort of the
slots by expert on the device, the gate/up grouped GEMM with the token gather and the activation fused, the down
grouped GEMM, and a deterministic per-token combine; a few slots at inference take the decode kernels (one GEMV
per slot, the down projection and the combine fused). No host sync and a grid fixed by the shapes, so
``torch.compile(fullgraph=True)`` and CUDA graphs take it as one opaque op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from operator import itemgetter

import torch
from torch._subclasses.fake_tensor import FakeTensor

from moe_shared import load_spec
from moe_shared.kernels import plan as plans

NAME = "triton"
SUPPORT = load_spec().backends[NAME].support("torch")

_DTYPE_ROLES = {"float32": torch.float32, "int32": torch.int32}


def _kernels():
    from moe_shared.kernels import moe  # imports triton
    return moe


@cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def tensor_descriptors_allowed(*weights: torch.Tensor) -> bool:
    """Whether the kernels may read these weights through tensor descriptors: on CUDA, 16-byte aligned (their
    workspace comes from torch's allocator, ``run_plan``). While tracing (fake tensors, no address) no: the fake
    implementations only read the plans' buffers, which do not depend on it."""
    if torch.compiler.is_compiling() or any(isinstance(w, FakeTensor) for w in weights):
        return False
    return all(w.device.type == "cuda" and w.data_ptr() % 16 == 0 for w in weights)


def _descriptor_workspace(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def problem_of(x, top_k_index, gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
               deterministic: bool = True) -> plans.Problem:
    E, H, I = down_proj.shape
    return plans.Problem(
        T=x.shape[0], H=H, I=I, E=E, k=top_k_index.shape[1], activation=activation,
        dtype=str(gate_up_proj.dtype).removeprefix("torch."),
        gate_up_strides=tuple(gate_up_proj.stride()), down_strides=tuple(down_proj.stride()),
        gate_up_bias_stride=None if gate_up_bias is None else gate_up_bias.stride(0),
        down_bias_stride=None if down_bias is None else down_bias.stride(0),
        device=_device_name(x.device), deterministic=deterministic,
        tma=tensor_descriptors_allowed(gate_up_proj, down_proj))


def _dtypes(env) -> dict:
    return _DTYPE_ROLES | {plans.WEIGHTS: env["gate_up"].dtype, plans.HIDDEN: env["x"].dtype,
                           plans.ROUTING: env["w"].dtype}


def run_plan(plan: plans.Plan, env: dict[str, torch.Tensor], dtypes: dict | None = None,
             launched: list | None = None) -> dict[str, torch.Tensor]:
    """Launch every step of ``plan`` on the tensors of ``env`` (buffer name -> tensor); returns ``env`` with the
    buffers the steps created. A step with an empty grid (no tokens) leaves its outputs as zeros. ``dtypes`` maps
    the plan's dtype roles to torch dtypes (default: from the experts inputs in ``env``). ``launched`` gets what
    ``_launch`` returned for each step it launched, in order."""
    dtypes = _DTYPE_ROLES | (_dtypes(env) if dtypes is None else dtypes)
    device = next(iter(env.values())).device
    kernels = _kernels() if any(step.grid for step in plan.steps) else None
    if any(plans.makes_tensor_descriptors(step) for step in plan.steps):
        import triton
        triton.set_allocator(_descriptor_workspace)  # a context variable: set in the thread that launches
    where = _launch_place(device) if kernels is not None else None
    for step in plan.steps:
        outputs = step_outputs(step, dtypes, device)
        if step.grid:
            used = _launch(getattr(kernels, step.kernel), step,
                           [env[a] if isinstance(a, str) else a for a in step.inputs] + outputs, where)
            if launched is not None:
                launched.append(used)
        env.update((b.name, t) for b, t in zip(step.outputs, outputs))
    return env


def step_outputs(step: plans.Step, dtypes: dict, device: torch.device) -> list[torch.Tensor]:
    """A plan step's output buffers: zeros where the step asks for them or launches nothing, else uninitialised."""
    return [(torch.zeros if (i in step.zeroed or not step.grid) else torch.empty)(
        b.shape, dtype=dtypes[b.dtype], device=device) for i, b in enumerate(step.outputs)]


def _launch_place(device: torch.device) -> tuple[int, int | None]:
    """(the current CUDA device, the raw stream of ``device`` when the steps may skip triton's launch wrapper, else
    None): the wrapper is kept for tensors on another device than the current one, and while triton's launch hooks
    are set (a profiler reads them)."""
    if device.type != "cuda":
        return -1, None
    runtime = _triton_runtime()
    # torch.cuda.current_device() less its initialisation check (a tensor on CUDA means CUDA is initialised)
    current = torch._C._cuda_getDevice()
    direct = device.index == current and not (_hook_set(runtime.launch_enter_hook)
                                              or _hook_set(runtime.launch_exit_hook))
    return current, torch._C._cuda_getCurrentRawStream(current) if direct else None


@cache
def _triton_runtime():
    from triton import knobs
    return knobs.runtime


def _hook_set(hook) -> bool:
    """Whether a triton launch hook does anything: None, or a chain of hooks (triton 3.6) with none in it, does not."""
    return hook is not None and bool(getattr(hook, "calls", True))


_LAUNCHED: dict[int, tuple] = {}
"""id(step) -> (step, its constant arguments in the kernel's order, {argument key: (compiled kernel, its direct
launch or None)})."""
_MAX_LAUNCHED = 4096


def _launch(kernel, step: plans.Step, args: list, where: tuple[int, int | None]) -> tuple | None:
    """Launch one plan step; returns (its direct launch or None, its constant arguments), None under the
    interpreter. The first launch for a step and a kind of arguments goes through triton's
    ``JITFunction`` (which binds and specializes every argument, compiling if needed); later ones launch the
    compiled kernel it returned directly, through triton's C launcher where ``where`` gives a stream
    (``_direct_launch``), given the tensors' addresses. The key holds what triton specializes on, each tensor's
    dtype and base address modulo 16 and each integer's value, whether each tensor is on CUDA (a host address
    goes to triton's wrapper, which refuses it) and the current device (a compiled kernel is loaded on one)."""
    entry = _LAUNCHED.get(id(step))
    current, stream = where
    values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]  # each tensor's address
    key = (current, *((a.dtype, v % 16, a.is_cuda) if isinstance(a, torch.Tensor) else a for a, v in zip(args, values)))
    launched = entry[2].get(key) if entry is not None and entry[0] is step else None
    if launched is None:
        compiled = kernel[(step.grid,)](*args, num_warps=step.num_warps, num_stages=step.num_stages,
                                        **step.constants)
        if not hasattr(compiled, "function"):  # the interpreter returns no CompiledKernel
            return None
        if entry is None or entry[0] is not step:
            if len(_LAUNCHED) >= _MAX_LAUNCHED:
                _LAUNCHED.clear()
            defaults = {p.name: p.default for p in kernel.params}
            constants = [step.constants.get(n, defaults[n]) for n in kernel.arg_names[len(args):]]
            entry = _LAUNCHED[id(step)] = (step, constants, {})
        launched = entry[2][key] = (compiled, _direct_launch(compiled))
        return launched[1], entry[1]
    compiled, direct = launched
    if direct is not None and stream is not None:  # addresses: the C launcher asks the driver about each tensor
        direct(step.grid, stream, values, entry[1])
    else:
        compiled[(step.grid, 1, 1)](*args, *entry[1])
    return direct, entry[1]


def _direct_launch(compiled):
    """A launch of ``compiled`` through triton's C launcher with the arguments ``compiled[grid](...)`` would give
    it (no launch metadata or hooks), or None for a kernel that takes a profile scratch buffer. A kernel that builds
    tensor descriptors on the device gets its global scratch (programs x its bytes per program) from torch's
    allocator, as ``_descriptor_workspace`` gives it to triton's wrapper."""
    run = compiled.run
    if run.profile_scratch_size:
        return None
    launch, function, packed = run.launch, compiled.function, compiled.packed_metadata
    cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
    scratch_per_program = run.global_scratch_size * run.num_ctas

    if not scratch_per_program:
        def direct(grid: int, stream: int, args: list, constants: list) -> None:
            launch(grid, 1, 1, stream, function, cooperative, pdl, None, None, packed, None, None, None, *args,
                   *constants)
        return direct

    align = run.global_scratch_align

    def direct_with_scratch(grid: int, stream: int, args: list, constants: list) -> None:
        scratch = _descriptor_workspace(grid * scratch_per_program, align, stream)
        launch(grid, 1, 1, stream, function, cooperative, pdl, scratch, None, packed, None, None, None, *args,
               *constants)

    return direct_with_scratch


# --- eager inference: a plan bound to its compiled kernels and one workspace -----------------------------------------

CALL_INPUTS = ("x", "ids", "w", "gate_up", "down", "gate_up_bias", "down_bias")
"""The buffer names of a call's tensors (``_inputs``), in the order ``_Bound.run`` takes them."""
WORKSPACE_ALIGN = 256  # bytes: each buffer of the workspace starts at a multiple (triton specializes on 16)


@dataclass(frozen=True)
class _Bound:
    """A plan ready to launch from its call's pointers: every step's direct launch (``_direct_launch``) and
    constants, and its arguments as picked from the call's values (``values``: the addresses of the tensors the
    call gives, in the order it was bound with, each output's, each workspace buffer's, then the plan's integers).
    The outputs are allocated apart (they are returned); every other buffer the steps make lies in one workspace
    at ``offsets`` (bytes), so that a call allocates once per output and once more, and passes addresses, which
    triton's C launcher takes without asking the driver about each tensor."""

    launches: tuple[tuple, ...]  # (direct launch, grid, values -> its arguments, constants) per step
    workspace: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (name, shape, dtype) of each workspace buffer
    offsets: tuple[int, ...]  # byte offset of each workspace buffer, in the order of ``workspace``
    workspace_bytes: int
    outputs: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]  # (shape, dtype, starts as zeros) of each output
    integers: tuple[int, ...]

    def values(self, pointers: list[int], outputs: list[int], workspace: int) -> list[int]:
        return [*pointers, *outputs, *(workspace + o for o in self.offsets), *self.integers]

    def run(self, pointers: list[int], device: torch.device, stream: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The outputs and the workspace of one call given its tensors' addresses (``pointers``)."""
        outs = [(torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
                for shape, dtype, zeroed in self.outputs]
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
        values = self.values(pointers, [o.data_ptr() for o in outs], workspace.data_ptr())
        for launch, grid, arguments, constants in self.launches:
            launch(grid, stream, arguments(values), constants)
        return outs, workspace

    @cached_property
    def _buffers(self) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
        """name -> (shape, dtype, byte offset) of each workspace buffer."""
        return {name: (shape, dtype, offset) for (name, shape, dtype), offset in zip(self.workspace, self.offsets)}

    def addresses(self, names: tuple[str, ...], workspace: int) -> list[int]:
        """The addresses of these workspace buffers in a workspace at ``workspace``."""
        return [workspace + self._buffers[name][2] for name in names]

    def views(self, names: tuple[str, ...], workspace: torch.Tensor) -> list[torch.Tensor]:
        """These workspace buffers as tensors over ``workspace``."""
        views = []
        for shape, dtype, offset in (self._buffers[name] for name in names):
            views.append(workspace[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
        return views


def _bind(plan: plans.Plan, launched: list, dtypes: dict, inputs: tuple[str, ...] | None = None,
          outputs: tuple[str, ...] | None = None) -> _Bound | None:
    """``plan`` bound to the launches ``run_plan`` made of it (``launched``), taking the addresses of the buffers
    ``inputs`` (default ``CALL_INPUTS``) and allocating ``outputs`` (default the plan's output) apart; or None where
    a call cannot run it from addresses: a step without a direct launch or with an empty grid, or a workspace buffer
    that must start as zeros."""
    inputs = CALL_INPUTS if inputs is None else inputs
    outputs = (plan.output,) if outputs is None else outputs
    if len(launched) != len(plan.steps) or any(used is None or used[0] is None for used in launched):
        return None
    zeroed = {step.outputs[i].name for step in plan.steps for i in step.zeroed}
    if zeroed - set(outputs):
        return None
    names = list(inputs) + list(outputs)
    workspace, offsets, size = [], [], 0
    for buffer in {b.name: b for step in plan.steps for b in step.outputs if b.name not in names}.values():
        names.append(buffer.name)
        workspace.append((buffer.name, buffer.shape, dtypes[buffer.dtype]))
        offsets.append(size)
        nbytes = math.prod(buffer.shape) * dtypes[buffer.dtype].itemsize
        size += -(-nbytes // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
    integers = sorted({a for step in plan.steps for a in step.inputs if not isinstance(a, str)})
    index = {n: i for i, n in enumerate(names)} | {("int", v): len(names) + i for i, v in enumerate(integers)}
    launches = tuple(
        (direct, step.grid, _getter([index[a if isinstance(a, str) else ("int", a)] for a in step.inputs]
                                    + [index[b.name] for b in step.outputs]), constants)
        for step, (direct, constants) in zip(plan.steps, launched))
    made = tuple((plan.buffers[n].shape, dtypes[plan.buffers[n].dtype], n in zeroed) for n in outputs)
    return _Bound(launches, tuple(workspace), tuple(offsets), max(size, 1), made, tuple(integers))


def _getter(indices: list[int]) -> Callable[[list], tuple]:
    """values -> the tuple of values at ``indices``."""
    return itemgetter(*indices) if len(indices) > 1 else (lambda values: (values[indices[0]],))


_BOUND: dict[tuple, _Bound | None] = {}
"""A call's key (``_call_key``) -> its bound plan, or None where it runs through ``run_plan``."""
_MAX_BOUND = 1024


def _call_key(tensors: tuple, activation: str, deterministic: bool, current: int) -> tuple:
    """What a call's plan and its kernels' specialization depend on: each tensor's shape, strides, dtype, device
    and address modulo 16 (the weights' strides and alignment pick tiles and descriptors; triton specializes
    pointers on 16-byte alignment), the options and the current device."""
    x, ids, w, gate_up, down, gate_up_bias, down_bias = tensors
    return (activation, deterministic, current, _layout(x), _layout(ids), _layout(w), _layout(gate_up),
            _layout(down), None if gate_up_bias is None else _layout(gate_up_bias),
            None if down_bias is None else _layout(down_bias))


def _pointers(tensors) -> list[int]:
    return [0 if t is None else t.data_ptr() for t in tensors]


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16


def _inputs(x, ids, w, gate_up, down, gate_up_bias, down_bias) -> dict[str, torch.Tensor]:
    # the slots' ids and weights as [T*k] with a unit stride (reshape keeps a strided view where it can)
    env = {"x": x, "ids": ids.reshape(-1).contiguous(), "w": w.reshape(-1).contiguous(), "gate_up": gate_up,
           "down": down}
    if gate_up_bias is not None:
        env["gate_up_bias"] = gate_up_bias
    if down_bias is not None:
        env["down_bias"] = down_bias
    return env


def _run_keyed(key: tuple | None, stream: int | None, device: torch.device, pointers: Callable[[], list[int]],
               make: Callable[[], tuple], inputs: tuple[str, ...] | None = None,
               outputs: Callable[[plans.Plan], tuple[str, ...]] | None = None) -> tuple:
    """A call through its bound plan where ``key`` has one: (its outputs, its workspace, the bound plan, None), its
    addresses from ``pointers()``. Otherwise ``make()`` gives (the plan, its env), run through ``run_plan`` and
    bound for the key's next calls (where ``key`` is not None): (the outputs, None, None, the env). ``inputs``
    and ``outputs`` (of the plan; default its output) are what ``_bind`` takes."""
    bound = _BOUND.get(key) if key is not None else None
    if bound is not None:
        outs, workspace = bound.run(pointers(), device, stream)
        return outs, workspace, bound, None
    plan, env = make()
    names = (plan.output,) if outputs is None else outputs(plan)
    launched = [] if key is not None and key not in _BOUND and all(step.grid for step in plan.steps) else None
    env = run_plan(plan, env, launched=launched)
    if launched is not None:
        if len(_BOUND) >= _MAX_BOUND:
            _BOUND.clear()
        _BOUND[key] = _bind(plan, launched, _DTYPE_ROLES | _dtypes(env), inputs, names)
    return [env[n] for n in names], None, None, env


def _inference(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, deterministic):
    """The inference forward. On CUDA, launching directly, a call of a key seen before runs its bound plan
    (``_Bound``); the first runs the plan through ``run_plan`` and binds what it launched."""
    ids, w = ids.contiguous(), w.contiguous()
    tensors = (x, ids, w, gate_up, down, gate_up_bias, down_bias)
    current, stream = _launch_place(x.device)
    key = None
    if stream is not None and not torch.compiler.is_compiling():
        key = _call_key(tensors, activation, deterministic, current)

    def make():
        problem = problem_of(x, ids, gate_up, down, gate_up_bias, down_bias, activation, deterministic)
        return plans.forward_plan(problem), _inputs(*tensors)

    (out,), *_ = _run_keyed(key, stream, x.device, lambda: _pointers(tensors), make)
    return out if out.dtype == x.dtype else out.to(x.dtype)


@torch.library.custom_op("moe_torch::triton_experts", mutates_args=())
def triton_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                   activation: str, deterministic: bool) -> torch.Tensor:
    """The inference forward: [T, H] in x's dtype."""
    return _inference(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, deterministic)


@triton_experts.register_fake
def _(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation, deterministic):
    return x.new_empty(x.shape[0], down.shape[1])


_RESIDUALS = plans.TRAINING_RESIDUALS


def _training_forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation) -> list[torch.Tensor]:
    """The training forward: the output, then the residuals the backward reads (``_RESIDUALS``)."""
    plan = plans.forward_plan(problem_of(x, ids, gate_up, down, gate_up_bias, down_bias, activation), training=True)
    env = run_plan(plan, _inputs(x, ids, w, gate_up, down, gate_up_bias, down_bias))
    return [env[plan.output]] + [env[name] for name in _RESIDUALS]


@torch.library.custom_op("moe_torch::triton_experts_train", mutates_args=())
def triton_experts_train(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                         activation: str) -> list[torch.Tensor]:
    """The training forward as an op (what torch.compile traces): the output, then the residuals."""
    return _training_forward(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation)


def _fake_buffers(plan, names, dtypes, device):
    return [torch.empty(plan.buffers[n].shape, dtype=dtypes[plan.buffers[n].dtype], device=device) for n in names]


@triton_experts_train.register_fake
def _(x, ids, w, gate_up, down, gate_up_bias, down_bias, activation):
    plan = plans.forward_plan(problem_of(x, ids, gate_up, down, gate_up_bias, down_bias, activation), training=True)
    dtypes = _dtypes({"x": x, "w": w, "gate_up": gate_up})
    return _fake_buffers(plan, (plan.output,) + _RESIDUALS, dtypes, x.device)


_GRADIENTS = ("dx", "dw", "d_gate_up", "d_down", "d_gate_up_bias", "d_down_bias")


def _backward_gradients(dout, x, ids, w, gate_up, down, gate_up_bias, down_bias, residuals,
                        activation) -> list[torch.Tensor]:
    """Gradients of x, the routing weights, both weights and the biases present (in ``_GRADIENTS`` order)."""
    problem = problem_of(x, ids, gate_up, down, gate_up_bias, down_bias, activation)
    env = _inputs(x, ids, w, gate_up, down, gate_up_bias, down_bias) | dict(zip(_RESIDUALS, residuals))
    env["dout"] = dout.contiguous()
    env = run_plan(plans.backward_plan(problem), env)
    return [env[n] for n in _GRADIENTS if n in env]


@torch.library.custom_op("moe_torch::triton_experts_backward", mutates_args=())
def triton_experts_backward(dout: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                            gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None,
                            down_bias: torch.Tensor | None, residuals: list[torch.Tensor],
                            activation: str) -> list[torch.Tensor]:
    """The backward as an op (what torch.compile traces)."""
    return _backward_gradients(dout, x, ids, w, gate_up, down, gate_up_bias, down_bias, residuals, activation)


@triton_experts_backward.register_fake
def _(dout, x, ids, w, gate_up, down, gate_up_bias, down_bias, residuals, activation):
    plan = plans.backward_plan(problem_of(x, ids, gate_up, down, gate_up_bias, down_bias, activation))
    dtypes = _dtypes({"x": x, "w": w, "gate_up": gate_up})
    return _fake_buffers(plan, [n for n in _GRADIENTS if n in plan.buffers], dtypes, x.device)


def _setup_context(ctx, inputs, output):
    x, ids, w, gate_up, down, gate_up_bias, down_bias, activation = inputs
    ctx.activation = activation
    ctx.has_bias = (gate_up_bias is not None, down_bias is not None)
    # the residual outputs never reach the user: no zero-filled gradients for them ([S, 2I], [S, I], [S, H])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, ids, w, gate_up, down, gate_up_bias, down_bias, *output[1:])


def _input_gradients(ctx, dout, backward):
    x, ids, w, gate_up, down, gate_up_bias, down_bias, *residuals = ctx.saved_tensors
    dx, dw, d_gate_up, d_down, *bias_grads = backward(
        dout, x, ids, w, gate_up, down, gate_up_bias, down_bias, residuals, ctx.activation)
    d_gate_up_bias = bias_grads.pop(0) if ctx.has_bias[0] else None
    d_down_bias = bias_grads.pop(0) if ctx.has_bias[1] else None
    return dx, None, dw.view(w.shape), d_gate_up, d_down, d_gate_up_bias, d_down_bias, None


triton_experts_train.register_autograd(lambda ctx, grads: _input_gradients(ctx, grads[0], triton_experts_backward),
                                       setup_context=_setup_context)


_BACKWARD_INPUTS = CALL_INPUTS + ("dout",) + _RESIDUALS
"""The buffer names of a bound backward's addresses, in order: the call's tensors, the output's gradient, the
training forward's residuals."""


def _eager_training_forward(tensors: tuple, activation: str) -> tuple:
    """The training forward in eager mode: (the output, what the backward reads, the bound plan that ran or None,
    the call's key or None). On CUDA, launching directly, a key seen before runs its bound plan, which keeps the
    residuals in its workspace (what the backward reads is then that workspace); the first runs the plan and
    binds it."""
    x, ids, w, gate_up, down, gate_up_bias, down_bias = tensors
    current, stream = _launch_place(x.device)
    key = None if stream is None else ("train", _call_key(tensors, activation, True, current))

    def make():
        problem = problem_of(x, ids, gate_up, down, gate_up_bias, down_bias, activation)
        return plans.forward_plan(problem, training=True), _inputs(*tensors)

    (out,), workspace, bound, env = _run_keyed(key, stream, x.device, lambda: _pointers(tensors), make)
    return out, (workspace,) if bound else tuple(env[n] for n in _RESIDUALS), bound, key


def _eager_backward(tensors: tuple, kept: tuple, forward: _Bound | None, forward_key: tuple | None,
                    dout: torch.Tensor, activation: str) -> list[torch.Tensor]:
    """The gradients (in ``_GRADIENTS`` order, the biases' where present) from what ``_eager_training_forward``
    gave; on CUDA a backward of a key seen before runs its bound plan, given the residuals' addresses (in the
    forward's workspace, or the residual tensors')."""
    x, ids, w, gate_up, down, gate_up_bias, down_bias = tensors
    dout = dout.contiguous()
    current, stream = _launch_place(x.device)
    key = None if stream is None or forward_key is None else ("backward", forward_key, _layout(dout))

    def pointers():
        residuals = forward.addresses(_RESIDUALS, kept[0].data_ptr()) if forward else _pointers(kept)
        return _pointers(tensors) + [dout.data_ptr()] + residuals

    def make():
        plan = plans.backward_plan(problem_of(x, ids, gate_up, down, gate_up_bias, down_bias, activation))
        residuals = forward.views(_RESIDUALS, kept[0]) if forward else kept
        return plan, _inputs(*tensors) | dict(zip(_RESIDUALS, residuals)) | {"dout": dout}

    grads, *_ = _run_keyed(key, stream, x.device, pointers, make, _BACKWARD_INPUTS,
                           lambda plan: tuple(n for n in _GRADIENTS if n in plan.buffers))
    return grads


class _EagerTraining(torch.autograd.Function):
    """Training in eager mode: the training plans without the op dispatch, and from a call's second key on, run
    bound (``_Bound``): the forward's residuals in one workspace, the backward's gradients allocated apart and its
    other buffers in a workspace of its own."""

    @staticmethod
    def forward(ctx, x, ids, w, gate_up, down, gate_up_bias, down_bias, activation):
        tensors = (x, ids.contiguous(), w.contiguous(), gate_up, down, gate_up_bias, down_bias)
        out, kept, ctx.bound, ctx.key = _eager_training_forward(tensors, activation)
        ctx.activation = activation
        ctx.has_bias = (gate_up_bias is not None, down_bias is not None)
        ctx.save_for_backward(*tensors, *kept)
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        tensors, kept = saved[:len(CALL_INPUTS)], saved[len(CALL_INPUTS):]
        dx, dw, d_gate_up, d_down, *bias_grads = _eager_backward(tensors, kept, ctx.bound, ctx.key, dout,
                                                                 ctx.activation)
        d_gate_up_bias = bias_grads.pop(0) if ctx.has_bias[0] else None
        d_down_bias = bias_grads.pop(0) if ctx.has_bias[1] else None
        return dx, None, dw.view(tensors[2].shape), d_gate_up, d_down, d_gate_up_bias, d_down_bias, None


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None, deterministic=True):
    """The common signature; ``deterministic=False`` (inference only, this module's function) lets the down GEMM
    add its rows into float32 token rows with atomics instead of the per-token combine kernel: the order of the
    additions, and so the last bits, then vary from run to run. Under autograd the forward is always deterministic."""
    SUPPORT.check_activation(NAME, activation)
    # the kernels read hidden_states' rows and the biases' rows with a unit stride (the weights through their
    # strides, as stored)
    hidden_states = hidden_states.contiguous()
    gate_up_bias, down_bias = (b if b is None or b.stride(-1) == 1 else b.contiguous()
                               for b in (gate_up_bias, down_bias))
    args = (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    compiling = torch.compiler.is_compiling()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args):
        if compiling:
            return triton_experts_train(*args, activation)[0].to(hidden_states.dtype)
        return _EagerTraining.apply(*args, activation).to(hidden_states.dtype)
    if compiling:
        return triton_experts(*args, activation, deterministic)
    return _inference(*args, activation, deterministic)  # eager: the same function without the op dispatch
