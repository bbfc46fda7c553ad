"""The torch and JAX runners behind one interface; ``RUNNERS`` maps a framework name to its runner class.

A runner converts the shared torch inputs (``inputs.py``) to its arrays, builds the call of one point and times
it. A series' variant says how it runs: torch, uncompiled or torch.compile in one mode (fullgraph backends only;
see ``TorchRunner.variants``); JAX, jitted, except backends the spec marks ``jit = false`` (run un-jitted;
``--compile`` does not apply). Peer series (``peers.py``) run next to our backends under the same rules.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

import moe_torch
from moe_shared import load_spec
from moe_torch import ExpertsInterface

from . import environment
from .budget import GIB
from .inputs import InputSet, Weights
from .peers import PEERS, peers_of, tokamax_weights

SPEC = load_spec()


@dataclass(frozen=True)
class Timing:
    warmup: int = 1  # rounds over every input set before timing (the first call compiles); at least 1
    min_reps: int = 3
    max_reps: int = 100
    min_time: float = 0.2  # seconds of timed calls per point, within [min_reps, max_reps]
    stream_rounds: int = 5  # back-to-back rounds over the input sets, after the calls timed alone
    graphed_max_tokens: int = 256  # forward points up to this many tokens also time graphed_ms (0: none)


@dataclass
class Measurement:
    ms: list[float]
    peak_mem_gib: float | None
    output: np.ndarray  # forward output on input set 0, float32
    run_s: float  # wall time of warm-up and timing, without one-off compilation
    stream_ms: list[float] = ()  # per call, each sample a round of calls issued back to back
    wall_ms: list[float] = ()  # each timed call on the host's clock, from the call to its result being ready
    # in a CUDA-graph compile mode where those graphs apply: how many compiled graphs ran without them
    cudagraph_skips: int | None = None
    graphed_ms: list[float] = ()  # per call within one captured program of the input sets' calls (Runner.graphed)
    timed_s: float = 0.0  # wall time of the timed calls (alone, back to back, graphed)
    stolen_s: float | None = None  # CPU time the hypervisor took from the machine meanwhile (None: not reported)

    @property
    def cpu_steal(self) -> float | None:
        """The share of the machine's CPU time the hypervisor took while the calls were timed."""
        if self.stolen_s is None or self.timed_s <= 0:
            return None
        return self.stolen_s / (self.timed_s * (os.cpu_count() or 1))

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms)

    @property
    def median_wall_ms(self) -> float:
        return statistics.median(self.wall_ms or self.ms)

    @property
    def median_stream_ms(self) -> float | None:
        return statistics.median(self.stream_ms) if self.stream_ms else None

    @property
    def median_graphed_ms(self) -> float | None:
        return statistics.median(self.graphed_ms) if self.graphed_ms else None


Variant = str | None
"""How a series runs: torch, None (uncompiled) or a torch.compile mode; JAX, "jit" or None (un-jitted)."""

JIT = "jit"
# torch.compile modes from the most to the least a user gets out of the compiler; "best" is the first of these
# that the spec's compile table allows for the backend (for a peer, its counterpart). cudagraph modes only act on
# CUDA; on CPU they compile like their cudagraph-free counterparts.
COMPILE_PREFERENCE = ("max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead", "default")
CUDA_GRAPH_MODES = frozenset({"max-autotune", "reduce-overhead"})


class Runner(ABC):
    framework: ClassVar[str]
    tokens: int = 0  # of the input sets loaded last

    def __init__(self, device: torch.device):
        self.device = device

    @abstractmethod
    def availability(self) -> dict[str, str | None]:
        """Every backend of the framework and every peer series -> None if it runs on the device, else why not."""

    @abstractmethod
    def variants(self, backend: str, dtype: str, compile_flags: Collection[bool],
                 compile_mode: str) -> dict[Variant, str | None]:
        """variant -> None to run it, or the reason it is skipped."""

    @staticmethod
    @abstractmethod
    def label(variant: Variant) -> str:
        """The variant suffix in labels ("" for the framework's plain way of running)."""

    @abstractmethod
    def load(self, weights: Weights, sets: list[InputSet]) -> None:
        """Take this point's inputs (weights stay the same across the token counts of a config)."""

    @abstractmethod
    def build(self, backend: str, mode: str, variant: Variant) -> Callable[[int], Any]:
        """The call on input set i; it returns what ``finish`` waits on and ``forward_output`` reads."""

    @abstractmethod
    def finish(self, result: Any) -> None:
        """Block until ``result`` is computed."""

    @abstractmethod
    def forward_output(self, result: Any) -> np.ndarray:
        ...

    @abstractmethod
    def is_out_of_memory(self, err: BaseException) -> bool:
        ...

    def release(self) -> None:
        """Drop the loaded inputs."""

    def cudagraph_skips(self) -> int | None:
        """How many compiled graphs so far ran without the CUDA graphs their compile mode asks for (a running
        count); None where CUDA graphs do not apply."""
        return None

    def recompiles_per_routing(self, variant: Variant) -> bool:
        """Whether this variant compiles again for new expert row counts (its warm-up grows with the hits)."""
        return False

    def clock(self, call: Callable[[int], Any], i: int) -> tuple[float, float, Any]:
        """Milliseconds of one call, the same on the host's clock (from the call to its result being ready: what
        both frameworks measure alike), and its result."""
        t0 = time.perf_counter()
        result = call(i)
        self.finish(result)
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms, result

    def clock_stream(self, call: Callable[[int], Any], n: int) -> float:
        """Milliseconds per call of ``n`` calls issued back to back (inputs 0..n-1), waited for once at the end: the
        host work of a call overlaps the device work of the one before, as between the layers of a model."""
        t0 = time.perf_counter()
        results = [call(i) for i in range(n)]
        for result in results:
            self.finish(result)
        return (time.perf_counter() - t0) * 1e3 / n

    def graphed(self, backend: str, variant: Variant, call: Callable[[int], Any], n_sets: int,
                rounds: int) -> list[float]:
        """Samples of ``graphed_ms`` for a forward series, or none where this runner has no such program for it:
        the time a call adds inside one program that a caller captured whole (a model's decode step as one CUDA
        graph or one jitted function), without the program's own launch and dispatch. Each sample: (time of the
        program making the calls of every input set - time of the program making the call of set 0) / (sets - 1),
        the two programs run in turn."""
        return []

    def start_memory(self) -> None:
        """Called after the warm-up, before the timed calls."""

    def peak_memory_gib(self) -> float | None:
        """Peak memory of one call (arguments included) since ``start_memory``; None where not measured."""
        return None

    def memory_detail(self) -> dict[str, float]:
        """What the device holds now and what the last built call needs, in GiB (an out-of-memory skip records
        it); empty where nothing is known."""
        if self.device.type != "cuda":
            return {}
        return {"torch_allocated_gib": round(torch.cuda.memory_allocated(self.device) / GIB, 2),
                "torch_reserved_gib": round(torch.cuda.memory_reserved(self.device) / GIB, 2)}

    def measure(self, backend: str, mode: str, variant: Variant, n_sets: int, timing: Timing) -> Measurement:
        """Build, warm up, time. ``run_s`` leaves out what is paid once: the build (JAX compiles there) and,
        when compiled, the first call (torch.compile compiles there)."""
        with self.measuring():
            try:
                return self._measure(backend, mode, variant, n_sets, timing)
            finally:
                self.after_point()

    def after_point(self) -> None:
        """Called after each point, measured or failed."""

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """The state of the process while one point is built and timed."""
        yield

    def _measure(self, backend: str, mode: str, variant: Variant, n_sets: int, timing: Timing) -> Measurement:
        call = self.build(backend, mode, variant)
        skips_before = self.cudagraph_skips() if variant in CUDA_GRAPH_MODES else None
        built = time.perf_counter()
        self.finish(call(0))
        setup_end = time.perf_counter() if variant is not None else built
        for r in range(timing.warmup):
            for i in range(n_sets):
                if r or i:
                    self.finish(call(i))
        self.start_memory()
        samples: list[float] = []
        walls: list[float] = []
        stolen_before = environment.stolen_seconds()
        start = time.perf_counter()
        while len(samples) < timing.max_reps and (len(samples) < timing.min_reps
                                                  or time.perf_counter() - start < timing.min_time):
            ms, wall, result = self.clock(call, len(samples) % n_sets)
            samples.append(ms)
            walls.append(wall)
            if len(samples) == 1:
                output = self.forward_output(result)
        peak = self.peak_memory_gib()
        stream = [self.clock_stream(call, n_sets) for _ in range(timing.stream_rounds)]
        graphed = (self.graphed(backend, variant, call, n_sets, timing.stream_rounds)
                   if mode == "fwd" and n_sets > 1 and self.tokens <= timing.graphed_max_tokens else [])
        timed_s = time.perf_counter() - start
        stolen_after = environment.stolen_seconds()
        return Measurement(samples, peak, output, run_s=time.perf_counter() - setup_end, stream_ms=stream,
                           wall_ms=walls,
                           cudagraph_skips=None if skips_before is None else self.cudagraph_skips() - skips_before,
                           graphed_ms=graphed, timed_s=timed_s,
                           stolen_s=None if None in (stolen_before, stolen_after) else stolen_after - stolen_before)


def marginal_samples(clock_all: Callable[[], float], clock_one: Callable[[], float], n_sets: int,
                     rounds: int) -> list[float]:
    """``rounds`` samples of (clock_all() - clock_one()) / (n_sets - 1), the two clocked in turn."""
    return [(clock_all() - clock_one()) / (n_sets - 1) for _ in range(rounds)]


def requested_modes(compile_mode: str, allowed: Collection[str]) -> list[str]:
    """The torch.compile modes asked for by ``--compile-mode``: "best" (the first of ``COMPILE_PREFERENCE`` in
    ``allowed``, or "best" itself when none is), "all" (every allowed mode) or a comma-separated list."""
    if compile_mode == "best":
        return [next((m for m in COMPILE_PREFERENCE if m in allowed), "best")]
    if compile_mode == "all":
        return [m for m in COMPILE_PREFERENCE if m in allowed] or ["all"]
    return [m.strip() for m in compile_mode.split(",") if m.strip()]


class TorchRunner(Runner):
    """moe_torch.experts_forward with validate=False, and the transformers peers (``peers.py``). Compiled:
    torch.compile(fullgraph=True, dynamic=False, mode=...) after torch._dynamo.reset(), once per point, in the
    modes of ``--compile-mode`` that the spec's compile table allows for the backend (a peer follows its
    counterpart's entry). The eager backend is not compiled: the spec marks it not fullgraph-compatible, and its
    data-dependent expert loop recompiles per routing until dynamo gives up and runs it uncompiled, so a
    "compiled" timing would not be one."""

    framework = "torch"
    CUDA_GRAPH_DEVICES = ("cuda",)  # elsewhere the CUDA-graph modes compile like their counterparts without them

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._base_memory = 0
        self._call_bytes = 0
        self.traced: Callable | None = None  # the function torch.compile traced last (bench.profile checks its guards)

    def cudagraph_skips(self):
        """inductor's count of the graphs it ran without CUDA graphs in a CUDA-graph mode (each is also logged as
        a "skipping cudagraphs due to ..." warning)."""
        if self.device.type not in self.CUDA_GRAPH_DEVICES:
            return None
        from torch._dynamo.utils import counters
        return counters["inductor"]["cudagraph_skips"]

    def availability(self) -> dict[str, str | None]:
        return moe_torch.available_backends(self.device) | {n: p.unavailable() for n, p in peers_of("torch").items()}

    def variants(self, backend, dtype, compile_flags, compile_mode):
        result: dict[Variant, str | None] = {}
        if False in compile_flags:
            result[None] = None
        if True in compile_flags:
            support = ExpertsInterface.capability(PEERS[backend].counterpart if backend in PEERS else backend)
            spec = support.compile if support is not None else None
            for mode in requested_modes(compile_mode, spec.modes if spec is not None else ()):
                result[mode] = self._compile_skip(spec, dtype, mode)
        return result

    @staticmethod
    def _compile_skip(spec, dtype: str, compile_mode: str) -> str | None:
        if spec is None:
            return "not compiled: no torch.compile support declared"
        if not spec.fullgraph:
            return "not compiled: not fullgraph-compatible (data-dependent loop; dynamo would fall back to eager)"
        if compile_mode not in spec.modes:
            return f"not compiled: compile mode {compile_mode!r} not in the spec's {list(spec.modes)}"
        if dtype not in spec.dtypes:
            return f"not compiled: dtype {dtype} not in the spec's compile dtypes {list(spec.dtypes)}"
        return None

    @staticmethod
    def label(variant):
        if variant is None:
            return ""
        return "compiled" if variant == "default" else f"compiled-{variant}"

    def load(self, weights, sets):
        self.weights = weights
        self.sets = sets
        self.tokens = sets[0].hidden_states.shape[0]
        self._call_bytes = weights.nbytes + sets[0].nbytes
        grad_weights = [t.detach().requires_grad_(True) for t in (weights.gate_up, weights.down)]
        self._leaves = [(s.hidden_states.detach().requires_grad_(True), s.top_k_weights.detach().requires_grad_(True),
                         *grad_weights) for s in sets]

    def release(self):
        self.weights = self.sets = self._leaves = None
        if self.device.type == "cuda":
            moe_torch.graphs.release()  # the decode graphs read these weights and hold their pool's memory
            torch.cuda.empty_cache()

    def _forward(self, backend: str) -> Callable:
        if backend in PEERS:
            E, H, I = self.weights.down.shape
            return PEERS[backend].make(E, H, I)

        def forward(x, index, w, gate_up, down):
            return moe_torch.experts_forward(x, index, w, gate_up, down, implementation=backend, validate=False)
        return forward

    def build(self, backend, mode, variant, compiler: Callable | None = None):
        """``compiler``: a torch.compile backend to trace with instead of inductor in the mode ``variant``."""
        forward = self._forward(backend)
        if variant is not None:
            torch._dynamo.reset()
            # the weights as a model's parameters are: static addresses (the CUDA-graph modes copy every other
            # input into the graph's own buffers at each replay: 1.2 GB of qwen3-30b-a3b weights per call)
            for weight in (self.weights.gate_up, self.weights.down, *self._leaves[0][2:]):
                torch._dynamo.mark_static_address(weight)
            how = {"mode": variant} if compiler is None else {"backend": compiler}
            self.traced = forward
            forward = torch.compile(forward, fullgraph=True, dynamic=False, **how)
        return {"fwd": self._forward_call, "fwd+bwd": self._backward_call}[mode](forward)

    def _forward_call(self, forward):
        def call(i):
            s = self.sets[i]
            with torch.no_grad():
                return forward(s.hidden_states, s.top_k_index, s.top_k_weights, self.weights.gate_up,
                               self.weights.down)
        return call

    def _backward_call(self, forward):
        def call(i):
            x, w, gate_up, down = self._leaves[i]
            out = forward(x, self.sets[i].top_k_index, w, gate_up, down)
            torch.autograd.grad(out, (x, w, gate_up, down), self.sets[i].grad_output)
            return out
        return call

    def finish(self, result):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward_output(self, result):
        return result.detach().float().cpu().numpy()

    def is_out_of_memory(self, err):
        return isinstance(err, torch.OutOfMemoryError)

    def clock(self, call, i):
        if self.device.type != "cuda":
            return super().clock(call, i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        result = call(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end), (time.perf_counter() - t0) * 1e3, result

    def clock_stream(self, call, n):
        if self.device.type != "cuda":
            return super().clock_stream(call, n)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        results = [call(i) for i in range(n)]
        end.record()
        end.synchronize()
        del results
        return start.elapsed_time(end) / n

    def graphed(self, backend, variant, call, n_sets, rounds):
        """On CUDA, uncompiled series of a backend whose spec entry (a peer: its counterpart's) declares decode
        graphs (``graphs``: verified capturable): ``call`` over the input sets captured in one CUDA graph, over set 0
        in another, each replayed and timed by CUDA events. A peer whose call cannot be captured gets none."""
        if self.device.type != "cuda" or variant is not None or not _declares_graphs(backend):
            return []
        try:
            programs = [self._capture(call, count) for count in (n_sets, 1)]
        except RuntimeError:
            if backend in PEERS:
                return []
            raise
        clocks = [functools.partial(self._clock_replay, graph) for graph, _ in programs]
        for clock in clocks:
            clock()
        return marginal_samples(*clocks, n_sets, rounds)

    @staticmethod
    def _capture(call, count: int) -> tuple[torch.cuda.CUDAGraph, list]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = [call(i) for i in range(count)]
        return graph, outputs

    @staticmethod
    def _clock_replay(graph: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def start_memory(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base_memory = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_gib(self):
        if self.device.type != "cuda":
            return None
        peak = torch.cuda.max_memory_allocated(self.device) - self._base_memory
        return (peak + self._call_bytes) / GIB


_JAX_PLATFORMS = {"cpu": "cpu", "cuda": "gpu"}


class JaxRunner(Runner):
    """moe_jax.experts_forward, and the tokamax peer (``peers.py``), on arrays copied from the torch inputs
    (DLPack). Jitted backends are compiled ahead of time once per point (``jax.jit(f).lower(...).compile()``);
    their peak memory is XLA's memory analysis (arguments + outputs + temporaries). Un-jitted backends report no
    peak memory."""

    framework = "jax"

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._unavailable: str | None = None
        self._memory: float | None = None
        self._analysis: dict[str, float] = {}
        self._peer_weights = None
        try:
            import jax
            import moe_jax
            moe_jax.experts_forward, moe_jax.available_backends  # noqa: B018  (the API the runner uses)
        except (ImportError, AttributeError) as err:
            self._unavailable = f"moe_jax cannot be used: {type(err).__name__}: {err}"
            return
        self.jax, self.moe_jax = jax, moe_jax
        self.platform = _JAX_PLATFORMS.get(device.type)
        if self.platform is None:
            self._unavailable = f"no JAX platform for torch device type {device.type!r}"
            return
        try:
            self.jax_device = jax.devices(self.platform)[0]
        except RuntimeError as err:
            self._unavailable = f"JAX has no {self.platform} device: {err}"

    @contextlib.contextmanager
    def measuring(self):
        """On the CPU, torch runs on one thread while a JAX point is timed: torch's OpenMP threads, left spinning by
        the torch points before, otherwise compete with XLA's threads for the cores (qwen3-cpu T=1024: JAX 53.7 ms
        in a process that had run torch points, 36-38 ms without; a Flax user's process has no torch threads)."""
        if self.device.type != "cpu":
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def availability(self):
        peers = peers_of("jax")
        if self._unavailable is not None:
            return {name: self._unavailable for name in (*SPEC.backend_names("jax"), *peers)}
        return dict(self.moe_jax.available_backends(self.platform)) | {n: p.unavailable() for n, p in peers.items()}

    def variants(self, backend, dtype, compile_flags, compile_mode):
        declared = SPEC.backends.get(PEERS[backend].counterpart if backend in PEERS else backend)
        support = declared.frameworks.get("jax") if declared is not None else None
        jit = True if support is None or support.jit is None else bool(support.jit)
        return {JIT if jit else None: None}

    @staticmethod
    def label(variant):
        return "" if variant == JIT else "nojit"

    def _array(self, t: torch.Tensor):
        """A JAX copy of ``t``: a zero-copy DLPack view, then copied (PJRT's C API refuses copy=True on GPU)."""
        view = self.jax.dlpack.from_dlpack(t.detach().contiguous())
        if view.devices() != {self.jax_device}:
            raise RuntimeError(f"DLPack gave an array on {view.devices()}, expected {self.jax_device}")
        return self.jax.numpy.array(view, copy=True)

    def load(self, weights, sets):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._peer_weights is not None and self._peer_weights[0] is not weights:
            self._peer_weights = None
        self.gate_up, self.down = self._array(weights.gate_up), self._array(weights.down)
        self._weights = weights
        self.tokens = sets[0].hidden_states.shape[0]
        self.sets = [(self._array(s.hidden_states), self._array(s.top_k_index.to(torch.int32)),
                      self._array(s.top_k_weights), self._array(s.grad_output)) for s in sets]
        self.jax.block_until_ready((self.gate_up, self.down, self.sets))

    def release(self):
        self.gate_up = self.down = self.sets = None

    def after_point(self):
        # JAX backends on torch-linked kernels (sonicmoe, deepgemm) allocate through torch's caching allocator, whose
        # cached blocks XLA cannot reuse: deepseek-v3's JAX fwd+bwd points ran out of memory behind them
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _weights_for(self, backend: str) -> tuple:
        if backend not in PEERS:
            return self.gate_up, self.down
        if self._peer_weights is None:  # the peer's own layout, made once per config
            self._peer_weights = (self._weights, tokamax_weights(self.gate_up, self.down))
        return self._peer_weights[1]

    def _forward(self, backend: str) -> Callable:
        if backend in PEERS:
            return PEERS[backend].make()
        experts_forward = self.moe_jax.experts_forward

        def forward(x, index, w, gate_up, down):
            return experts_forward(x, index, w, gate_up, down, implementation=backend, validate=False)
        return forward

    def build(self, backend, mode, variant):
        forward = self._forward(backend)

        def forward_backward(x, index, w, gate_up, down, g):
            out, vjp = self.jax.vjp(lambda x, w, gate_up, down: forward(x, index, w, gate_up, down),
                                    x, w, gate_up, down)
            return out, vjp(g)

        gate_up, down = self._weights_for(backend)

        def args(i):
            x, index, w, g = self.sets[i]
            return (x, index, w, gate_up, down) + ((g,) if mode == "fwd+bwd" else ())

        fn = {"fwd": forward, "fwd+bwd": forward_backward}[mode]
        self._memory, self._analysis = None, {}
        if variant is None:
            return lambda i: fn(*args(i))
        executable = self.jax.jit(fn).lower(*args(0)).compile()
        analysis = executable.memory_analysis()
        if analysis is not None:
            self._memory = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                            + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes) / GIB
            self._analysis = {f"xla_{name}_gib": round(getattr(analysis, f"{name}_size_in_bytes") / GIB, 4)
                              for name in ("argument", "output", "temp", "alias")}
        if mode == "fwd+bwd":
            # the forward output alone: the gradients are outputs of the same executable, computed with it and
            # ready with it, so waiting on the output waits for the whole call; dropped at once, they do not pile
            # up over the back-to-back calls (deepseek-v3's weight gradients are 21 GiB a call)
            return lambda i: executable(*args(i))[0]
        return lambda i: executable(*args(i))

    def graphed(self, backend, variant, call, n_sets, rounds):
        """Jitted series: one jitted function making the calls of every input set, one making set 0's, each timed
        on the host's clock until its result is ready. Both take every set's arrays and return one array, so that
        what XLA's dispatch costs per argument and result cancels out (on an H100 it made about 12 us of the 45 us
        a qwen3-30b-a3b T=1 call seemed to add when each call had arguments and a result of its own, against 33
        us between the first and the last kernel, tests/device_results/nvidia-h100-program-timeline.json): each
        call takes the last one's output as its hidden states, the first set's hidden states to start."""
        if variant != JIT:
            return []
        forward = self._forward(backend)
        gate_up, down = self._weights_for(backend)
        args = (gate_up, down, *(a for s in self.sets[:n_sets] for a in s[:3]))

        def program(calls: int):
            def run(gate_up, down, *arrays):
                x = arrays[0]
                for j in range(calls):
                    x = forward(x, arrays[3 * j + 1], arrays[3 * j + 2], gate_up, down)
                return x
            return run

        clocks = [functools.partial(self._clock_program,
                                    self.jax.jit(program(count), keep_unused=True).lower(*args).compile(), args)
                  for count in (n_sets, 1)]
        for clock in clocks:
            clock()
        return marginal_samples(*clocks, n_sets, rounds)

    def _clock_program(self, executable, args) -> float:
        start = time.perf_counter()
        self.jax.block_until_ready(executable(*args))
        return (time.perf_counter() - start) * 1e3

    def finish(self, result):
        self.jax.block_until_ready(result)

    def forward_output(self, result):
        out = result[0] if isinstance(result, tuple) else result
        return np.asarray(out.astype(self.jax.numpy.float32))

    def is_out_of_memory(self, err):
        return "RESOURCE_EXHAUSTED" in str(err)

    def recompiles_per_routing(self, variant):
        return variant is None

    def peak_memory_gib(self):
        return self._memory

    def memory_detail(self):
        stats = self.jax_device.memory_stats() or {}
        held = {f"jax_{name}_gib": round(stats[name] / GIB, 2)
                for name in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if name in stats}
        return super().memory_detail() | self._analysis | held | self._live_arrays()

    def _live_arrays(self, largest: int = 6) -> dict:
        """The arrays JAX holds on the device: how many, their total, and the largest (shape, dtype, GiB), to tell
        the benchmark's own arrays from leftovers."""
        live = [a for a in self.jax.live_arrays() if self.jax_device in a.devices()]
        live.sort(key=lambda a: a.nbytes, reverse=True)
        return {"jax_live_arrays": len(live), "jax_live_gib": round(sum(a.nbytes for a in live) / GIB, 2),
                "jax_largest_live": [f"{tuple(a.shape)} {a.dtype} {a.nbytes / GIB:.2f}" for a in live[:largest]]}


RUNNERS: dict[str, type[Runner]] = {r.framework: r for r in (TorchRunner, JaxRunner)}


def _declares_graphs(backend: str) -> bool:
    declared = SPEC.backends.get(PEERS[backend].counterpart if backend in PEERS else backend)
    support = declared.frameworks.get("torch") if declared is not None else None
    return support is not None and "cuda" in support.graphs  # verified capturable (0: no decode graphs of its own)


def series(framework: str, backend: str, variant: Variant, mode: str | None = None) -> str:
    """"framework:backend[:variant][:mode]", the name of one line in the table and the plot."""
    parts = [framework, backend, RUNNERS[framework].label(variant), mode or ""]
    return ":".join(p for p in parts if p)
