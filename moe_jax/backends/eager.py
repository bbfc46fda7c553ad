"""eager: a Python loop over the experts that received tokens. Needs concrete expert ids: outside jax.jit only.

Each expert's rows are padded to a power-of-two bucket so that one compiled expert MLP serves many row counts.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from moe_shared import load_spec

from ..base import HIGHEST, Slots, combine, gate, is_traced

NAME = "eager"
_JITTABLE = sorted(n for n, b in load_spec().backends.items() if b.frameworks.get("jax") and b.frameworks["jax"].jit)


def _dense(x, w, b):
    y = jnp.matmul(x, w.T, precision=HIGHEST, preferred_element_type=jnp.float32).astype(x.dtype)
    return y if b is None else y + b


@partial(jax.jit, static_argnames=("activation",))
def _expert_mlp(x, rows, e, gate_up_proj, down_proj, gate_up_bias, down_bias, *, activation):
    pick = lambda b: None if b is None else b[e]
    h = _dense(x[rows], gate_up_proj[e], pick(gate_up_bias))
    return _dense(gate(activation, h, down_proj.shape[2]), down_proj[e], pick(down_bias))


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    if is_traced(top_k_index):
        raise ValueError(f"implementation 'eager' loops over the experts in Python and needs concrete expert ids; "
                         f"under jax.jit (or another trace of top_k_index) use one of {_JITTABLE}")
    E, H, I = down_proj.shape
    slots = Slots(top_k_index, E)
    x = hidden_states.astype(gate_up_proj.dtype)
    ids = np.asarray(top_k_index).reshape(-1)
    positions, outputs = [], []
    for e in np.unique(ids[(ids >= 0) & (ids < E)]):
        pos = np.nonzero(ids == e)[0]
        bucket = 1 << (len(pos) - 1).bit_length()
        rows = np.pad(pos // slots.k, (0, bucket - len(pos))).astype(np.int32)
        y = _expert_mlp(x, rows, np.int32(e), gate_up_proj, down_proj, gate_up_bias, down_bias,
                        activation=activation)
        outputs.append(y[: len(pos)])
        positions.append(pos)
    y = jnp.zeros((slots.count, H), x.dtype)
    if positions:
        y = y.at[np.concatenate(positions)].set(jnp.concatenate(outputs))
    return combine(y, slots, top_k_weights, hidden_states.dtype)
