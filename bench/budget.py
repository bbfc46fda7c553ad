"""Memory and time estimates of a point, to skip the ones that cannot fit or would take silly long.

The estimate is the roofline cost plus what a backend adds: batched_mm gathers a copy of an expert's weights
per routed slot (moe_torch's none on CUDA and on the CPU: each slot's matmul reads its expert's weights in place;
elsewhere one projection at a time; transformers' and JAX's both, kept for the backward); JAX ragged_dot on CPU
expands to a dense masked matmul of every slot against every expert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import roofline
from .configs import Config

GIB = 2**30


@dataclass(frozen=True)
class Shape:
    cfg: Config
    tokens: int
    mode: str
    itemsize: int

    @property
    def slots(self) -> int:
        return self.tokens * self.cfg.top_k

    @property
    def expert_bytes(self) -> int:
        return 3 * self.cfg.hidden * self.cfg.intermediate * self.itemsize

    @property
    def backward(self) -> bool:
        return self.mode == "fwd+bwd"


@dataclass(frozen=True)
class Extra:
    memory: float = 0.0  # bytes on top of weights, their gradients and the activations
    flop_factor: float = 1.0
    bytes: float = 0.0  # moved on top of the roofline bytes


def _batched_gather(s: Shape) -> Extra:
    """Both projections' weights gathered per slot and kept for the backward, with a gradient of the same size."""
    gathered = s.slots * s.expert_bytes
    return Extra(memory=gathered * (2 if s.backward else 1), bytes=3 * gathered * (2 if s.backward else 1))


def _torch_batched_gather(s: Shape) -> Extra:
    """moe_torch batched_mm where it gathers (compiled on the CPU, other devices): one projection's weights gathered
    at a time (the gate/up one, 2/3 of an expert) in the forward; the backward gathers none (grouped matmuls over the
    slots sorted by expert)."""
    return Extra(memory=s.slots * s.expert_bytes * 2 / 3, bytes=3 * s.slots * s.expert_bytes)


def _torch_batched_in_place(s: Shape) -> Extra:
    """moe_torch batched_mm on the CPU (uncompiled; compiled it gathers in chunks of a few MB) and on CUDA
    (moe_torch.slot_blas, compiled too): each slot's matmuls read its expert's weights in place, again in the
    backward's input gradient."""
    return Extra(bytes=s.slots * s.expert_bytes * (2 if s.backward else 1))


def _dense_masked(s: Shape) -> Extra:
    return Extra(memory=s.cfg.experts * s.slots * 2 * s.cfg.intermediate * 4, flop_factor=s.cfg.experts)


# (framework, backend, device class) -> extra cost; "*" matches any
EXTRAS: dict[tuple[str, str, str], Callable[[Shape], Extra]] = {
    ("*", "batched_mm", "*"): _batched_gather,
    ("torch", "batched_mm", "*"): _torch_batched_gather,
    ("torch", "batched_mm", "cpu"): _torch_batched_in_place,
    ("torch", "batched_mm", "cuda"): _torch_batched_in_place,
    ("torch", "transformers:batched_mm", "*"): _batched_gather,
    ("jax", "ragged_dot", "cpu"): _dense_masked,
}


def extra(framework: str, backend: str, device_class: str, shape: Shape) -> Extra:
    for key in ((framework, backend, device_class), (framework, backend, "*"), ("*", backend, device_class),
                ("*", backend, "*")):
        if key in EXTRAS:
            return EXTRAS[key](shape)
    return Extra()


@dataclass(frozen=True)
class Estimate:
    memory: float  # bytes
    seconds: float  # one call


def estimate(framework: str, backend: str, device_class: str, shape: Shape, peaks: roofline.Peaks,
             n_sets: int) -> Estimate:
    cfg = shape.cfg
    weights = cfg.experts * shape.expert_bytes
    activations = shape.slots * (3 * cfg.intermediate + cfg.hidden) * 4 * (3 if shape.backward else 1)
    inputs = n_sets * shape.tokens * (2 * cfg.hidden * shape.itemsize + cfg.top_k * 16)
    more = extra(framework, backend, device_class, shape)
    memory = weights * (2 if shape.backward else 1) + activations + inputs + more.memory
    n_flops = roofline.flops(shape.tokens, cfg.hidden, cfg.intermediate, cfg.top_k, shape.mode) * more.flop_factor
    hit = min(cfg.experts, shape.slots)
    n_bytes = roofline.bytes_moved(shape.tokens, cfg.hidden, cfg.intermediate, hit, shape.itemsize,
                                   shape.mode) + more.bytes
    seconds = roofline.floor_ms(n_flops, n_bytes, peaks.tflops, peaks.tbs) / 1e3
    return Estimate(memory, seconds)


def skip_reason(est: Estimate, memory_budget: float, max_call_s: float) -> str | None:
    """None if the point fits, else "too large: ..." or "too slow: ..."."""
    if est.memory > memory_budget:
        return f"too large: ~{est.memory / GIB:.1f} GiB estimated, budget {memory_budget / GIB:.1f} GiB"
    if est.seconds > max_call_s:
        return f"too slow: ~{est.seconds:.2g} s per call estimated, limit {max_call_s:g} s (--max-call-s)"
    return None
