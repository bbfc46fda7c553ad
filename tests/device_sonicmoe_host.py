"""Where a ``sonicmoe`` forward's host time goes, torch next to JAX (run on the lent H200; not collected by pytest):

    python tests/device_sonicmoe_host.py --out DIR [--tokens 4096] [--calls 50] [--variants lean,through-ops]

qwen3-30b-a3b shape, bf16 inference forward, the same inputs in both frameworks. Per framework, ``calls`` calls
issued back to back: the host time per call (torch: until the last launch returns; JAX: until the jitted call
returns) and the wall time per call once the device is done. Inside each call, with timers wrapped around them:
torch, buffer allocation, the steps (``moe_shared.sonic_steps.forward``) and each step; JAX, the callback as a
whole, its views of XLA's buffers (``torch_bridge.views``), the stream switch (``torch_bridge.on_xla_stream``) and
the steps.
So a JAX call's extra host time splits into JAX's dispatch, the bridge and the same steps. Writes
``DIR/sonicmoe-host.json`` and prints a table.

``--variants`` compares the bindings' way (``lean``: SonicMoE's steps called beneath their custom ops, XLA's buffers
viewed as DLPack capsules, the callback's CUDA graphs on) with: SonicMoE's steps called through their custom ops and
``torch.from_dlpack(buffer)`` views (``through-ops``); grad mode on inside JAX's callback (``grad-on``: the bridge
before it turned autograd off); no CUDA graphs of the callback's work (``no-graphs``); graphs replayed after the
views and the stream switch (``views-replay``: the bridge before its replays went by the addresses alone); 64
graphs kept (``limit-64``). Each is run ``--rounds`` times, interleaved; the JAX series record how many callback
calls ran, captured and replayed (``torch_bridge.Replays``), whether their last output has torch's bits, and how
many distinct buffer addresses the forward callback saw over 30 more calls (``alone_keys``). Each series also times
30 calls each alone to the end (``alone_median_ms``, what the benchmark's ``ms`` column measures; ``--sets`` input
sets in turn, the last output kept alive while the next call runs, as the benchmark does).

``--quack-configs first`` pins every quack GEMM to its first valid config (no autotuning on a fresh machine;
host-side comparisons only). ``--profile`` also runs the timed calls under cProfile (the JSON gains each framework's
functions with the most host time); ``--trace N`` gives torch.profiler's table of host events for N torch calls;
``--timeline N`` splits N calls per framework between host and GPU; ``--training-calls N`` checks and times JAX
gradients with and without the callback's graphs; ``--routing-apart`` times the JAX forward as one jitted call and
as two (its routing, then its callback on routing made once).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import json
import os
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("QUACK_CACHE_AUTOTUNING", "1")

H, I, E, K = 2048, 768, 128, 8  # qwen3-30b-a3b


class Timers:
    def __init__(self):
        self.seconds = defaultdict(float)
        self.counts = defaultdict(int)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.counts[name] += 1
        return timed

    def wrap_context(self, name, factory):
        @contextlib.contextmanager
        def timed(*args, **kwargs):
            start = time.perf_counter()
            with factory(*args, **kwargs):
                self.seconds[name] += time.perf_counter() - start
                yield
        return timed

    def per_call(self, calls: int) -> dict:
        return {name: {"ms": self.seconds[name] * 1e3 / calls, "per_call": self.counts[name] / calls}
                for name in self.seconds}

    def reset(self):
        self.seconds.clear()
        self.counts.clear()


def top_functions(profile: cProfile.Profile, calls: int, count: int = 40) -> dict:
    """The ``count`` functions with the most own time and with the most cumulative time, in ms per call."""
    stats = pstats.Stats(profile).stats

    def rows(column: int) -> list:
        ranked = sorted(stats.items(), key=lambda item: item[1][column], reverse=True)[:count]
        return [{"function": f"{Path(file).name}:{line}:{name}", "calls": primitive / calls,
                 "own_ms": own * 1e3 / calls, "cumulative_ms": cumulative * 1e3 / calls}
                for (file, line, name), (primitive, _, own, cumulative, _) in ranked]

    return {"by_own_time": rows(2), "by_cumulative_time": rows(3)}


def qwen3_inputs(tokens: int):
    """Random qwen3-30b-a3b inputs on the GPU, bf16: x [T, H], ids and w [T, k] (softmax top-k), gate_up, down."""
    import torch
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w, ids = torch.topk(torch.softmax(torch.randn(tokens, E, device="cuda", generator=g), -1), K, dim=-1)
    gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * H**-0.5
    down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * I**-0.5
    return x, ids, w.to(torch.bfloat16), gate_up, down


def training_check(jax, jnp, moe_jax, torch_bridge, replays, arrays, calls: int) -> dict:
    """JAX gradients of x, w, gate_up and down, ``calls`` jitted calls each timed alone, with and without the
    callbacks' CUDA graphs: whether the last gradients have the same bits, what the calls did, the median time."""
    x, ids, w, gate_up, down = arrays
    g = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)

    def loss(x, w, gate_up, down):
        out = moe_jax.experts_forward(x, ids, w, gate_up, down, implementation="sonicmoe")
        return (out.astype(jnp.float32) * g).sum()

    found, last = {}, {}
    for graphs in (False, True):
        torch_bridge.CALLBACK_GRAPHS = graphs
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        for r in replays:
            r.counts.clear()
        times = []
        for _ in range(calls):
            begin = time.perf_counter()
            last[graphs] = jax.block_until_ready(step(x, w, gate_up, down))
            times.append(time.perf_counter() - begin)
        found[f"graphs {graphs}"] = {"median_ms": sorted(times)[len(times) // 2] * 1e3,
                                     "callback_graphs": dict(sum((r.counts for r in replays), Counter()))}
    found["identical"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(last[False], last[True]))
    return found


def timeline(torch, call, wait, sets: int, calls: int, path: Path) -> dict:
    """``calls`` calls each timed alone under torch.profiler, whose CUDA activity records every kernel of the process
    (XLA's too), each call marked as a host range; the Chrome trace goes to ``path``. Per call (median, us): host
    start to the first kernel's start, the GPU's idle time between the first kernel and the last, the last kernel's
    end to the call's return, the kernels' busy time, and the kernel count."""
    from torch.profiler import ProfilerActivity, profile, record_function
    for i in range(3):
        wait(call(i % sets))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            with record_function(f"call {i}"):
                wait(call(i % sets))
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith("call "))
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    rows = []
    for start, end in ranges:
        inside = [k for k in kernels if start <= k[0] <= end]
        if not inside:
            continue
        busy, reach = 0.0, inside[0][0]
        for k0, k1 in inside:
            busy += max(0.0, k1 - max(k0, reach))
            reach = max(reach, k1)
        rows.append({"to_first_kernel": inside[0][0] - start, "gpu_idle": reach - inside[0][0] - busy,
                     "after_last_kernel": end - reach, "busy": busy, "kernels": len(inside), "call": end - start})
    return {key: sorted(r[key] for r in rows)[len(rows) // 2] for key in rows[0]} if rows else {}


def routing_apart(jax, jax_sonic, sonic_steps, jax_sets, n_sets: int, calls: int = 30) -> dict:
    """The JAX forward timed alone as the backend runs it (routing kernels and callback in one jitted call), and
    as two jitted calls: the routing alone, and the callback alone on routing made once (so its call has no
    Triton custom call in it). Median ms to the result, and to the call's return."""
    from jax.experimental.buffer_callback import buffer_callback
    x, ids, w, gate_up, down = jax_sets[0]
    E, H, I = down.shape
    T, k = ids.shape
    steps = jax_sonic.runtime(jax_sonic.platform_of(gate_up))
    types = jax_sonic._result_types(sonic_steps.forward_buffers(T, H, I, E, k, False), gate_up.dtype)
    routing = jax.jit(lambda ids, w: jax_sonic._routing(ids, w, E))
    routed = routing(ids, w)
    callback = jax.jit(lambda x, gate_up, down, routed: buffer_callback(
        jax_sonic._forward_callback(steps, "silu", k), types)(dict(x=x, gate_up=gate_up, down=down), routed)["out"])
    whole = jax.jit(lambda x, ids, w, gate_up, down: jax_sonic.experts_forward(x, ids, w, gate_up, down))
    series = {"whole": lambda i: whole(*jax_sets[i]),
              "routing alone": lambda i: routing(jax_sets[i][1], jax_sets[i][2]),
              "callback alone": lambda i: callback(jax_sets[i][0], gate_up, down, routed)}
    found = {}
    for name, call in series.items():
        for i in range(6):
            jax.block_until_ready(call(i % n_sets))
        times, returned = [], []
        for i in range(calls):
            begin = time.perf_counter()
            result = call(i % n_sets)
            returned.append(time.perf_counter() - begin)
            jax.block_until_ready(result)
            times.append(time.perf_counter() - begin)
        found[name] = {"ms": sorted(times)[calls // 2] * 1e3, "returned_ms": sorted(returned)[calls // 2] * 1e3}
    return found


def key_summary(keys: list) -> dict:
    """The forward callback's calls timed alone: how many distinct address sets (graph keys) they had, and per
    buffer how many distinct addresses."""
    names = keys[0][0]
    return {"calls": len(keys), "distinct_keys": len({a for _, a in keys}),
            "distinct_addresses": {n: len({a[i] for _, a in keys}) for i, n in enumerate(names)}}


def torch_trace(torch, call, calls: int) -> dict:
    """The host-side events (Python ops, CUDA runtime and driver calls) of ``calls`` calls under torch.profiler,
    by own host time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:40]
    return {"calls": calls, "by_own_host_time": [
        {"name": e.key, "count_per_call": e.count / calls, "own_host_us_per_call": e.self_cpu_time_total / calls,
         "host_us_per_call": e.cpu_time_total / calls} for e in events]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="also run the timed calls under cProfile")
    p.add_argument("--variants", default="lean,through-ops",
                   help="lean: the bindings' way; through-ops: SonicMoE's custom ops and torch.from_dlpack(buffer); "
                        "grad-on: lean with grad mode on in JAX's callback; "
                        "no-graphs: lean without the callback's CUDA graphs; views-replay: graphs replayed after the "
                        "views and the stream switch (the bridge before); limit-64: lean keeping 64 graphs")
    p.add_argument("--quack-configs", choices=("first", "tuned"), default="tuned")
    p.add_argument("--sets", type=int, default=1,
                   help="input sets the calls timed alone cycle through (the benchmark's --sets)")
    p.add_argument("--timeline", type=int, default=0,
                   help="then this many calls per framework (the last variant) timed alone under torch.profiler: "
                        "where each call's time goes between host and GPU (DIR/timeline-*.json)")
    p.add_argument("--routing-apart", action="store_true",
                   help="then the JAX forward as one jitted call, and its routing and its callback as two")
    p.add_argument("--training-calls", type=int, default=0,
                   help="then this many JAX gradient calls with and without the callbacks' CUDA graphs")
    p.add_argument("--rounds", type=int, default=2, help="each variant this many times, interleaved")
    p.add_argument("--trace", type=int, default=0,
                   help="then this many torch calls (last variant) under torch.profiler: its table of host events")
    args = p.parse_args()
    if args.quack_configs == "first":
        from device_sonicmoe_check import pin_first_quack_configs
        pin_first_quack_configs()
    import jax
    import jax.numpy as jnp
    import torch

    import moe_jax
    import moe_torch
    from moe_jax import torch_bridge
    from moe_jax.backends import sonicmoe as jax_sonic
    from moe_shared import sonic_steps
    from moe_torch.backends import sonicmoe as torch_sonic

    x, ids, w, gate_up, down = qwen3_inputs(args.tokens)
    timers = Timers()
    steps_forward = sonic_steps.forward
    sonic_steps.forward = timers.wrap("steps", steps_forward)
    torch_sonic._allocate = timers.wrap("torch: allocate", torch_sonic._allocate)
    load_steps = sonic_steps.load_steps
    sonic_steps.load_steps = lambda *a, **kw: SimpleNamespace(**{
        name: timers.wrap(f"step {name}", step) for name, step in vars(load_steps(*a, **kw)).items()})
    lean = {"beneath_the_op": sonic_steps.beneath_the_op, "views": torch_bridge.views}
    through_ops = {"beneath_the_op": lambda step: step,
                   "views": lambda buffers: {n: torch.from_dlpack(b) for n, b in buffers.items()}}
    on_xla_stream = torch_bridge.on_xla_stream

    @contextlib.contextmanager
    def on_xla_stream_grad_on(ctx, buffer):
        with on_xla_stream(ctx, buffer), torch.enable_grad():
            yield

    lean["on_xla_stream"] = through_ops["on_xla_stream"] = on_xla_stream
    lean["graphs"] = through_ops["graphs"] = True
    variants = {"lean": lean, "through-ops": through_ops, "grad-on": lean | {"on_xla_stream": on_xla_stream_grad_on},
                "no-graphs": lean | {"graphs": False}, "views-replay": lean | {"views_replay": True},
                "limit-64": lean | {"limit": 64}}
    replays = []
    replay_mode = {"limit": 16, "views": False}
    fast_replay = torch_bridge.Replays.replay

    class CountedReplays(torch_bridge.Replays):
        """Counts what the calls did; in ``views-replay``, replays the way the bridge did before (views made, torch's
        stream switched, ``graph.replay()``)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.limit = replay_mode["limit"]
            replays.append(self)

        def replay(self, key):
            if replay_mode["views"] and not getattr(self, "inside_run", False):
                return False  # the callback's replay before any view: not in views-replay
            return fast_replay(self, key)

        def run(self, key, work):
            if not replay_mode["views"]:
                return super().run(key, work)
            self.launch = lambda graph, stream: graph.replay()  # on torch's current stream: XLA's, in the callback
            self.inside_run = True
            try:
                if not self.replay(key):
                    super().run(key, work)
            finally:
                self.inside_run = False

    torch_bridge.Replays = CountedReplays
    forward_callback = jax_sonic._forward_callback
    keys = []  # per forward callback call while logging: (buffer names, their addresses)
    logging = {"on": False}

    def timed_callback(*args):
        inner = timers.wrap("jax: callback", forward_callback(*args))

        def logged(ctx, out, inputs, more):
            if logging["on"]:
                buffers = {**inputs, **more, **out}
                keys.append((tuple(buffers), tuple(b.__cuda_array_interface__["data"][0] for b in buffers.values())))
            return inner(ctx, out, inputs, more)

        return logged

    jax_sonic._forward_callback = timed_callback

    def use(variant: str):
        """SonicMoE's steps called beneath their custom ops and the buffers viewed as capsules (``lean``, the
        bindings' way), or through the ops and ``torch.from_dlpack(buffer)`` (``through-ops``, before)."""
        sonic_steps.beneath_the_op = variants[variant]["beneath_the_op"]
        torch_bridge.views = timers.wrap("jax: views", variants[variant]["views"])
        torch_bridge.on_xla_stream = timers.wrap_context("jax: stream switch", variants[variant]["on_xla_stream"])
        torch_bridge.CALLBACK_GRAPHS = variants[variant]["graphs"]
        replay_mode.update(limit=variants[variant].get("limit", 16), views=variants[variant].get("views_replay", False))
        torch_sonic._READY.clear()
        jax_sonic._READY.clear()
        return jax.jit(lambda *a: moe_jax.experts_forward(*a, implementation="sonicmoe"))

    sets = [(x, ids, w)] + [(x.roll(i, 0), ids.roll(i, 0), w.roll(i, 0)) for i in range(1, args.sets)]

    def torch_call(i: int = 0):
        xi, idsi, wi = sets[i]
        return moe_torch.experts_forward(xi, idsi, wi, gate_up, down, implementation="sonicmoe", validate=False)

    jax_sets = [[jnp.from_dlpack(t) for t in (xi, idsi.to(torch.int32), wi, gate_up, down)] for xi, idsi, wi in sets]
    arrays = jax_sets[0]
    results = {}
    with torch.no_grad():
        for round_ in range(args.rounds):
            for variant in args.variants.split(","):
                jitted = use(variant)
                for name, call, wait in (("torch", torch_call, lambda r: torch.cuda.synchronize()),
                                         ("jax", lambda i=0: jitted(*jax_sets[i]), lambda r: jax.block_until_ready(r))):
                    for _ in range(3):
                        wait(call())
                    torch.cuda.synchronize()
                    timers.reset()
                    for r in replays:
                        r.counts.clear()
                    profile = cProfile.Profile() if args.profile else contextlib.nullcontext()
                    start = time.perf_counter()
                    with profile:
                        outs = [call() for _ in range(args.calls)]
                    issued = time.perf_counter()
                    wait(outs[-1])
                    torch.cuda.synchronize()
                    done = time.perf_counter()
                    result = {"host_ms": (issued - start) * 1e3 / args.calls,
                              "wall_ms": (done - start) * 1e3 / args.calls, "inside": timers.per_call(args.calls)}
                    del outs
                    alone, returned = [], []
                    for i in range(30):
                        begin = time.perf_counter()
                        last = call(i % args.sets)
                        returned.append(time.perf_counter() - begin)
                        wait(last)
                        alone.append(time.perf_counter() - begin)
                    result["alone_median_ms"] = sorted(alone)[len(alone) // 2] * 1e3
                    result["alone_returned_median_ms"] = sorted(returned)[len(returned) // 2] * 1e3
                    if name == "jax":  # the same calls again, the callback's buffer addresses logged
                        keys.clear()
                        logging["on"] = True
                        for i in range(30):
                            wait(call(i % args.sets))
                        logging["on"] = False
                        result["alone_keys"] = key_summary(keys)
                    if name == "torch":
                        torch_out = last
                    else:
                        result["identical_to_torch"] = bool(torch.equal(torch.from_dlpack(last), torch_out))
                        result["callback_graphs"] = dict(sum((r.counts for r in replays), Counter()))
                    if args.profile:
                        result["profile"] = top_functions(profile, args.calls)
                    results[f"{name} {variant} round {round_ + 1}"] = result
        if args.trace:
            results["trace"] = torch_trace(torch, torch_call, args.trace)
        if args.timeline:
            args.out.mkdir(parents=True, exist_ok=True)
            results["timeline"] = {
                name: timeline(torch, call, wait, args.sets, args.timeline, args.out / f"timeline-{name}.json")
                for name, call, wait in (("torch", torch_call, lambda r: torch.cuda.synchronize()),
                                         ("jax", lambda i=0: jitted(*jax_sets[i]), jax.block_until_ready))}
            print("timeline", results["timeline"])
    if args.routing_apart:
        results["routing apart"] = routing_apart(jax, jax_sonic, sonic_steps, jax_sets, args.sets)
        print("routing apart", results["routing apart"])
    if args.training_calls:
        results["training"] = training_check(jax, jnp, moe_jax, torch_bridge, replays, arrays, args.training_calls)
        print("training", results["training"])
    meta = {"torch": torch.__version__, "jax": jax.__version__, "device": torch.cuda.get_device_name(),
            "tokens": args.tokens, "calls": args.calls, "shape": {"H": H, "I": I, "E": E, "k": K},
            "profiled": args.profile, "variants": args.variants, "rounds": args.rounds,
            "quack_configs": args.quack_configs, "sets": args.sets}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sonicmoe-host.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    for row in results.get("trace", {}).get("by_own_host_time", []):
        print(f"trace own {row['own_host_us_per_call']:9.1f} us  x{row['count_per_call']:5.1f}  {row['name'][:90]}")
    for name, r in results.items():
        if name in ("trace", "training", "timeline"):
            continue
        print(f"{name:26} host {r['host_ms']:.3f} ms/call, wall {r['wall_ms']:.3f} ms/call, "
              f"alone {r['alone_median_ms']:.3f} ms (returned {r['alone_returned_median_ms']:.3f}), "
              f"torch's bits {r.get('identical_to_torch', '-')}, graphs {r.get('callback_graphs', '-')}, "
              f"keys {r.get('alone_keys', '-')}")
        for part, v in sorted(r["inside"].items()):
            print(f"    {part:22} {v['ms']:.3f} ms/call ({v['per_call']:.0f}x)")
        for row in r.get("profile", {}).get("by_own_time", [])[:25]:
            print(f"    own {row['own_ms']:.4f} cum {row['cumulative_ms']:.4f} x{row['calls']:.0f} {row['function']}")


if __name__ == "__main__":
    main()
