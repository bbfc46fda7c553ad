"""FLOPs, bytes and the roofline floor of one experts call, and the device peaks measured in the run.

Forward FLOPs are ``2*T*k*(2I*H + H*I)`` (gate_up then down, per routed slot); fwd+bwd is 3x that. Bytes are
the lower bound a perfect kernel moves: every hit expert's weights once plus x in and out; fwd+bwd reads the
hit weights and writes their gradients (2x), and moves x, out, grad_out and grad_x (4 token arrays).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

MODES = ("fwd", "fwd+bwd")
_FLOP_FACTOR = {"fwd": 1, "fwd+bwd": 3}
_WEIGHT_PASSES = {"fwd": 1, "fwd+bwd": 2}
_TOKEN_ARRAYS = {"fwd": 2, "fwd+bwd": 4}


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def flops(tokens: int, hidden: int, intermediate: int, top_k: int, mode: str) -> int:
    _check_mode(mode)
    return 2 * tokens * top_k * (2 * intermediate * hidden + hidden * intermediate) * _FLOP_FACTOR[mode]


def bytes_moved(tokens: int, hidden: int, intermediate: int, hit_experts: float, itemsize: int, mode: str) -> float:
    _check_mode(mode)
    weights = hit_experts * 3 * hidden * intermediate * itemsize
    return _WEIGHT_PASSES[mode] * weights + _TOKEN_ARRAYS[mode] * tokens * hidden * itemsize


def floor_ms(n_flops: float, n_bytes: float, peak_tflops: float, peak_tbs: float) -> float:
    """max(compute time, memory time) in ms at the measured peaks (TFLOP/s, TB/s)."""
    if peak_tflops <= 0 or peak_tbs <= 0:
        raise ValueError(f"peaks: expected positive values, got {peak_tflops} TFLOP/s and {peak_tbs} TB/s")
    return max(n_flops / (peak_tflops * 1e12), n_bytes / (peak_tbs * 1e12)) * 1e3


@dataclass(frozen=True)
class Peaks:
    tflops: float  # dense matmul in the benchmark dtype
    tbs: float  # device-to-device copy, read + write


# (matmul n, copy bytes) per device type
_PEAK_SIZES = {"cuda": (8192, 2**30), "cpu": (1024, 2**28)}


# timed runs stop once they have taken this long (a host without bf16 matmul units takes seconds per run)
_PEAK_BUDGET_S = 1.0


def _best_seconds(fn, device: torch.device, reps: int) -> float:
    fn()
    best = float("inf")
    started = time.perf_counter()
    for _ in range(reps):
        if best < float("inf") and time.perf_counter() - started > _PEAK_BUDGET_S:
            break
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def measure_peaks(device: torch.device, dtype: torch.dtype, reps: int = 10) -> Peaks:
    """Best-of-``reps`` throughput of a square matmul in ``dtype`` and of a large copy, with torch on ``device``
    (fewer runs where they pass ``_PEAK_BUDGET_S``, at least one after a warm-up)."""
    if device.type not in _PEAK_SIZES:
        raise ValueError(f"device: peaks are measured on {sorted(_PEAK_SIZES)}, got {device}")
    n, nbytes = _PEAK_SIZES[device.type]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    mm = _best_seconds(lambda: torch.mm(a, b, out=out), device, reps)
    del a, b, out
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy = _best_seconds(lambda: dst.copy_(src), device, reps)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Peaks(tflops=2 * n**3 / mm / 1e12, tbs=2 * nbytes / copy / 1e12)
