"""Seeded inputs of one benchmark point, made with torch on the benchmark device, and the float32 reference.

Routing is a softmax over random logits followed by top-k (the k probabilities are the weights, not
renormalised). Every framework gets the same values: a JAX runner converts these tensors.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

import moe_torch

from .configs import Config

_REFERENCE_CHUNK_BYTES = 2**31  # float32 weights per reference chunk


@dataclass
class Weights:
    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


@dataclass
class InputSet:
    hidden_states: torch.Tensor  # [T, H]
    top_k_index: torch.Tensor  # [T, k] int64
    top_k_weights: torch.Tensor  # [T, k]
    grad_output: torch.Tensor  # [T, H]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.hidden_states, self.top_k_index, self.top_k_weights, self.grad_output))

    @property
    def hit_experts(self) -> int:
        return int(torch.unique(self.top_k_index).numel())


def _generator(device: torch.device, *key) -> torch.Generator:
    return torch.Generator(device).manual_seed(zlib.crc32(repr(key).encode()))


def make_weights(cfg: Config, dtype: torch.dtype, device: torch.device, seed: int) -> Weights:
    g = _generator(device, seed, cfg.name, "weights")
    E, H, I = cfg.experts, cfg.hidden, cfg.intermediate
    gate_up = torch.randn(E, 2 * I, H, generator=g, device=device, dtype=dtype).mul_(H**-0.5)
    down = torch.randn(E, H, I, generator=g, device=device, dtype=dtype).mul_(I**-0.5)
    return Weights(gate_up, down)


def make_sets(cfg: Config, tokens: int, dtype: torch.dtype, device: torch.device, seed: int,
              count: int) -> list[InputSet]:
    sets = []
    for i in range(count):
        g = _generator(device, seed, cfg.name, tokens, i)
        x = torch.randn(tokens, cfg.hidden, generator=g, device=device, dtype=dtype)
        logits = torch.randn(tokens, cfg.experts, generator=g, device=device)
        weights, index = torch.topk(torch.softmax(logits, dim=-1), cfg.top_k, dim=-1)
        grad = torch.randn(tokens, cfg.hidden, generator=g, device=device, dtype=dtype)
        sets.append(InputSet(x, index, weights.to(dtype), grad))
    return sets


def reference(weights: Weights, s: InputSet) -> np.ndarray:
    """Torch eager in float32 on float32 copies of the inputs, over chunks of experts to bound the copies."""
    E, H, I = weights.down.shape
    chunk = max(1, _REFERENCE_CHUNK_BYTES // (3 * H * I * 4))
    x, w = s.hidden_states.float(), s.top_k_weights.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    with torch.no_grad():
        for start in range(0, E, chunk):
            stop = min(E, start + chunk)
            inside = (s.top_k_index >= start) & (s.top_k_index < stop)
            index = torch.where(inside, s.top_k_index - start, -1)
            out += moe_torch.experts_forward(x, index, w, weights.gate_up[start:stop].float(),
                                             weights.down[start:stop].float(), implementation="eager",
                                             validate=False)
    return out.cpu().numpy()
