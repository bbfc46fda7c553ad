"""Helpers shared by the test modules (framework conversions live in each framework's test module)."""

from __future__ import annotations

import time
import traceback

import numpy as np

from moe_shared import load_spec, relative_l2
from moe_shared.vectors import load_cases

SPEC = load_spec()
CASES = load_cases()
DIFF_ARGS = ("hidden_states", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias")


def case_id(case) -> str:
    return case.name


def assert_close(name: str, actual, expected, dtype: str) -> float:
    tol = SPEC.tolerance_for(dtype)
    err = relative_l2(np.asarray(actual, dtype=np.float64), expected)
    assert err <= tol, f"{name}: relative L2 error {err:.3e} > {tol:.0e} ({dtype})"
    return err


def random_case(seed: int, *, T: int, H: int, I: int, E: int, k: int, bias: bool, empty_fraction: float = 0.0,
                one_expert: bool = False):
    """Random float64 inputs for cross-framework checks (cast by each framework)."""
    rng = np.random.default_rng(seed)
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
    if one_expert and T:
        idx[:, 0] = 0
        idx[:, 1:] = np.where(idx[:, 1:] == 0, idx[:, :1], idx[:, 1:])
        for row in idx:  # keep the other slots distinct from expert 0
            others = [e for e in range(1, E) if e not in row[:1]]
            row[1:] = others[: k - 1]
    if empty_fraction:
        idx[rng.random((T, k)) < empty_fraction] = -1
    logits = rng.standard_normal((T, k))
    arrays = {
        "hidden_states": rng.standard_normal((T, H)),
        "top_k_index": idx,
        "top_k_weights": np.exp(logits) / np.exp(logits).sum(1, keepdims=True),
        "gate_up_proj": rng.standard_normal((E, 2 * I, H)) / np.sqrt(H),
        "down_proj": rng.standard_normal((E, H, I)) / np.sqrt(I),
    }
    if bias:
        arrays["gate_up_bias"] = 0.1 * rng.standard_normal((E, 2 * I))
        arrays["down_bias"] = 0.1 * rng.standard_normal((E, H))
    grad_output = rng.standard_normal((T, H))
    return arrays, grad_output


# Bad inputs, the same for every framework: (argument, change of shape on the NumPy array, dtype to cast to,
# expected message). Each framework's test applies them to its own arrays.
def _keep(a):
    return a


BAD_INPUTS = [
    ("hidden_states", lambda a: a[None], None, r"hidden_states: expected a 2-D array \[T, H\], got shape \(1, 4, 8\)"),
    ("hidden_states", _keep, "int32", r"hidden_states: expected dtype in \['float32', 'bfloat16', 'float16'\], "
                                      r"got dtype int32"),
    ("top_k_index", _keep, "float32", r"top_k_index: expected dtype in \['int32', 'int64'\], got dtype float32"),
    ("top_k_index", lambda a: a[:3], None, r"top_k_index: expected shape \[T, k\] = \(4, \?\), got shape \(3, 2\)"),
    ("top_k_weights", lambda a: a[:, :1], None, r"top_k_weights: expected shape \[T, k\] = \(4, 2\), got shape \(4, 1\)"),
    ("gate_up_proj", lambda a: a[:, :7], None, r"gate_up_proj: expected shape \[E, 2I, H\] = \(3, 8, 8\)"),
    ("down_proj", lambda a: a[:2], None, r"down_proj: expected shape \[E, H, I\] = \(3, 8, \?\), got shape \(2, 8, 4\)"),
    ("down_proj", _keep, "float16", r"down_proj: expected the dtype of gate_up_proj \(float32\), got dtype float16"),
    ("gate_up_bias", lambda a: a[:, :5], None, r"gate_up_bias: expected shape \[E, 2I\] = \(3, 8\), got shape \(3, 5\)"),
    ("down_bias", _keep, "bfloat16", r"down_bias: expected the dtype of the weights \(float32\), got dtype bfloat16"),
]
BAD_INPUT_IDS = [f"{arg}-{i}" for i, (arg, *_) in enumerate(BAD_INPUTS)]


def good_arrays():
    """A small valid problem (T=4, H=8, I=4, E=3, k=2, biases) for the bad-input tests."""
    return random_case(2, T=4, H=8, I=4, E=3, k=2, bias=True)[0]


def cpu_backends(framework: str) -> list[str]:
    """The backends the spec declares for CPU in ``framework``; GPU-only ones have their own tests (requirement
    errors here, the kernels under the Triton interpreter or on the device)."""
    return [n for n in SPEC.backend_names(framework) if "cpu" in SPEC.backends[n].support(framework).devices]


def padded_arrays(arrays: dict, multiple: int) -> dict:
    """The same problem with H and I zero-padded to multiples of ``multiple`` (for kernels that need them): padded
    gate and up rows give act(0) * 0 = 0, padded hidden columns give zeros, so out[:, :H] is unchanged."""
    E, H, I = arrays["down_proj"].shape
    H2, I2 = -(-H // multiple) * multiple, -(-I // multiple) * multiple

    def grow(a, axis, size):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, size - a.shape[axis])
        return np.pad(a, widths)

    def gate_up(a, axis):
        gate, up = np.split(a, 2, axis=axis)
        return np.concatenate([grow(gate, axis, I2), grow(up, axis, I2)], axis=axis)

    out = dict(arrays, hidden_states=grow(arrays["hidden_states"], 1, H2),
               gate_up_proj=grow(gate_up(arrays["gate_up_proj"], 1), 2, H2),
               down_proj=grow(grow(arrays["down_proj"], 1, H2), 2, I2))
    if "gate_up_bias" in arrays:
        out["gate_up_bias"] = gate_up(arrays["gate_up_bias"], 1)
    if "down_bias" in arrays:
        out["down_bias"] = grow(arrays["down_bias"], 1, H2)
    return out


def unpadded_gradients(grads: dict, H: int, I: int) -> dict:
    """Gradients (by argument name) of a problem zero-padded by ``padded_arrays``, cut back to H and I."""
    I2 = grads["down_proj"].shape[2]

    def gate_up(a, axis):
        return np.concatenate([np.take(a, range(I), axis=axis), np.take(a, range(I2, I2 + I), axis=axis)], axis)

    out = dict(grads, hidden_states=grads["hidden_states"][:, :H],
               gate_up_proj=gate_up(grads["gate_up_proj"], 1)[:, :, :H], down_proj=grads["down_proj"][:, :H, :I])
    if "gate_up_bias" in grads:
        out["gate_up_bias"] = gate_up(grads["gate_up_bias"], 1)
    if "down_bias" in grads:
        out["down_bias"] = grads["down_bias"][:, :H]
    return out


def record_outcome(results: list, kind: str, name: str, fn) -> None:
    """The device scripts' check runner: ``fn()``'s result, or its error and trace, appended to ``results`` (a run
    collects every outcome instead of stopping at the first failure)."""
    start = time.perf_counter()
    try:
        results.append({"kind": kind, "name": name, "ok": True, "detail": fn(),
                        "s": round(time.perf_counter() - start, 2)})
    except Exception as err:  # recorded, not raised
        results.append({"kind": kind, "name": name, "ok": False, "detail": f"{type(err).__name__}: {err}"[:800],
                        "trace": traceback.format_exc()[-2000:]})
