"""Float64 NumPy reference of the experts contract: forward and gradients.

Shape legend: T tokens, H hidden, I intermediate, E experts, k top-k. Inputs of any float dtype (ml_dtypes
bfloat16 included) are promoted to float64; every result is float64. Expert id -1 is an empty slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .contract import check_expert_ids

_erf = np.frompyfunc(math.erf, 1, 1)


def _phi_cdf(g):
    return 0.5 * (1.0 + _erf(g / math.sqrt(2.0)).astype(np.float64))


def _silu(g):
    return g / (1.0 + np.exp(-g))


def _silu_grad(g):
    s = 1.0 / (1.0 + np.exp(-g))
    return s * (1.0 + g * (1.0 - s))


def _gelu(g):
    return g * _phi_cdf(g)


def _gelu_grad(g):
    return _phi_cdf(g) + g * np.exp(-0.5 * g * g) / math.sqrt(2.0 * math.pi)


def _relu(g):
    return np.maximum(g, 0.0)


def _relu_grad(g):
    return (g > 0).astype(np.float64)


ACTIVATIONS = {"silu": (_silu, _silu_grad), "gelu": (_gelu, _gelu_grad), "relu": (_relu, _relu_grad)}


@dataclass
class _Prepared:
    x: np.ndarray
    w: np.ndarray
    gate_up: np.ndarray
    down: np.ndarray
    b1: np.ndarray | None
    b2: np.ndarray | None
    tok: np.ndarray  # token of each non-empty slot
    pos: np.ndarray  # flat [T*k] position of each non-empty slot
    expert: np.ndarray  # expert of each non-empty slot


def _prepare(x, idx, w, gate_up, down, b1, b2) -> _Prepared:
    f64 = lambda a: None if a is None else np.asarray(a).astype(np.float64)
    idx = np.asarray(idx).astype(np.int64)
    T, k = idx.shape
    E = np.asarray(gate_up).shape[0]
    if idx.size:
        check_expert_ids(int(idx.min()), int(idx.max()), E)
    flat = idx.reshape(-1)
    pos = np.nonzero(flat >= 0)[0]
    return _Prepared(f64(x), f64(w).reshape(-1), f64(gate_up), f64(down), f64(b1), f64(b2),
                     tok=pos // k, pos=pos, expert=flat[pos])


def _groups(p: _Prepared):
    for e in np.unique(p.expert):
        sel = np.nonzero(p.expert == e)[0]
        yield int(e), sel


def _expert_forward(p: _Prepared, e: int, xs: np.ndarray, act):
    I = p.down.shape[2]
    a = xs @ p.gate_up[e].T
    if p.b1 is not None:
        a = a + p.b1[e]
    g, u = a[:, :I], a[:, I:]
    h = act(g) * u
    y = h @ p.down[e].T
    if p.b2 is not None:
        y = y + p.b2[e]
    return g, u, h, y


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None) -> np.ndarray:
    """out [T, H] in float64."""
    act, _ = ACTIVATIONS[activation]
    p = _prepare(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    out = np.zeros_like(p.x)
    for e, sel in _groups(p):
        tok = p.tok[sel]
        *_, y = _expert_forward(p, e, p.x[tok], act)
        np.add.at(out, tok, p.w[p.pos[sel], None] * y)
    return out


def experts_backward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, grad_output, *,
                     activation="silu", gate_up_bias=None, down_bias=None) -> dict[str, np.ndarray]:
    """Gradients of sum(out * grad_output), keyed by argument name, all float64."""
    act, act_grad = ACTIVATIONS[activation]
    p = _prepare(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias)
    dy = np.asarray(grad_output).astype(np.float64)
    grads = {
        "hidden_states": np.zeros_like(p.x),
        "top_k_weights": np.zeros_like(p.w),
        "gate_up_proj": np.zeros_like(p.gate_up),
        "down_proj": np.zeros_like(p.down),
    }
    if p.b1 is not None:
        grads["gate_up_bias"] = np.zeros_like(p.b1)
    if p.b2 is not None:
        grads["down_bias"] = np.zeros_like(p.b2)
    for e, sel in _groups(p):
        tok, pos = p.tok[sel], p.pos[sel]
        xs = p.x[tok]
        g, u, h, y = _expert_forward(p, e, xs, act)
        dys = dy[tok]
        grads["top_k_weights"][pos] = np.sum(dys * y, axis=1)
        dys = p.w[pos, None] * dys
        grads["down_proj"][e] = dys.T @ h
        if p.b2 is not None:
            grads["down_bias"][e] = dys.sum(0)
        dh = dys @ p.down[e]
        da = np.concatenate([dh * u * act_grad(g), dh * act(g)], axis=1)
        grads["gate_up_proj"][e] = da.T @ xs
        if p.b1 is not None:
            grads["gate_up_bias"][e] = da.sum(0)
        np.add.at(grads["hidden_states"], tok, da @ p.gate_up[e])
    grads["top_k_weights"] = grads["top_k_weights"].reshape(np.asarray(top_k_index).shape)
    return grads
