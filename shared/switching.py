"""Runtime backend switching semantics, shared by moe_torch and moe_jax.

A model holds experts modules at dotted paths ("" is the model itself). ``apply_request`` turns a request into
the new backend of every path: a plain name applies everywhere; a dict is keyed by sub-module name ("" for the top
level), the longest matching key wins, and paths that no key covers keep their backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .spec import load_spec

_SPEC = load_spec()


def _covers(key: str, path: str) -> bool:
    return key == "" or path == key or path.startswith(key + ".")


def apply_request(current: Mapping[str, str], request: str | Mapping[str, str | None]) -> dict[str, str]:
    """New backend per path for ``request`` given the ``current`` backend per path."""
    if isinstance(request, str):
        return {path: request for path in current}
    if not isinstance(request, Mapping):
        raise ValueError(f"name_or_dict: expected a backend name or a dict of sub-module name -> backend, "
                         f"got {type(request).__name__}")
    for key in request:
        if not isinstance(key, str) or not any(_covers(key, path) for path in current):
            raise ValueError(f"name_or_dict: key {key!r} names no experts module or parent of one; "
                             f"experts modules are at {sorted(current)}")
    result = {}
    for path, backend in current.items():
        keys = [k for k in request if _covers(k, path) and request[k] is not None]
        result[path] = request[max(keys, key=len)] if keys else backend
    return result


def summarize(current: Mapping[str, str]) -> dict[str, str | None]:
    """``{"": top, "<path>": backend, ...}``: "" is the model's own backend if it is an experts module, else the
    backend its experts modules share (None when they differ). Feeding it back to ``apply_request`` restores
    every path exactly."""
    if "" in current:
        top = current[""]
    else:
        values = set(current.values())
        top = values.pop() if len(values) == 1 else None
    return {"": top} | {path: b for path, b in current.items() if path != ""}


def expert_bytes(gate_up_shape: Sequence[int], down_shape: Sequence[int], itemsize: int) -> int:
    """One expert's gate/up and down weights in bytes, from the [E, 2I, H] and [E, H, I] shapes."""
    return (math.prod(gate_up_shape[1:]) + math.prod(down_shape[1:])) * itemsize


def auto_backend(framework: str, device_class: str, slots: int, weight_bytes: int) -> str:
    """The decode switch: batched_mm while the weights it gathers (``slots`` = T*k times one expert's
    ``weight_bytes``) are at most the spec's threshold, grouped_mm beyond."""
    threshold = _SPEC.decode_threshold(framework, device_class)
    return "batched_mm" if 0 < threshold and slots * weight_bytes <= threshold * 2**20 else "grouped_mm"
