"""Calling torch-linked CUDA kernel libraries (DeepGEMM, SonicMoE) from JAX without copies.

A ``jax.experimental.buffer_callback`` hands the callback XLA's buffers and XLA's CUDA stream (``ctx.stream``). The
libraries launch on torch's current stream and allocate through torch, so the callback views the buffers with
``torch.from_dlpack`` (zero copy) and runs the library with torch's current stream set to XLA's. torch is imported
at the first call, by the backends that need it alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

_DLPACK_CUDA = 2  # DLPack's kDLCUDA
_STREAMS: dict[tuple[int, int], object] = {}


def torch_module():
    import torch
    return torch


@contextlib.contextmanager
def on_xla_stream(ctx, buffer) -> Iterator[None]:
    """torch's current stream set to XLA's for the device of ``buffer`` (nothing to set for a host buffer), and
    autograd off: JAX differentiates through ``custom_vjp``, while a thread's grad mode starts on and would send every
    torch custom op inside the library through its autograd layer."""
    torch = torch_module()
    kind, index = buffer.__dlpack_device__()
    with torch.no_grad():
        if kind != _DLPACK_CUDA:
            yield
            return
        key = (ctx.stream, index)
        if key not in _STREAMS:  # XLA keeps one compute stream per device: one torch object each
            _STREAMS[key] = torch.cuda.ExternalStream(ctx.stream, device=torch.device("cuda", index))
        with torch.cuda.stream(_STREAMS[key]):
            yield


def views(buffers: Mapping) -> dict:
    """name -> torch tensor viewing the buffer (no copy). The callback runs on XLA's stream, where the buffers are
    ready, so they are taken as DLPack capsules with no stream handshake (``torch.from_dlpack(buffer)`` looks up
    torch's current stream for each one: 0.11-0.17 ms for a sonicmoe forward's 15 buffers on the H200, against
    0.03-0.04)."""
    torch = torch_module()
    return {name: torch.from_dlpack(b.__dlpack__()) for name, b in buffers.items()}
