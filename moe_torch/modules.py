"""The ``Experts`` module and model-level backend switching."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from moe_shared import check_activation, load_spec
from moe_shared.switching import apply_request, summarize

from .api import ExpertsInterface, experts_forward
from .base import device_class

_SPEC = load_spec()


class Experts(nn.Module):
    """E gated-MLP experts with the transformers layout, run by a named backend.

    Parameters: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I] (+ ``gate_up_bias`` [E, 2I], ``down_bias``
    [E, H] when ``bias``). ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 activation: str | Callable = "silu", bias: bool = False, experts_implementation: str = "grouped_mm",
                 device=None, dtype=None):
        super().__init__()
        for arg, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                           ("intermediate_size", intermediate_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg}: expected a positive int, got {value!r}")
        check_activation(activation)
        ExpertsInterface[experts_implementation]
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation = activation
        self.experts_implementation = experts_implementation
        factory = {"device": device, "dtype": dtype}
        E, H, I = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H, **factory))
        self.down_proj = nn.Parameter(torch.empty(E, H, I, **factory))
        self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * I, **factory)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(E, H, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's projections initialised like nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        for weight, bias, fan_in in ((self.gate_up_proj, self.gate_up_bias, self.hidden_size),
                                     (self.down_proj, self.down_bias, self.intermediate_size)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(weight, -bound, bound)
            if bias is not None:
                nn.init.uniform_(bias, -bound, bound)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return experts_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                               implementation=self.experts_implementation, activation=self.activation,
                               gate_up_bias=self.gate_up_bias, down_bias=self.down_bias)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, activation={self.activation!r}, "
                f"bias={self.gate_up_bias is not None}, experts_implementation={self.experts_implementation!r}")


def _experts_modules(model: nn.Module) -> dict[str, Experts]:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    found = {path: m for path, m in model.named_modules() if isinstance(m, Experts)}
    if not found:
        raise ValueError(f"model: expected a module holding moe_torch.Experts modules, got a "
                         f"{type(model).__name__} with none")
    return found


def get_experts_implementation(model: nn.Module) -> dict[str, str | None]:
    """``{"": top, "<sub-module>": backend, ...}``; passing it to ``set_experts_implementation`` restores it."""
    return summarize({p: m.experts_implementation for p, m in _experts_modules(model).items()})


def set_experts_implementation(model: nn.Module, name_or_dict: str | Mapping[str, str | None]) -> None:
    """A plain name applies to every Experts module; a dict maps sub-module names ("" = top level) to backends,
    the most specific name wins, and modules no key covers keep their backend."""
    modules = _experts_modules(model)
    requested = [name_or_dict] if isinstance(name_or_dict, str) else [
        v for v in getattr(name_or_dict, "values", lambda: [])() if v is not None]
    for name in requested:
        ExpertsInterface[name]
    new = apply_request({p: m.experts_implementation for p, m in modules.items()}, name_or_dict)
    for path, backend in new.items():
        modules[path].experts_implementation = backend


@contextmanager
def decode_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, Experts modules on grouped_mm run batched_mm where the spec's decode threshold for their
    device class is positive (accelerators; on CPU grouped_mm stays). Other backends are left alone; the previous
    backends come back on exit, also on an exception."""
    modules = _experts_modules(model)
    saved = {p: m.experts_implementation for p, m in modules.items()}
    for m in modules.values():
        if m.experts_implementation == "grouped_mm" and \
                _SPEC.decode_threshold("torch", device_class(m.gate_up_proj.device)) > 0:
            m.experts_implementation = "batched_mm"
    try:
        yield model
    finally:
        for path, backend in saved.items():
            modules[path].experts_implementation = backend
