"""Experts weights between torch state dicts (moe_torch or transformers names) and Flax ``Experts`` params.

Works on anything array-like: NumPy arrays, JAX arrays, or tensors that speak DLPack (torch tensors, bfloat16
included) — torch itself is never imported. Layouts follow transformers' experts modules: ``is_transposed``
(GPT-OSS stores [E, H, 2I] and [E, I, H]) and ``interleaved`` gate/up rows (gate0, up0, gate1, ...).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

# parameter of flax_moe.Experts -> the names it has in state dicts (moe_torch first, then transformers)
STATE_DICT_NAMES = {
    "gate_up_proj": ("gate_up_proj",),
    "down_proj": ("down_proj",),
    "gate_up_bias": ("gate_up_bias", "gate_up_proj_bias"),
    "down_bias": ("down_bias", "down_proj_bias"),
}


def to_numpy(value, name: str = "value") -> np.ndarray:
    """A host NumPy copy of an array-like (bfloat16 as ml_dtypes.bfloat16)."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, jax.Array):
        return np.asarray(value)
    if hasattr(value, "__dlpack__"):
        return np.asarray(jax.dlpack.from_dlpack(value))
    raise ValueError(f"{name}: expected a NumPy/JAX array or a DLPack tensor, got {type(value).__name__}")


def _deinterleave(a: np.ndarray, axis: int) -> np.ndarray:
    gate = np.take(a, np.arange(0, a.shape[axis], 2), axis=axis)
    up = np.take(a, np.arange(1, a.shape[axis], 2), axis=axis)
    return np.concatenate([gate, up], axis=axis)


def _interleave(a: np.ndarray, axis: int) -> np.ndarray:
    half = a.shape[axis] // 2
    order = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
    return np.take(a, order, axis=axis)


def params_from_state_dict(state_dict: Mapping, *, prefix: str = "", is_transposed: bool = False,
                           interleaved: bool = False) -> dict[str, np.ndarray]:
    """Flax Experts params (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], biases if present) from a
    state dict with keys ``prefix + name``."""
    params = {}
    for param, names in STATE_DICT_NAMES.items():
        key = next((prefix + n for n in names if prefix + n in state_dict), None)
        if key is not None:
            params[param] = to_numpy(state_dict[key], key)
    for required in ("gate_up_proj", "down_proj"):
        if required not in params:
            raise ValueError(f"state_dict: expected a key {prefix + required!r}, got keys {sorted(state_dict)}")
    if is_transposed:
        params["gate_up_proj"] = np.swapaxes(params["gate_up_proj"], 1, 2)
        params["down_proj"] = np.swapaxes(params["down_proj"], 1, 2)
    if interleaved:
        params["gate_up_proj"] = _deinterleave(params["gate_up_proj"], 1)
        if "gate_up_bias" in params:
            params["gate_up_bias"] = _deinterleave(params["gate_up_bias"], 1)
    return {k: np.ascontiguousarray(v) for k, v in params.items()}


def state_dict_from_params(params: Mapping, *, names: str = "moe_torch", is_transposed: bool = False,
                           interleaved: bool = False) -> dict[str, np.ndarray]:
    """The inverse of ``params_from_state_dict``: ``names`` is "moe_torch" or "transformers"."""
    index = {"moe_torch": 0, "transformers": -1}
    if names not in index:
        raise ValueError(f"names: expected one of {sorted(index)}, got {names!r}")
    out = {}
    for param, value in params.items():
        a = to_numpy(value, param)
        if interleaved and param in ("gate_up_proj", "gate_up_bias"):
            a = _interleave(a, 1)
        if is_transposed and param in ("gate_up_proj", "down_proj"):
            a = np.swapaxes(a, 1, 2)
        out[STATE_DICT_NAMES[param][index[names]]] = np.ascontiguousarray(a)
    return out


def load_state_dict(module, state_dict: Mapping, **layout) -> None:
    """Copy experts weights from a state dict into a ``flax_moe.Experts`` (cast to its param dtype)."""
    params = params_from_state_dict(state_dict, **layout)
    for name, value in params.items():
        target = getattr(module, name)
        if target is None:
            raise ValueError(f"state_dict: has {name!r} but the module was built with bias=False")
        current = target.get_value()
        if value.shape != current.shape:
            raise ValueError(f"state_dict[{name!r}]: expected shape {current.shape}, got {value.shape}")
        target.set_value(jax.numpy.asarray(value, dtype=current.dtype))
    missing = [n for n in ("gate_up_bias", "down_bias") if getattr(module, n) is not None and n not in params]
    if missing:
        raise ValueError(f"state_dict: expected bias entries for {missing} (the module has bias=True)")


def module_state_dict(module, **layout) -> dict[str, np.ndarray]:
    """The weights of a ``flax_moe.Experts`` as a NumPy state dict (moe_torch names by default)."""
    params = {n: getattr(module, n).get_value() for n in STATE_DICT_NAMES if getattr(module, n) is not None}
    return state_dict_from_params(params, **layout)
