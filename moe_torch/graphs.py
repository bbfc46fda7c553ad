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

Training graphs (``MOE_TORCH_TRAINING_GRAPHS``: ``auto`` by default, ``off`` never): a backend's training step within
the spec's ``training_graphs`` bound (``batched_mm``'s and ``grouped_mm``'s: a named activation without biases)
replays its forward and its backward up to the weight gradients as two graphs of this pool (``replay``); see
``moe_torch.training_step``.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch

from moe_shared.spec import load_spec

from . import slot_blas
from .base import device_class

VARIABLE = "MOE_TORCH_GRAPHS"
TRAINING_VARIABLE = "MOE_TORCH_TRAINING_GRAPHS"
TRAINING_DEVICES = ("cuda",)
MAX_GRAPHS = 256
FOREACH_COPIES = True  # a call's inputs into a graph's buffers as one multi-tensor copy per dtype
# The capture's rules bind the capturing thread only: in torch's default ("global") a CUDA call another thread of the
# process makes meanwhile (XLA's, where JAX runs alongside) is refused and invalidates the capture.
CAPTURE_ERROR_MODE = "thread_local"
_SETTINGS = ("auto", "off")


class _Graph:
    """A captured call: the graph, the buffers it reads its per-call inputs from (grouped by dtype, one
    multi-tensor copy per group: fewer launches per call), and what it writes (the call's result: a tensor, or a
    tuple of tensors and Nones)."""

    __slots__ = ("graph", "inputs", "output", "copy_groups")

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: tuple[torch.Tensor, ...], output):
        self.graph, self.inputs, self.output = graph, inputs, output
        groups: dict[torch.dtype, list[int]] = {}
        for i, buffer in enumerate(inputs):
            groups.setdefault(buffer.dtype, []).append(i)
        self.copy_groups = tuple(tuple(group) for group in groups.values())

    def take(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Copy a call's inputs into the graph's buffers."""
        for group in self.copy_groups:
            if len(group) == 1 or not FOREACH_COPIES:
                for i in group:
                    self.inputs[i].copy_(inputs[i])
            else:
                torch._foreach_copy_([self.inputs[i] for i in group], [inputs[i] for i in group])


_GRAPHS: OrderedDict[tuple, _Graph | None] = OrderedDict()  # None: the capture failed, the call runs plainly
_POOLS: dict[int, tuple] = {}


def _setting(variable: str, default: str) -> bool:
    value = os.environ.get(variable, default)
    if value not in _SETTINGS:
        raise ValueError(f"{variable}: expected one of {list(_SETTINGS)}, got {value!r}")
    return value == "auto"


def enabled() -> bool:
    return _setting(VARIABLE, "auto")


def allowed(implementation: str, activation, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
            slots: int, training: bool = False) -> bool:
    """Whether calls of this signature may run as graphs: a named activation, and at most the expert weights (T*k
    slots times one expert's) that the backend's spec entry allows on this device class (``graphs``, or
    ``training_graphs`` for a training step)."""
    backend = load_spec().backends.get(implementation)
    if backend is None or "torch" not in backend.frameworks:
        return False
    support = backend.frameworks["torch"]
    limit_mib = (support.training_graphs if training else support.graphs).get(device_class(gate_up_proj.device), 0)
    expert_bytes = (math.prod(gate_up_proj.shape[1:]) + math.prod(down_proj.shape[1:])) * gate_up_proj.element_size()
    return isinstance(activation, str) and 0 < slots * expert_bytes <= limit_mib << 20


def training_wanted(implementation: str, activation, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """Whether a training call runs its step as training graphs: the setting on, a device of TRAINING_DEVICES,
    outside torch.compile and outside a capture of the caller's, within the spec's training bound (``allowed``)."""
    if not _setting(TRAINING_VARIABLE, "auto") or hidden_states.device.type not in TRAINING_DEVICES:
        return False
    if torch.compiler.is_compiling() or (hidden_states.device.type == "cuda"
                                         and torch.cuda.is_current_stream_capturing()):
        return False
    return allowed(implementation, activation, gate_up_proj, down_proj, top_k_index.numel(), training=True)


def training_key(implementation: str, activation: str, per_call: tuple[torch.Tensor, ...],
                 weights: tuple[torch.Tensor, ...]) -> tuple:
    """The signature of a training graph: the backend, the activation, each per-call tensor's shape, strides, dtype
    and device, and ``weights_key`` of the weights."""
    return (implementation, "training", activation, tuple((t.shape, t.stride(), t.dtype, t.device) for t in per_call),
            weights_key(weights))


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
    return replay(key, call, inputs).clone()


def replay(key: tuple, call: Callable, inputs: tuple[torch.Tensor, ...]):
    """``call(*inputs)``'s result as the graph of ``key`` leaves it (captured now where there is none): the graph's
    own tensors, which its next replay overwrites, so read them before then (on this stream); ``call`` reads the
    weights of ``key`` where they lie. Where the capture failed, ``call(*inputs)`` itself."""
    entry = _GRAPHS.get(key, _GRAPHS)
    if entry is _GRAPHS:
        entry = _capture(call, inputs)
        _GRAPHS[key] = entry
        if len(_GRAPHS) > MAX_GRAPHS:
            _GRAPHS.popitem(last=False)
            _warn_evicting()
    else:
        _GRAPHS.move_to_end(key)
    if entry is None:
        return call(*inputs)
    entry.take(inputs)
    entry.graph.replay()
    return entry.output


_warned_of_eviction = False


def _warn_evicting() -> None:
    global _warned_of_eviction
    if not _warned_of_eviction:
        _warned_of_eviction = True
        warnings.warn(f"moe_torch: more than MAX_GRAPHS={MAX_GRAPHS} graph signatures; the least recently used are "
                      f"dropped and captured again when called (each capture costs a warm-up call). Weights that move "
                      f"to new memory at every step (re-gathered or re-allocated) make a new signature each time: "
                      f"there set {VARIABLE}=off and {TRAINING_VARIABLE}=off", RuntimeWarning, stacklevel=4)


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
            with torch.cuda.graph(graph, pool=_pool(device), capture_error_mode=CAPTURE_ERROR_MODE):
                output = call(*buffers)
        except RuntimeError as err:  # e.g. a host sync in a path the spec did not foresee: run the call plainly
            warnings.warn(f"moe_torch: the decode graph of this call could not be captured, it runs without one "
                          f"({type(err).__name__}: {err})", RuntimeWarning, stacklevel=4)
            return None
    return _Graph(graph, buffers, output)


def release() -> None:
    """Drop every graph (decode and training) and the pools' memory they held."""
    _GRAPHS.clear()
    _POOLS.clear()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def count() -> int:
    """How many captured graphs are kept."""
    return sum(entry is not None for entry in _GRAPHS.values())
