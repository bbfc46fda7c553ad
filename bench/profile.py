"""Where one torch call spends its time: kernels launched, their device time, and the host time per call.

    python -m bench.profile --config qwen3-30b-a3b --tokens 1,4 --backends batched_mm,transformers:batched_mm
    python -m bench.profile --device cpu --config tiny --tokens 4 --modes fwd --out profile.json
    python -m bench.profile --tokens 64 --backends grouped_mm,transformers:grouped_mm --modes fwd+bwd \
        --compile-mode max-autotune-no-cudagraphs

For each point (config x tokens x backend x mode, the benchmark's inputs and calls; uncompiled, or built as the
benchmark's compiled series in the ``--compile-mode`` the spec's compile table allows), after a warm-up:
``host_ms`` is the host time per call with the calls issued back to back and no sync between them (on CUDA the
launch path: argument checks, Python, dispatch); then ``--calls`` calls run under ``torch.profiler`` and each op is
reported per call: its count, its own host time, and on CUDA its kernels' device time (``kernels``: launches per
call; ``graphs``: CUDA graph launches); then the same calls under cProfile (``python``: the functions with the most
own host time per call, where the time goes that no op names: wrappers, guards, CUDA-graph bookkeeping); for a
compiled forward, ``frame_ms``: the host time per call of the same trace with its graph's work left out (dynamo's
guard check and frame alone), and ``guard_us``: its guard check alone, timed in a loop (steadier than the host
times). The table prints the top ``--top`` entries of each by device time (host time on CPU); ``--out`` writes them
all as JSON. Compare a backend with its transformers peer on the same inputs to see which ops make a difference.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import environment
from .configs import get_configs, parse_tokens
from .inputs import make_sets, make_weights
from .runners import COMPILE_PREFERENCE, CUDA_GRAPH_MODES, TorchRunner

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_ms(call, n_sets: int, calls: int, device: torch.device) -> float:
    """Host time per call, ``calls`` calls issued back to back over the input sets, synced once after."""
    _sync(device)
    start = time.perf_counter()
    results = [call(i % n_sets) for i in range(calls)]
    elapsed = time.perf_counter() - start
    _sync(device)
    del results
    return elapsed * 1e3 / calls


def op_table(call, n_sets: int, calls: int, device: torch.device) -> list[dict]:
    """Per op (its own time, without its children), per call: count, host ms, device ms of its kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(calls):
            call(i % n_sets)
        _sync(device)
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", 0) or 0
        rows.append({"op": e.key, "count": e.count / calls, "host_ms": e.self_cpu_time_total / 1e3 / calls,
                     "device_ms": device_us / 1e3 / calls})
    return sorted(rows, key=lambda r: (r["device_ms"], r["host_ms"]), reverse=True)


def python_functions(call, n_sets: int, calls: int, device: torch.device, top: int = 25) -> list[dict]:
    """The Python functions (and builtins) with the most own host time per call, under cProfile: where host time
    goes that the op table does not name (dispatch wrappers, guards, CUDA-graph bookkeeping)."""
    profiler = cProfile.Profile()
    _sync(device)
    profiler.enable()
    for i in range(calls):
        call(i % n_sets)
    profiler.disable()
    _sync(device)
    stats = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [{"function": f"{Path(path).name}:{line}({name})", "own_ms": own / calls * 1e3,
             "cum_ms": cumulative / calls * 1e3, "count": count / calls}
            for (path, line, name), (_, count, own, cumulative, _) in stats]


def kernel_launches(rows: Sequence[dict]) -> float:
    """Kernels launched per call (cudaLaunchKernel and its relatives)."""
    return sum(r["count"] for r in rows if "LaunchKernel" in r["op"] or r["op"].startswith("cuLaunch"))


def graph_launches(rows: Sequence[dict]) -> float:
    """CUDA graphs replayed per call (cudaGraphLaunch)."""
    return sum(r["count"] for r in rows if "GraphLaunch" in r["op"])


def replaying_compiler(gm: torch.fx.GraphModule, example_inputs) -> Callable:
    """A torch.compile backend that runs the traced graph at the first call and returns those outputs at every
    later one: a compiled call without its graph's work (dynamo's guard check, the frame's code, the arguments)."""
    outputs = None

    def replay(*args):
        nonlocal outputs
        if outputs is None:
            outputs = gm(*args)
        return outputs

    return replay


def frame_ms(runner: TorchRunner, backend: str, n_sets: int, calls: int) -> float:
    """Host time per call of the forward traced as in a compiled series, its graph's work left out
    (``replaying_compiler``): what dynamo alone costs each call (inference; training needs the graph's autograd).
    The best of three runs of ``calls`` calls: a few microseconds, easily lost in the host's noise."""
    call = runner.build(backend, "fwd", "replaying", compiler=replaying_compiler)
    for i in range(2 * n_sets):
        call(i % n_sets)
    return min(host_ms(call, n_sets, calls, runner.device) for _ in range(3))


def guard_us(runner: TorchRunner, backend: str, checks: int = 20000) -> float | None:
    """Dynamo's guard check alone, us per call: the guards of the forward that ``frame_ms`` compiled last, checked
    on the first input set's arguments (the best of three loops of ``checks``); None where this torch keeps its
    cache entries out of reach. Raises if the guards fail on those arguments (a check that exits early would be
    timed)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    fn = runner.traced
    entries = _debug_get_cache_entry_list(fn.__code__)
    if not entries:
        return None
    s = runner.sets[0]
    code = fn.__code__
    frame_locals = dict(zip(code.co_varnames[:code.co_argcount],
                            (s.hidden_states, s.top_k_index, s.top_k_weights, runner.weights.gate_up,
                             runner.weights.down)))
    frame_locals.update(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))
    manager = entries[0].guard_manager
    best = float("inf")
    with torch.no_grad():
        if not manager.check(frame_locals):
            raise RuntimeError(f"{backend}: the compiled forward's guards fail on its own arguments")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(checks):
                manager.check(frame_locals)
            best = min(best, time.perf_counter() - start)
    return best * 1e6 / checks


def profile_point(runner: TorchRunner, backend: str, mode: str, n_sets: int, calls: int,
                  compile_mode: str | None = None) -> dict:
    """``cudagraph_skips``: in a CUDA-graph compile mode on CUDA, the compiled graphs inductor ran without CUDA
    graphs (``TorchRunner.cudagraph_skips``), else None. ``frame_ms``: for a compiled forward, dynamo's part of
    ``host_ms`` (``frame_ms`` above), and ``guard_us`` its guard check (``guard_us`` above), else None."""
    call = runner.build(backend, mode, compile_mode)
    skips = runner.cudagraph_skips() if compile_mode in CUDA_GRAPH_MODES else None
    for i in range(2 * n_sets):  # warm-up (allocator, caches, lazy imports)
        call(i % n_sets)
    host = host_ms(call, n_sets, calls, runner.device)
    rows = op_table(call, n_sets, calls, runner.device)
    functions = python_functions(call, n_sets, calls, runner.device)
    frame = frame_ms(runner, backend, n_sets, calls) if compile_mode is not None and mode == "fwd" else None
    guards = guard_us(runner, backend) if frame is not None else None
    return {"backend": backend, "mode": mode, "compile_mode": compile_mode, "host_ms": host, "frame_ms": frame,
            "guard_us": guards,
            "kernels": kernel_launches(rows), "graphs": graph_launches(rows),
            "cudagraph_skips": None if skips is None else runner.cudagraph_skips() - skips,
            "device_ms": sum(r["device_ms"] for r in rows), "ops": rows, "python": functions}


def render(point: dict, top: int) -> str:
    compiled = f" compiled-{point['compile_mode']}" if point.get("compile_mode") else ""
    lines = [f"{point['config']} T={point['tokens']} {point['backend']} {point['mode']}{compiled}: "
             f"host {point['host_ms']:.3f} ms/call"
             + (f" (dynamo's frame {point['frame_ms']:.3f}" if point.get("frame_ms") is not None else "")
             + (f", its guard check {point['guard_us']:.1f} us" if point.get("guard_us") is not None else "")
             + (")" if point.get("frame_ms") is not None else "")
             + f", {point['kernels']:.0f} kernel launches/call, {point['graphs']:.0f} CUDA graph launches/call, "
             f"device {point['device_ms']:.3f} ms/call"
             + (f", {point['cudagraph_skips']} graph(s) compiled without CUDA graphs" if point.get("cudagraph_skips")
                else "")]
    for r in point["ops"][:top]:
        lines.append(f"  {r['device_ms']:9.4f} dev ms  {r['host_ms']:9.4f} host ms  {r['count']:6.1f}x  {r['op'][:90]}")
    lines.append("  Python, own host time per call:")
    for f in point.get("python", ())[:top]:
        lines.append(f"  {f['own_ms']:9.4f} own ms  {f['cum_ms']:9.4f} cum ms  {f['count']:6.1f}x  "
                     f"{f['function'][:90]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--backends", default="batched_mm,transformers:batched_mm,grouped_mm,transformers:grouped_mm")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--sets", type=int, default=3)
    p.add_argument("--calls", type=int, default=10, help="calls profiled (and timed for host_ms) per point")
    p.add_argument("--top", type=int, default=12, help="ops printed per point")
    p.add_argument("--compile-mode", default="off",
                   help="off (uncompiled), or the torch.compile mode to build each point in (one of "
                        f"{', '.join(COMPILE_PREFERENCE)}; a backend whose spec does not allow it is skipped)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write every point's full op table here (JSON)")
    args = p.parse_args(argv)
    if args.compile_mode != "off" and args.compile_mode not in COMPILE_PREFERENCE:
        raise SystemExit(f"--compile-mode: expected off or one of {list(COMPILE_PREFERENCE)}, "
                         f"got {args.compile_mode!r}")
    compile_mode = None if args.compile_mode == "off" else args.compile_mode
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    runner = TorchRunner(device)
    available = runner.availability()
    points = []
    for cfg in get_configs(args.config):
        weights = make_weights(cfg, DTYPES[args.dtype], device, args.seed)
        for tokens in parse_tokens(args.tokens):
            runner.load(weights, make_sets(cfg, tokens, DTYPES[args.dtype], device, args.seed, args.sets))
            for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
                if backend not in available:
                    raise SystemExit(f"--backends: {backend!r} is not a torch backend or peer; "
                                     f"expected one of {sorted(available)}")
                if available[backend] is not None:
                    print(f"skipped {backend}: {available[backend]}", file=sys.stderr)
                    continue
                skip = compile_mode and runner.variants(backend, args.dtype, [True], compile_mode)[compile_mode]
                if skip:
                    print(f"skipped {backend}: {skip}", file=sys.stderr)
                    continue
                for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
                    point = {"config": cfg.name, "tokens": tokens} | profile_point(runner, backend, mode, args.sets,
                                                                                    args.calls, compile_mode)
                    points.append(point)
                    print(render(point, args.top), flush=True)
            runner.release()
    if args.out is not None:
        meta = {**environment.versions(), "commit": environment.commit(),
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": ["python", "-m", "bench.profile", *(sys.argv[1:] if argv is None else argv)]}
        args.out.write_text(json.dumps({"device": str(device), "meta": meta, "points": points}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
