"""The sweep: plan every point (or why it is skipped), run the planned ones, collect records.

Token counts run in increasing order, so that ``SlowSeries`` can stop a series that gets too slow (un-jitted
JAX, for one, compiles every op anew for each distinct expert row count: its warm-up grows with the experts hit).

On a GPU, frameworks run one after the other (all torch points, then all JAX points) so that one framework's
memory is released before the next allocates. On the CPU they take turns at each (config, tokens), in every round,
so that the two frameworks' points of a ratio are timed minutes apart at most, under the same machine state
(``--framework-order``). The float32 reference of each (config, tokens) is computed once.
"""

from __future__ import annotations

import os
import statistics
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from moe_shared import load_spec, relative_l2

from . import budget, inputs, roofline
from .configs import Config
from .progress import progress
from .peers import PEERS, library_of
from .runners import RUNNERS, Measurement, Runner, Timing, Variant, series


@dataclass(frozen=True)
class Options:
    configs: Sequence[Config]
    tokens: Sequence[int] | None  # None: each config's own list
    frameworks: Sequence[str]
    backends: Sequence[str] | None  # None: every available one
    modes: Sequence[str]
    compile_flags: Sequence[bool]
    compile_mode: str
    dtype: str
    device: torch.device
    timing: Timing
    n_sets: int
    seed: int
    memory_budget: float  # bytes
    max_call_s: float
    max_point_s: float
    fail_fast: bool = False
    peers: bool = True  # run the peer series whose package is importable
    resumed: Sequence[dict] = ()  # records of an earlier run (--resume): kept, and their points not run again
    resumed_skips: Sequence[dict] = ()  # points an earlier run skipped (--resume): kept as skipped, not tried again
    rounds: int = 1  # times every point of a (config, tokens) is timed, interleaved; its samples pooled
    framework_order: str = "sequential"  # FRAMEWORK_ORDERS


FRAMEWORK_ORDERS = ("sequential", "interleaved")


def default_framework_order(device: torch.device) -> str:
    """Interleaved on the CPU; sequential on a GPU, where torch's and XLA's allocators each keep what they took."""
    return "interleaved" if device.type == "cpu" else "sequential"


def framework_groups(frameworks: Sequence[str], order: str) -> list[tuple[str, ...]]:
    """The frameworks whose points are timed together, group after group."""
    if order not in FRAMEWORK_ORDERS:
        raise ValueError(f"framework_order: expected one of {FRAMEWORK_ORDERS}, got {order!r}")
    return [tuple(frameworks)] if order == "interleaved" else [(fw,) for fw in frameworks]


def point_key(record: dict) -> tuple:
    """What identifies a measured point across runs."""
    return (record["framework"], record["backend"], record["config"], record["tokens"], record["mode"],
            record["compile_mode"])


@dataclass(frozen=True)
class Point:
    framework: str
    backend: str
    cfg: Config
    tokens: int
    mode: str
    variant: Variant  # None: uncompiled (torch) / un-jitted (JAX); else the compile mode, or "jit"

    @property
    def compiled(self) -> bool:
        return self.variant is not None


@dataclass
class Results:
    peaks: roofline.Peaks
    unavailable: dict[str, dict[str, str]] = field(default_factory=dict)  # framework -> backend -> reason
    records: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)


def _where(framework, backend, cfg, tokens, mode, variant) -> dict:
    return {"framework": framework, "backend": backend, "config": cfg.name, "tokens": tokens, "mode": mode,
            "compiled": variant is not None, "compile_mode": variant}


def _inference_only(framework: str, backend: str) -> bool:
    declared = load_spec().backends.get(PEERS[backend].counterpart if backend in PEERS else backend)
    support = declared.frameworks.get(framework) if declared is not None else None
    return support is not None and not support.training


def _plan(opts: Options, runners: dict[str, Runner], peaks: roofline.Peaks, results: Results) -> list[Point]:
    itemsize = torch.empty(0, dtype=getattr(torch, opts.dtype)).element_size()
    device_class = opts.device.type
    done = {point_key(r) for r in (*opts.resumed, *opts.resumed_skips)}
    points = []
    for fw, runner in runners.items():
        available = runner.availability()
        results.unavailable[fw] = {b: r for b, r in available.items()
                                   if r is not None and (opts.peers or b not in PEERS)}
        names = [b for b, r in available.items() if r is None and (opts.backends is None or b in opts.backends)
                 and (opts.peers or b not in PEERS)]
        for backend in names:
            for variant, reason in runner.variants(backend, opts.dtype, opts.compile_flags,
                                                   opts.compile_mode).items():
                for cfg in opts.configs:
                    if reason is not None:
                        results.skipped.append(_where(fw, backend, cfg, None, None, variant) | {"reason": reason})
                        continue
                    for mode in opts.modes:
                        if mode != "fwd" and _inference_only(fw, backend):
                            results.skipped.append(_where(fw, backend, cfg, None, mode, variant)
                                                   | {"reason": "inference only (the spec's training = false)"})
                            continue
                        for tokens in opts.tokens or cfg.tokens:
                            shape = budget.Shape(cfg, tokens, mode, itemsize)
                            cost_like = PEERS[backend].counterpart if backend in PEERS else backend
                            est = budget.estimate(fw, cost_like, device_class, shape, peaks, opts.n_sets)
                            if (fw, backend, cfg.name, tokens, mode, variant) in done:
                                continue
                            skip = budget.skip_reason(est, opts.memory_budget, opts.max_call_s)
                            if skip is None:
                                points.append(Point(fw, backend, cfg, tokens, mode, variant))
                            else:
                                results.skipped.append(_where(fw, backend, cfg, tokens, mode, variant)
                                                       | {"reason": skip})
    return points


class SlowSeries:
    """Skips the larger token counts of a series (framework, config, backend, variant, mode) that got too slow:
    once a point took longer than ``limit`` s to warm up and time, or, for a variant that recompiles for every
    new routing, once the last point's time scaled by the experts hit would exceed it."""

    def __init__(self, limit: float):
        self.limit = limit
        self.reasons: dict[tuple, str] = {}
        self.last: dict[tuple, tuple[int, float, float]] = {}  # key -> tokens, run_s, hits

    def reason(self, key: tuple, hits: float, recompiles: bool) -> str | None:
        if key not in self.reasons and recompiles and key in self.last:
            tokens, run_s, last_hits = self.last[key]
            predicted = run_s * hits / last_hits
            if predicted > self.limit:
                self.reasons[key] = (f"too slow: ~{predicted:.0f} s to warm up and time, extrapolated by the "
                                     f"experts hit from T={tokens} ({run_s:.1f} s, {last_hits:.1f} hit; un-jitted ops "
                                     f"compile for each new expert row count), limit {self.limit:g} s "
                                     f"(--max-point-s)")
        return self.reasons.get(key)

    def record(self, key: tuple, tokens: int, run_s: float, hits: float) -> None:
        self.last[key] = (tokens, run_s, hits)
        if run_s > self.limit:
            self.reasons[key] = (f"too slow: T={tokens} took {run_s:.0f} s to warm up and time (compilation "
                                 f"excluded), limit {self.limit:g} s (--max-point-s)")


def run(opts: Options, checkpoint: Callable[[Results], None] | None = None) -> Results:
    """Every planned point; ``checkpoint`` is called with the results so far after each one."""
    dtype = getattr(torch, opts.dtype)
    peaks = roofline.measure_peaks(opts.device, dtype)
    names = {c.name for c in opts.configs}
    results = Results(peaks, records=[r for r in opts.resumed if r["config"] in names])
    results.skipped.extend(s for s in opts.resumed_skips if s["config"] in names)
    runners = {fw: RUNNERS[fw](opts.device) for fw in opts.frameworks}
    points = _plan(opts, runners, peaks, results)
    if checkpoint is not None:  # the files exist from the start, holding what was resumed
        checkpoint(results)
    references: dict[tuple[str, int], np.ndarray] = {}
    slow = SlowSeries(opts.max_point_s)
    bar = progress(len(points))
    try:
        for group in framework_groups(list(runners), opts.framework_order):
            for cfg in opts.configs:
                mine = [p for p in points if p.framework in group and p.cfg == cfg]
                if not mine:
                    continue
                weights = inputs.make_weights(cfg, dtype, opts.device, opts.seed)
                for tokens in sorted({p.tokens for p in mine}):
                    here = [p for p in mine if p.tokens == tokens]
                    try:
                        sets = inputs.make_sets(cfg, tokens, dtype, opts.device, opts.seed, opts.n_sets)
                        if (cfg.name, tokens) not in references:
                            references[cfg.name, tokens] = inputs.reference(weights, sets[0])
                    except (torch.OutOfMemoryError, MemoryError) as err:
                        if opts.fail_fast:
                            raise
                        results.skipped.extend(_out_of_memory_skip(p, err, runners[p.framework],
                                                                   " making the inputs") for p in here)
                        bar.update(len(here))
                        if checkpoint is not None:
                            checkpoint(results)
                        continue
                    hits = statistics.fmean(s.hit_experts for s in sets)
                    loaded = []
                    for fw in group:
                        theirs = [p for p in here if p.framework == fw]
                        if not theirs:
                            continue
                        try:
                            runners[fw].load(weights, sets)
                            loaded.append(fw)
                        except Exception as err:  # noqa: BLE001  (reported for each point; --fail-fast re-raises)
                            if opts.fail_fast:
                                raise
                            _fail(theirs, err, "loading the inputs", results, bar)
                            bar.update(len(theirs))
                    del sets
                    measured: dict[Point, list[Measurement]] = {}
                    for p in here:
                        if p.framework not in loaded:
                            continue
                        recompiles = runners[p.framework].recompiles_per_routing(p.variant)
                        reason = slow.reason(_series_key(p), hits, recompiles)
                        if reason is None:
                            measured[p] = []
                        else:
                            results.skipped.append(_where(p.framework, p.backend, cfg, tokens, p.mode, p.variant)
                                                   | {"reason": reason})
                            bar.update(1)
                    for round_ in range(opts.rounds):  # the series take turns; each point recorded after its last
                        for p in list(measured):
                            bar.set_description(f"{cfg.name} {series(p.framework, p.backend, p.variant, p.mode)} "
                                                f"T={tokens}")
                            m = _measure_point(p, runners[p.framework], opts, results, bar)
                            if m is None:  # skipped (out of memory) or failed: recorded, and written out now
                                del measured[p]
                                if checkpoint is not None:
                                    checkpoint(results)
                            else:
                                measured[p].append(m)
                            if round_ == opts.rounds - 1:
                                if m is not None:
                                    run_s = _record_point(p, _pooled(measured[p]), peaks, hits, opts.dtype,
                                                          dtype.itemsize, references[cfg.name, tokens], results)
                                    slow.record(_series_key(p), tokens, run_s / opts.rounds, hits)
                                if checkpoint is not None:
                                    checkpoint(results)
                            if round_ == 0:
                                bar.update(1)
                    for fw in loaded:
                        runners[fw].release()
                del weights
                for fw in group:
                    runners[fw].release()
    finally:
        bar.close()
    return results


def _fail(points: Sequence[Point], err: Exception, doing: str, results: Results, bar) -> None:
    message = f"{doing}: {type(err).__name__}: {err}"
    for p in points:
        results.errors.append(_where(p.framework, p.backend, p.cfg, p.tokens, p.mode, p.variant)
                              | {"error": message})
        bar.write(f"ERROR {p.cfg.name} {series(p.framework, p.backend, p.variant, p.mode)} T={p.tokens}: {message}")
    bar.write(traceback.format_exc(limit=-4))


def _out_of_memory_skip(p: Point, err: BaseException, runner: Runner, doing: str = "") -> dict:
    lines = str(err).splitlines() or [type(err).__name__]
    detail = next((line for line in lines if "memory" in line.lower()), lines[0]).strip()
    return (_where(p.framework, p.backend, p.cfg, p.tokens, p.mode, p.variant)
            | {"reason": f"out of memory{doing}: {detail[:200]}", "memory": runner.memory_detail()})


def _series_key(p: Point) -> tuple:
    return (p.framework, p.cfg.name, p.backend, p.variant, p.mode)


def _measure_point(p: Point, runner: Runner, opts: Options, results: Results, bar) -> Measurement | None:
    """One measurement of a point; None if it failed (recorded in ``results``)."""
    try:
        return runner.measure(p.backend, p.mode, p.variant, opts.n_sets, opts.timing)
    except Exception as err:  # noqa: BLE001  (reported per point; --fail-fast re-raises)
        if opts.fail_fast:
            raise
        if runner.is_out_of_memory(err):
            results.skipped.append(_out_of_memory_skip(p, err, runner))
            return None
        _fail([p], err, "measuring", results, bar)
        return None


def _pooled(measurements: Sequence[Measurement]) -> Measurement:
    """The rounds of one point as one measurement: every round's samples, the largest peak, the first output, the
    rounds' timed and stolen seconds summed."""
    peaks = [m.peak_mem_gib for m in measurements if m.peak_mem_gib is not None]
    skips = [m.cudagraph_skips for m in measurements if m.cudagraph_skips is not None]
    stolen = [m.stolen_s for m in measurements]
    return Measurement([ms for m in measurements for ms in m.ms], max(peaks) if peaks else None,
                       measurements[0].output, sum(m.run_s for m in measurements),
                       stream_ms=[ms for m in measurements for ms in m.stream_ms],
                       wall_ms=[ms for m in measurements for ms in m.wall_ms],
                       cudagraph_skips=sum(skips) if skips else None,
                       graphed_ms=[ms for m in measurements for ms in m.graphed_ms],
                       timed_s=sum(m.timed_s for m in measurements),
                       stolen_s=None if None in stolen else sum(stolen))


def _record_point(p: Point, m: Measurement, peaks: roofline.Peaks, hits: float, dtype: str, itemsize: int,
                  reference: np.ndarray, results: Results) -> float:
    """Append the point's record to ``results``; its ``run_s``."""
    cfg = p.cfg
    n_flops = roofline.flops(p.tokens, cfg.hidden, cfg.intermediate, cfg.top_k, p.mode)
    n_bytes = roofline.bytes_moved(p.tokens, cfg.hidden, cfg.intermediate, hits, itemsize, p.mode)
    ms = m.median_ms
    results.records.append({
        "framework": p.framework, "backend": p.backend, "library": library_of(p.framework, p.backend),
        "peer": p.backend in PEERS, "config": cfg.name, "hidden": cfg.hidden,
        "intermediate": cfg.intermediate, "experts": cfg.experts, "top_k": cfg.top_k, "tokens": p.tokens,
        "dtype": dtype, "mode": p.mode, "compiled": p.compiled, "compile_mode": p.variant, "ms": ms,
        "stream_ms": m.median_stream_ms, "wall_ms": m.median_wall_ms, "graphed_ms": m.median_graphed_ms,
        "floor_ms": roofline.floor_ms(n_flops, n_bytes, peaks.tflops, peaks.tbs),
        "tflops": n_flops / (ms * 1e-3) / 1e12, "peak_mem_gib": m.peak_mem_gib,
        "rel_err": relative_l2(m.output, reference), "cudagraph_skips": m.cudagraph_skips,
        "cpu_steal": m.cpu_steal,
    })
    return m.run_s


def default_memory_budget(device: torch.device) -> float:
    """85% of the GPU's memory; half the available RAM on CPU."""
    if device.type == "cuda":
        return 0.85 * torch.cuda.get_device_properties(device).total_memory
    return 0.5 * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
