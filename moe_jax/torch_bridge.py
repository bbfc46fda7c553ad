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


def torch_module():
    import torch
    return torch


@contextlib.contextmanager
def on_xla_stream(ctx, buffer) -> Iterator[None]:
    """torch's current stream set to XLA's for the device of ``buffer`` (nothing to set for a host buffer)."""
    torch = torch_module()
    kind, index = buffer.__dlpack_device__()
    if kind != _DLPACK_CUDA:
        yield
        return
    with torch.cuda.stream(torch.cuda.ExternalStream(ctx.stream, device=torch.device("cuda", index))):
        yield


def views(buffers: Mapping) -> dict:
    """name -> torch tensor viewing the buffer (no copy)."""
    torch = torch_module()
    return {name: torch.from_dlpack(b) for name, b in buffers.items()}
