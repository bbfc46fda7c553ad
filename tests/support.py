"""Helpers shared by the test modules (framework conversions live in each framework's test module)."""

from __future__ import annotations

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
