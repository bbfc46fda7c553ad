"""The public function and the backend registry of moe_torch."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx.experimental.symbolic_shapes import has_static_value

from moe_shared import ArrayInfo, Dims, check_arguments, check_expert_ids
from moe_shared.registry import BackendRegistry

from . import backends, graphs
from .base import device_class, dtype_name

ExpertsInterface = BackendRegistry("torch")
for _module in backends.ALL:
    ExpertsInterface.register(_module.NAME, _module.experts_forward)

_TENSOR_ARGS = ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_bias",
                "down_bias")
# signatures of calls that passed the argument and requirement checks -> (dims, whether the call may be a graph)
_CHECKED: dict[tuple, tuple[object, bool]] = {}
_CHECKED_MAX = 256


def _signature(implementation, activation, layouts) -> tuple | None:
    """What the argument and requirement checks depend on: the backend, the activation and each tensor's shape,
    dtype and device (None where the activation is not hashable, or under torch.compile, which traces the checks
    once)."""
    if torch.compiler.is_compiling():
        return None
    key = (implementation, activation, layouts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _check(implementation: str, activation, layouts: tuple) -> Dims:
    """The argument and requirement checks of a call from each tensor's (shape, dtype, device), None for an absent
    one: raise on bad input, else the problem's dimensions."""
    dims = check_arguments(*(None if layout is None else ArrayInfo(tuple(layout[0]), dtype_name(layout[1]))
                             for layout in layouts), activation=activation)
    device = layouts[0][2]
    for name, layout in zip(_TENSOR_ARGS, layouts):
        if layout is not None and layout[2] != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of hidden_states), got one on "
                             f"{layout[2]}")
    check_requirements(implementation, layouts[3][2], layouts[3][1])
    return dims


@torch.compiler.assume_constant_result
def _check_as_constant(implementation: str, activation: str, layouts: tuple) -> Dims | None:
    """``_check`` run by dynamo once, at tracing, as a constant, None where it raises (``_checks`` then traces it, so
    that the error is raised as in eager code)."""
    try:
        return _check(implementation, activation, layouts)
    except Exception:
        return None


def _checks(implementation: str, activation, layouts: tuple) -> Dims:
    """The checks (``_check``). Where torch.compile traces static shapes and a named activation, as a constant: the
    compiled call then guards on its arguments alone, not on every spec entry and helper the checks read (dynamo
    evaluates each guard at every call; batched_mm on the CPU here: 5.7 against 3.9 us a call)."""
    if (torch.compiler.is_compiling() and isinstance(activation, str)
            and all(has_static_value(n) for layout in layouts if layout is not None for n in layout[0])):
        dims = _check_as_constant(implementation, activation, layouts)
        if dims is not None:
            return dims
    return _check(implementation, activation, layouts)


def check_requirements(implementation: str, device: torch.device, dtype: torch.dtype | str) -> None:
    """Raise if the backend cannot run here: ImportError names the pip extra, RuntimeError the hardware."""
    device = torch.device(device)
    where = device_class(device)
    ExpertsInterface.check(
        implementation, device_class=where, where=f"a tensor on {device}",
        dtype=dtype if isinstance(dtype, str) else dtype_name(dtype),
        compute_capability=torch.cuda.get_device_capability(device) if where == "cuda" else None)


def experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    implementation: str = "grouped_mm",
    activation: str | Callable[[torch.Tensor], torch.Tensor] = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Routed gated-MLP experts: ``out[t] = sum_j w[t,j] * (down[e] @ (act(g) * u) + b2[e])``.

    Shapes: hidden_states [T, H]; top_k_index [T, k] (int32/int64, -1 = empty slot); top_k_weights [T, k];
    gate_up_proj [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up); down_proj [E, H, I]; gate_up_bias [E, 2I];
    down_bias [E, H]. Returns [T, H] in hidden_states' dtype; the matmuls run in the weights' dtype.

    ``implementation`` names a registered backend (``ExpertsInterface``); it never falls back to another.
    ``activation`` is "silu", "gelu" (erf) or "relu" applied as ``act(g) * u``, or a callable mapping the first
    projection [S, N] to [S, I] (then gate_up_proj is [E, N, H]). ``validate`` checks expert ids (a host sync);
    by default on for CPU tensors outside torch.compile, off elsewhere. Unchecked out-of-range ids count as empty.
    """
    fn = ExpertsInterface[implementation]
    tensors = (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    for name, t in zip(_TENSOR_ARGS, tensors):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    layouts = tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors)
    key = _signature(implementation, activation, layouts)
    checked = _CHECKED.get(key) if key is not None else None
    if checked is None:  # these checks depend only on the signature: done once per signature
        dims = _checks(implementation, activation, layouts)
        checked = dims, key is not None and graphs.allowed(implementation, activation, gate_up_proj, down_proj,
                                                          dims.slots)
        if key is not None:
            if len(_CHECKED) >= _CHECKED_MAX:
                _CHECKED.clear()
            _CHECKED[key] = checked
    dims, graphable = checked
    if validate is None:
        validate = hidden_states.device.type == "cpu" and not torch.compiler.is_compiling()
    if validate and dims.slots:
        lowest, highest = torch.aminmax(top_k_index)
        check_expert_ids(int(lowest), int(highest), dims.E)
    # Per-token inputs are small: made contiguous, strided ones give bit-identical results. Weights are used in
    # place (no per-call copy); strided weights agree with contiguous ones to rounding.
    hidden_states, top_k_index, top_k_weights = (t.contiguous() for t in (hidden_states, top_k_index, top_k_weights))

    def call(hidden_states, top_k_index, top_k_weights):
        return fn(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                  activation=activation, gate_up_bias=gate_up_bias, down_bias=down_bias)

    weights = (gate_up_proj, down_proj, gate_up_bias, down_bias)
    if graphable and graphs.wanted((hidden_states, top_k_weights, *weights)):
        return graphs.run((key, graphs.weights_key(weights)), call, (hidden_states, top_k_index, top_k_weights))
    return call(hidden_states, top_k_index, top_k_weights)


def available_backends(device: torch.device | str = "cpu") -> dict[str, str | None]:
    """Every registered backend -> None if it can run on ``device``, else the reason it cannot."""
    return ExpertsInterface.availability(lambda name, dtype: check_requirements(name, torch.device(device), dtype))
