"""Calling torch-linked CUDA kernel libraries (DeepGEMM, SonicMoE) from JAX without copies.

A ``jax.experimental.buffer_callback`` hands the callback XLA's buffers and XLA's CUDA stream (``ctx.stream``). The
libraries launch on torch's current stream and allocate through torch, so the callback views the buffers with
``torch.from_dlpack`` (zero copy) and runs the library with torch's current stream set to XLA's. torch is imported
at the first call, by the backends that need it alone.

``Replays`` keeps CUDA graphs of a callback's torch work, so that a callback seen again with the same buffers
replays its kernels instead of running the library's Python (``MOE_JAX_CALLBACK_GRAPHS=0`` turns that off).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping

_DLPACK_CUDA = 2  # DLPack's kDLCUDA
_STREAMS: dict[tuple[int, int], object] = {}
CALLBACK_GRAPHS = os.environ.get("MOE_JAX_CALLBACK_GRAPHS", "1") != "0"


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


_CAPTURE_STREAMS: dict[int, object] = {}


def capture_cuda_graph(work: Callable[[], None]):
    """A CUDA graph of ``work``'s kernels (captured, not run), on a side stream of the current device.
    ``torch.cuda.graph`` is not used: it synchronizes the device and empties torch's allocator cache at every
    capture. ``thread_local``: XLA's other threads may keep launching while this one captures."""
    torch = torch_module()
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(_CAPTURE_STREAMS[device]):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            work()
        finally:
            graph.capture_end()
    return graph


def device_addresses(buffers: list) -> list[int] | None:
    """The device address of each of XLA's buffers (``__cuda_array_interface__``; no view is made), or None for
    host buffers (the first buffer decides: one callback's buffers live on one device)."""
    if buffers[0].__dlpack_device__()[0] != _DLPACK_CUDA:
        return None
    return [b.__cuda_array_interface__["data"][0] for b in buffers]


@functools.cache
def _cu_graph_launch():
    import ctypes
    launch = ctypes.CDLL("libcuda.so.1").cuGraphLaunch
    launch.argtypes, launch.restype = (ctypes.c_void_p, ctypes.c_void_p), ctypes.c_int
    return launch


def launch_graph(graph, stream: int) -> None:
    """Launch a captured ``torch.cuda.CUDAGraph`` on a raw CUDA stream (XLA's): ``cuGraphLaunch`` of its executable,
    what ``graph.replay()`` does on torch's current stream, without making that stream torch's first. (The graphs
    here hold no random-number kernels, whose offsets ``replay`` would advance.) A torch whose graphs do not give
    their executable (``raw_cuda_graph_exec``) replays them with XLA's stream made torch's current."""
    if not hasattr(graph, "raw_cuda_graph_exec"):
        torch = torch_module()
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            graph.replay()
        return
    status = _cu_graph_launch()(graph.raw_cuda_graph_exec(), stream)
    if status:
        raise RuntimeError(f"cuGraphLaunch of a callback's CUDA graph on stream {stream:#x} failed: CUresult {status}")


class Replays:
    """CUDA graphs of one callback's torch work, launched on XLA's stream.

    The key is XLA's stream and the addresses of every buffer the work reads or writes. A key's first call runs the
    work directly (lazy set-up such as autotuning and compiling stays out of the capture); its second call captures
    a graph, and every later call replays it (``replay``: from the addresses alone, before any torch view or stream
    switch is made). Only for work that never reads the device from the host (a capture raises where it would), so
    a graph depends on the addresses alone. At most ``limit`` graphs are kept, the least recently used going first.
    """

    def __init__(self, limit: int = 16, capture: Callable[[Callable[[], None]], object] = capture_cuda_graph,
                 launch: Callable[[object, int], None] = launch_graph):
        self.limit, self.capture, self.launch = limit, capture, launch
        self.seen: OrderedDict = OrderedDict()
        self.graphs: OrderedDict = OrderedDict()
        self.counts = Counter()  # "run", "capture", "replay": what the calls did

    @staticmethod
    def key(ctx, buffers: list) -> tuple | None:
        """XLA's stream and the address of every buffer (no view made), or None where the work just runs: graphs
        off, or host buffers (whose callback context has no stream)."""
        addresses = device_addresses(buffers) if CALLBACK_GRAPHS else None
        return None if addresses is None else (ctx.stream, *addresses)

    def replay(self, key: tuple | None) -> bool:
        """Launch the graph kept for ``key`` on its stream; False when there is none."""
        graph = self.graphs.get(key)
        if graph is None:
            return False
        self.graphs.move_to_end(key)
        self.counts["replay"] += 1
        self.launch(graph, key[0])
        return True

    def run(self, key: tuple | None, work: Callable[[], None]) -> None:
        """A call ``replay`` could not serve: run ``work`` (a key's first call, or no key), or capture its graph (a
        key's second call) and launch it."""
        if key is None or key not in self.seen:
            if key is not None:
                self._keep(self.seen, key, True)
            self.counts["run"] += 1
            work()
            return
        self.counts["capture"] += 1
        self._keep(self.graphs, key, self.capture(work))
        self.replay(key)

    def _keep(self, table: OrderedDict, key, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.limit:
            table.popitem(last=False)


def graphed_callback(body: Callable[[dict, dict, dict], None], replays: Replays | None = None) -> Callable:
    """A ``buffer_callback`` callback ``(ctx, out, inputs, more)`` that runs ``body(inputs, more, out)`` on torch views
    of the three buffer dicts, on XLA's stream with autograd off, kept as CUDA graphs by ``replays`` (a new
    ``Replays`` by default): a call with a graph for its buffers' addresses launches it and makes no view."""
    replays = Replays() if replays is None else replays

    def callback(ctx, out, inputs, more):
        buffers = [*inputs.values(), *more.values(), *out.values()]
        key = replays.key(ctx, buffers)
        if replays.replay(key):
            return
        with on_xla_stream(ctx, buffers[0]):
            t, m, o = views(inputs), views(more), views(out)
            replays.run(key, lambda: body(t, m, o))

    return callback
