"""moe_torch backends as transformers experts implementations.

``register()`` adds every available moe_torch backend to transformers' experts interface
(``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``) as ``"moe_torch:<backend>"``. The names then work wherever
transformers takes an experts implementation::

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_torch:grouped_mm")
    model.set_experts_implementation("moe_torch:batched_mm")

Each registered function maps what a transformers experts module holds (fused or separate gate, transposed weights,
biases, interleaved or custom gates, expert-parallel sentinels) onto ``moe_torch.experts_forward``.

Decode switch: during the decode steps of ``generate()``, ``moe_torch:grouped_mm`` runs as ``moe_torch:batched_mm``
where the spec's decode threshold (``[decode.max_gathered_mib]``) for the model's device class is positive, and is
restored afterwards; on CPU grouped_mm stays. This is the rule of ``moe_torch.decode_mode``, applied like transformers'
own 'grouped_mm' -> 'batched_mm' switch (which matches only the literal name): ``register()`` wraps
``GenerationMixin._optimize_model_for_decode``, the context that generate() enters for the decode steps.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import activations as hf_activations
from transformers.generation.utils import GenerationMixin
from transformers.integrations import moe as hf_moe

from moe_shared import load_spec

from ..api import ExpertsInterface, available_backends, experts_forward
from ..base import device_class

PREFIX = "moe_torch:"
_SPEC = load_spec()
_DECODE_SWITCH = {"grouped_mm": "batched_mm"}

# The flags transformers' @use_experts_implementation sets on an experts module, with its defaults.
_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
          "has_post_expert_norm": False}

# transformers activation modules (exact types) that compute one of the spec's named activations.
_NAMED_MODULES: dict[type, Callable[[nn.Module], str | None]] = {
    hf_activations.SiLUActivation: lambda m: "silu",
    nn.SiLU: lambda m: "silu",
    nn.ReLU: lambda m: "relu",
    nn.GELU: lambda m: "gelu" if m.approximate == "none" else None,
    hf_activations.GELUActivation: lambda m: "gelu" if m.act is F.gelu else None,
}
_NAMED_FUNCTIONS = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu"}

_UNSUPPORTED = {"has_post_expert_norm": "a norm applied to each expert's output (has_post_expert_norm=True)"}


def hf_name(backend: str) -> str:
    """The transformers experts implementation name of a moe_torch backend."""
    return PREFIX + backend


def activation_name(act_fn) -> str | None:
    """The spec's name of a transformers activation ("silu", "gelu", "relu"), or None if it is none of them."""
    if isinstance(act_fn, nn.Module):
        rule = _NAMED_MODULES.get(type(act_fn))
        return rule(act_fn) if rule is not None else None
    return _NAMED_FUNCTIONS.get(act_fn)


def _flags(module: nn.Module) -> dict[str, bool]:
    return {name: getattr(module, name, default) for name, default in _FLAGS.items()}


def _has_default_gate(module: nn.Module) -> bool:
    default = getattr(hf_moe, "_default_apply_gate", None)
    return "_apply_gate" not in vars(module) and getattr(type(module), "_apply_gate", None) is default


def _activation(module: nn.Module, flags: dict[str, bool]) -> str | Callable:
    """The activation argument: the spec's name for the default concatenated gate with a named act_fn, else the
    module's own gate (or act_fn without a gate) as a callable."""
    if not flags["has_gate"]:
        return module.act_fn
    if flags["is_concatenated"] and _has_default_gate(module):
        return activation_name(getattr(module, "act_fn", None)) or module._apply_gate
    return module._apply_gate


def contract_arguments(module: nn.Module) -> dict:
    """The weights, biases and activation of a transformers experts module as ``experts_forward`` arguments."""
    flags = _flags(module)
    for flag, feature in _UNSUPPORTED.items():
        if flags[flag]:
            raise NotImplementedError(f"{type(module).__name__}: {feature} is not supported by the moe_torch "
                                      f"experts contract; use a transformers experts implementation for this model")
    first = "gate_up_proj" if flags["has_gate"] else "up_proj"
    gate_up, down = getattr(module, first), module.down_proj
    if flags["is_transposed"]:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    bias = flags["has_bias"]
    return {"gate_up_proj": gate_up, "down_proj": down, "activation": _activation(module, flags),
            "gate_up_bias": getattr(module, f"{first}_bias") if bias else None,
            "down_bias": module.down_proj_bias if bias else None}


@functools.cache
def experts_function(backend: str) -> Callable:
    """The transformers experts function ``(module, hidden_states, top_k_index, top_k_weights)`` that runs the
    moe_torch ``backend``."""
    ExpertsInterface[backend]

    def forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        arguments = contract_arguments(module)
        if getattr(module, "_is_expert_parallel", False):
            top_k_index = top_k_index.masked_fill(top_k_index >= module.num_experts, _SPEC.empty_slot)
        k = top_k_index.shape[-1]
        out = experts_forward(hidden_states.reshape(-1, hidden_states.shape[-1]), top_k_index.reshape(-1, k),
                              top_k_weights.reshape(-1, k), implementation=backend, **arguments)
        return out.view(hidden_states.shape)

    forward.__name__ = forward.__qualname__ = f"moe_torch_{backend}_experts_forward"
    forward.__doc__ = f"transformers experts function running the moe_torch backend {backend!r}."
    return forward


def _devices(device) -> list[torch.device]:
    if device is not None:
        return [torch.device(device)]
    return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def register(device: torch.device | str | None = None) -> list[str]:
    """Register every moe_torch backend available on ``device`` (default: the CPU or this machine's accelerator)
    as ``"moe_torch:<backend>"`` in transformers' experts interface, and install the decode switch.

    Returns the registered names. Idempotent; calling it again also registers backends added since.
    """
    available = [available_backends(d) for d in _devices(device)]
    backends = [name for name in ExpertsInterface if any(reasons[name] is None for reasons in available)]
    for backend in backends:
        hf_moe.ALL_EXPERTS_FUNCTIONS.register(hf_name(backend), experts_function(backend))
    _install_decode_switch()
    return [hf_name(b) for b in backends]


def decode_threshold(device: torch.device) -> int:
    """The spec's decode threshold (MiB of weights batched_mm gathers at most) for the device class of ``device``."""
    return _SPEC.decode_threshold("torch", device_class(torch.device(device)))


@contextmanager
def decode_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, a transformers model's (sub)configs on ``moe_torch:grouped_mm`` run ``moe_torch:batched_mm``
    where the decode threshold of the model's device class is positive; the previous implementations come back on
    exit, also on an exception. generate() enters this for its decode steps once ``register()`` ran."""
    for method in ("get_experts_implementation", "set_experts_implementation"):
        if not callable(getattr(model, method, None)):
            raise ValueError(f"model: expected a transformers PreTrainedModel with {method}(), "
                             f"got {type(model).__name__}")
    saved = model.get_experts_implementation()
    switched = saved
    if decode_threshold(model.device) > 0:
        renames = {hf_name(a): hf_name(b) for a, b in _DECODE_SWITCH.items()}
        switched = {key: renames.get(value, value) for key, value in saved.items()}
    if switched != saved:
        model.set_experts_implementation(switched)
    try:
        yield model
    finally:
        if switched != saved:
            model.set_experts_implementation(saved)


def _install_decode_switch() -> None:
    original = GenerationMixin.__dict__.get("_optimize_model_for_decode")
    if original is None:
        warnings.warn("transformers.GenerationMixin has no _optimize_model_for_decode: generate() will not switch "
                      "moe_torch:grouped_mm to moe_torch:batched_mm for decoding", RuntimeWarning, stacklevel=3)
        return
    if hasattr(original, "_moe_torch_wrapped"):
        return

    @contextmanager
    def _optimize_model_for_decode(self):
        with original(self):
            if not callable(getattr(self, "set_experts_implementation", None)):
                yield
                return
            with decode_mode(self):
                yield

    functools.update_wrapper(_optimize_model_for_decode, original)
    _optimize_model_for_decode._moe_torch_wrapped = original
    GenerationMixin._optimize_model_for_decode = _optimize_model_for_decode
