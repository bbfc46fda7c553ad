"""python -m bench: time every available experts backend of torch and JAX over a token sweep.

Writes <out>/<device-tag>/<date>-<config>.{json,csv,png} (out: bench/results) and prints a table. Points are
skipped, with the reason, when their estimated memory exceeds the budget or one call would exceed --max-call-s.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from moe_shared import load_spec
from moe_torch import ExpertsInterface

from . import environment, report
from .budget import GIB
from .configs import CONFIGS, get_configs, parse_tokens
from .crossover import crossover
from .roofline import MODES
from .peers import PEERS
from .runners import COMPILE_PREFERENCE, RUNNERS, Timing
from .sweep import (FRAMEWORK_ORDERS, Options, Results, default_framework_order, default_memory_budget, point_key,
                    run)

RESULTS = Path(__file__).resolve().parent / "results"
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
COMPILE_FLAGS = {"off": False, "on": True}


def _choices(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise SystemExit(f"{flag}: expected comma-separated values from {list(allowed)}, got {text!r}")
    return list(dict.fromkeys(names))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="tiny", help=f"comma-separated, or 'all': {', '.join(CONFIGS)}")
    p.add_argument("--tokens", help="comma-separated token counts (default: the config's, 1..16384; tiny 1..256)")
    p.add_argument("--frameworks", default="torch,jax")
    p.add_argument("--backends", help="comma-separated backend names (default: every available one)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--compile", help="torch.compile settings to run, 'off,on' (default: off,on on cuda; off on "
                                     "cpu, where compiling each point costs seconds). JAX: always jitted")
    p.add_argument("--compile-mode", default="best",
                   help="torch.compile modes for the compiled series: 'best' (per backend, the first of "
                        f"{', '.join(COMPILE_PREFERENCE)} that the spec's compile table allows), 'all' (every allowed "
                        "one, a series each) or comma-separated modes")
    p.add_argument("--no-peers", action="store_true",
                   help="leave out the peer series (transformers' experts functions, tokamax ragged_dot)")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16, float16 (or fp32, bf16, fp16)")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (a <device-tag> folder is made in it)")
    p.add_argument("--sets", type=int, default=3, help="input sets cycled through the timed calls")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds over the input sets")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=100)
    p.add_argument("--min-time", type=float, default=0.2, help="seconds of timed calls per point")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every point of a config and token count this many times, interleaved with the other "
                        "series', and pool the samples: ours / theirs ratios then do not depend on when in the run "
                        "each series was timed (decode points move by tenths of a millisecond within a run)")
    p.add_argument("--framework-order", choices=FRAMEWORK_ORDERS,
                   help="'interleaved': the frameworks' points of each config and token count take turns (ratios "
                        "between frameworks timed under the same machine state); 'sequential': every point of one "
                        "framework, then the next's (each framework's memory released before the next allocates). "
                        "Default: interleaved on cpu, sequential on cuda")
    p.add_argument("--stream-rounds", type=int, default=5,
                   help="rounds of calls issued back to back over the input sets, timed per round (stream_ms); "
                        "as many samples of graphed_ms")
    p.add_argument("--graphed-max-tokens", type=int, default=256,
                   help="forward points up to this many tokens also time graphed_ms: what a call adds within one "
                        "captured program of the input sets' calls (a CUDA graph, timed by CUDA events; a jitted "
                        "function, on the host clock); 0: none")
    p.add_argument("--max-call-s", type=float, default=2.0, help="skip points estimated slower than this per call")
    p.add_argument("--max-point-s", type=float, default=15.0,
                   help="skip a series' larger token counts once a point took longer to warm up and time")
    p.add_argument("--mem-budget-gib", type=float, help="skip points estimated larger (default: 85%% of the GPU, "
                                                        "half the free RAM on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing point")
    p.add_argument("--resume", help="comma-separated result JSONs of earlier runs on this device (same dtype): "
                   "their records are kept (each says which run measured it) and their points not run again, so "
                   "a sweep longer than one session continues where it stopped")
    p.add_argument("--list", action="store_true", help="list the configs and the backends' availability, then exit")
    return p.parse_args(argv)


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device: expected cpu or cuda, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return device


def options(args: argparse.Namespace) -> Options:
    device = _device(args.device)
    dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    if dtype not in load_spec().dtypes:
        raise SystemExit(f"--dtype: expected one of {list(load_spec().dtypes)} or {list(DTYPE_ALIASES)}, "
                         f"got {args.dtype!r}")
    compile_text = args.compile or ("off,on" if device.type == "cuda" else "off")
    known_backends = sorted(set(load_spec().backends) | set(ExpertsInterface) | set(PEERS))
    try:
        configs = get_configs(args.config)
        tokens = parse_tokens(args.tokens) if args.tokens else None
    except ValueError as err:
        raise SystemExit(str(err)) from None
    resumed, resumed_skips = _resumed(args.resume, device, dtype) if args.resume else ((), ())
    backends = None
    if args.backends:
        backends = _choices(args.backends, known_backends, "--backends")
    if args.compile_mode not in ("best", "all"):
        _choices(args.compile_mode, COMPILE_PREFERENCE, "--compile-mode")
    for name, value in (("--sets", args.sets), ("--warmup", args.warmup), ("--min-reps", args.min_reps),
                        ("--max-reps", args.max_reps), ("--rounds", args.rounds)):
        if value < 1:
            raise SystemExit(f"{name}: expected a positive integer, got {value}")
    return Options(
        configs=configs, tokens=tokens, frameworks=_choices(args.frameworks, list(RUNNERS), "--frameworks"),
        backends=backends, modes=_choices(args.modes, MODES, "--modes"),
        compile_flags=[COMPILE_FLAGS[c] for c in _choices(compile_text, list(COMPILE_FLAGS), "--compile")],
        compile_mode=args.compile_mode, dtype=dtype, device=device,
        timing=Timing(warmup=args.warmup, min_reps=args.min_reps, max_reps=max(args.min_reps, args.max_reps),
                      min_time=args.min_time, stream_rounds=args.stream_rounds,
                      graphed_max_tokens=args.graphed_max_tokens),
        n_sets=args.sets, seed=args.seed,
        memory_budget=args.mem_budget_gib * GIB if args.mem_budget_gib else default_memory_budget(device),
        max_call_s=args.max_call_s, max_point_s=args.max_point_s, fail_fast=args.fail_fast, peers=not args.no_peers,
        resumed=resumed, resumed_skips=resumed_skips, rounds=args.rounds,
        framework_order=args.framework_order or default_framework_order(device),
    )


def _resumed(paths: str, device: torch.device, dtype: str) -> tuple[list[dict], list[dict]]:
    """The records of earlier runs' JSON files, each marked with the run that measured it (``measured_in``), and
    their skipped points (out of memory, too slow, too large: not tried again); a point in several files: the last
    file's."""
    records, skipped = {}, {}
    for path in (Path(p.strip()) for p in paths.split(",") if p.strip()):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"--resume: cannot read {path}: {err}") from None
        meta = data.get("meta", {})
        got = (meta.get("device_tag"), meta.get("dtype"))
        if got != (environment.device_tag(device), dtype):
            raise SystemExit(f"--resume: {path} was measured on {got[0]} in {got[1]}, expected "
                             f"{environment.device_tag(device)} in {dtype}")
        run = {k: meta.get(k) for k in ("date", "commit")} | {"file": path.name}
        for r in data.get("records", []):
            records[point_key(r)] = r if "measured_in" in r else r | {"measured_in": run}
        for s in meta.get("skipped", []):
            if s.get("tokens") is not None:  # a whole series' skip (e.g. an unavailable variant) is decided anew
                skipped[point_key(s)] = s if "skipped_in" in s else s | {"skipped_in": run}
    return list(records.values()), [s for key, s in skipped.items() if key not in records]


def _list(opts: Options) -> int:
    for cfg in CONFIGS.values():
        print(f"config {cfg.name}: H={cfg.hidden} I={cfg.intermediate} E={cfg.experts} k={cfg.top_k} "
              f"tokens {cfg.tokens[0]}..{cfg.tokens[-1]}")
    for fw in opts.frameworks:
        for backend, reason in RUNNERS[fw](opts.device).availability().items():
            print(f"{fw}:{backend}: {'available' if reason is None else reason}")
    return 0


def _import_moe_jax() -> None:
    """moe_jax imported before torch runs anything: on the CPU it sets glibc's allocator (``moe_jax.host_memory``),
    which binds the threads that allocate after it, XLA's and torch's alike. (Where it cannot be imported, the JAX
    runner says why.)"""
    try:
        importlib.import_module("moe_jax")
    except ImportError:
        pass


def _host_memory() -> str | None:
    module = sys.modules.get("moe_jax.host_memory")
    return None if module is None else module.STATE


def _stop(signum, frame):
    raise SystemExit(128 + signum)  # SIGTERM (e.g. `timeout`): the results written after the last point stay


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
    args = parse_args(argv)
    if "jax" in args.frameworks.split(","):
        _import_moe_jax()
    opts = options(args)
    signal.signal(signal.SIGTERM, _stop)
    if args.list:
        return _list(opts)
    if args.compile is None:
        print(f"compile: {'off,on' if True in opts.compile_flags else 'off'} (the default on {opts.device.type}; "
              f"set --compile)", file=sys.stderr)
    started = datetime.datetime.now()
    meta = {
        "device": environment.device_name(opts.device), "device_tag": environment.device_tag(opts.device),
        "device_class": opts.device.type, **environment.versions(), "commit": environment.commit(),
        "environment": environment.timing_environment(), "jax_host_memory": _host_memory(),
        "date": started.isoformat(timespec="seconds"), "dtype": opts.dtype, "framework_order": opts.framework_order,
        "command": ["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)],
    }
    folder = args.out / meta["device_tag"]
    folder.mkdir(parents=True, exist_ok=True)
    bases = {cfg.name: folder / f"{started:%Y-%m-%d}-{cfg.name}" for cfg in opts.configs}

    def write(results: Results, complete: bool) -> dict[str, dict]:
        """The JSON and CSV of every config (rewritten after each point, ``complete`` false until the end)."""
        meta.update(peak_tflops=results.peaks.tflops, peak_tbs=results.peaks.tbs, complete=complete,
                    unavailable=results.unavailable)
        crossovers = {}
        for name, base in bases.items():
            records = [r for r in results.records if r["config"] == name]
            crossovers[name] = crossover(records)
            report.write_json(base.with_suffix(".json"), meta | {
                "config": name, "decode_crossover": crossovers[name],
                "skipped": [s for s in results.skipped if s["config"] == name],
                "errors": [e for e in results.errors if e["config"] == name],
            }, records)
            report.write_csv(base.with_suffix(".csv"), records)
        return crossovers

    results = run(opts, checkpoint=lambda r: write(r, complete=False))
    crossovers = write(results, complete=True)
    print(report.table(results.records))
    versus = report.versus_table(results.records)
    if versus:
        print()
        print(versus)
    for name, base in bases.items():
        records = [r for r in results.records if r["config"] == name]
        written = [base.with_suffix(".json"), base.with_suffix(".csv")]
        if not args.no_plot and records and report.write_png(base.with_suffix(".png"), records,
                                                             f"{name} on {meta['device']}"):
            written.append(base.with_suffix(".png"))
        print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
    print()
    print(report.summary(meta, results.unavailable, results.skipped, results.errors, crossovers, results.records))
    print(f"finished in {(datetime.datetime.now() - started).total_seconds():.0f} s", file=sys.stderr)
    return 1 if results.errors else 0


if __name__ == "__main__":
    sys.exit(main())
