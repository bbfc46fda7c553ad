"""Decode graphs: decode-size inference calls on CUDA replayed as CUDA graphs.

At decode an uncompiled call is host-bound (on the H100, qwen3-30b-a3b at T=1: 0.38 ms a call for 0.095 ms of
kernels). For a backend whose spec entry has a bound for the device class in ``graphs``, an inference call (no
tensor takes gradients) that may read at most that many MiB of expert weights (T*k slots times one expert's),
outside torch.compile and outside a CUDA graph capture of the caller's, runs as a graph: captured at the first call
of its signature (the backend, the activation, the inputs' shapes and dtypes, each weight's address, shape, strides
and dtype), after one warm-up call on a side stream; every later call copies the hidden states, routing ids and
routing weights into the graph's own buffers, replays it on the current stream and returns a copy of its output. The
same kernels run, so the output has the same bits as the plain call. Weights updated in place are read as they are
at each replay; a weight tensor replaced by another is a new signature, as are other settings of deterministic
algorithms and reduced-precision matmuls (they pick kernels at capture).

Memory: every graph of a device allocates from one pool, which keeps the largest call's working memory (a few MiB of
activations; batched_mm's gathered weights where it cannot read them in place) plus each graph's buffers; at most
MAX_GRAPHS graphs are kept (the least recently used goes first); ``release()`` drops them all.
``MOE_TORCH_GRAPHS``: ``auto`` (default) as above, ``off`` never. Calls from several threads or on several streams at
once should turn it off.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch

from . import slot_blas

VARIABLE = "MOE_TORCH_GRAPHS"
MAX_GRAPHS = 256
_SETTINGS = ("auto", "off")


class _Graph:
    """A captured call: the graph, the buffers it reads its per-call inputs from, and the one it writes."""

    __slots__ = ("graph", "inputs", "output")

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: tuple[torch.Tensor, ...], output: torch.Tensor):
        self.graph, self.inputs, self.output = graph, inputs, output


_GRAPHS: OrderedDict[tuple, _Graph | None] = OrderedDict()  # None: the capture failed, the call runs plainly
_POOLS: dict[int, tuple] = {}


def enabled() -> bool:
    value = os.environ.get(VARIABLE, "auto")
    if value not in _SETTINGS:
        raise ValueError(f"{VARIABLE}: expected one of {list(_SETTINGS)}, got {value!r}")
    return value == "auto"


def wanted(per_call: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether a call whose signature allows a graph runs as one now: no tensor of ``per_call`` takes gradients, no
    capture of the caller's is under way, and the setting is on."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in per_call):
        return False
    return enabled() and not torch.cuda.is_current_stream_capturing()


def weights_key(tensors) -> tuple:
    """What a graph depends on besides the call's signature: each tensor it reads in place (address, shape, strides,
    dtype) and the settings that pick kernels at capture (deterministic algorithms, reduced-precision matmuls)."""
    matmul = torch.backends.cuda.matmul
    return (tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors),
            torch.are_deterministic_algorithms_enabled(), matmul.allow_tf32,
            matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)


def run(key: tuple, call: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``call(*inputs)`` through the graph of ``key`` (captured now where there is none); ``call`` reads the weights
    of ``key`` where they lie."""
    entry = _GRAPHS.get(key, _GRAPHS)
    if entry is _GRAPHS:
        entry = _capture(call, inputs)
        _GRAPHS[key] = entry
        if len(_GRAPHS) > MAX_GRAPHS:
            _GRAPHS.popitem(last=False)
    else:
        _GRAPHS.move_to_end(key)
    if entry is None:
        return call(*inputs)
    for buffer, t in zip(entry.inputs, inputs):
        buffer.copy_(t)
    entry.graph.replay()
    return entry.output.clone()


def _pool(device: torch.device) -> tuple:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _POOLS:
        _POOLS[index] = torch.cuda.graph_pool_handle()
    return _POOLS[index]


def _capture(call, inputs) -> _Graph | None:
    """One warm-up call on a side stream (lazy initialisation, kernel compilation), then the capture."""
    device = inputs[0].device
    with torch.cuda.device(device), torch.inference_mode(False), torch.no_grad(), slot_blas.own_arrays():
        buffers = tuple(t.clone() for t in inputs)
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            call(*buffers)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=_pool(device)):
                output = call(*buffers)
        except RuntimeError as err:  # e.g. a host sync in a path the spec did not foresee: run the call plainly
            warnings.warn(f"moe_torch: the decode graph of this call could not be captured, it runs without one "
                          f"({type(err).__name__}: {err})", RuntimeWarning, stacklevel=4)
            return None
    return _Graph(graph, buffers, output)


def release() -> None:
    """Drop every decode graph and the pools' memory they held."""
    _GRAPHS.clear()
    _POOLS.clear()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def count() -> int:
    """How many captured graphs are kept."""
    return sum(entry is not None for entry in _GRAPHS.values())
