"""The outputs: the table and summary on stdout, and per config a JSON, a CSV and a PNG."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .peers import PEERS
from .runners import JIT, series

RECORD_KEYS = ("framework", "backend", "library", "peer", "config", "hidden", "intermediate", "experts", "top_k",
               "tokens", "dtype", "mode", "compiled", "compile_mode", "ms", "stream_ms", "wall_ms", "floor_ms",
               "tflops", "peak_mem_gib", "rel_err", "cudagraph_skips", "graphed_ms", "cpu_steal")
_MARKERS = {"torch": "o", "jax": "s"}
_PEER_MARKER = "x"
# a point timed while the hypervisor took more than this share of the machine's CPU time is named in the summary
STEAL_NOTED = 0.01
META_KEYS = ("device", "torch", "jax", "triton", "commit", "date", "peak_tflops", "peak_tbs")


def variant_of(r: Mapping):
    """A record's variant (see runners.Variant); records written before ``compile_mode`` existed get theirs
    from ``compiled``."""
    if "compile_mode" in r:
        return r["compile_mode"]
    if not r["compiled"]:
        return None
    return JIT if r["framework"] == "jax" else "default"


def _sort_key(r: Mapping) -> tuple:
    return (r["config"], r["framework"], r.get("peer", False), r["backend"], str(variant_of(r)), r["mode"] or "",
            r["tokens"] or 0)


def counterpart(r: Mapping) -> str:
    """Our backend of the same name as a record's series (the backend itself for ours)."""
    peer = PEERS.get(r["backend"])
    return peer.counterpart if peer is not None else r["backend"]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(records: Sequence[Mapping]) -> str:
    header = ("config", "series", "by", "tokens", "ms", "stream_ms", "wall_ms", "graphed_ms", "floor_ms", "floor/ms",
              "TFLOP/s", "mem_GiB", "rel_err")
    rows = [header]
    for r in sorted(records, key=_sort_key):
        rows.append((r["config"], series(r["framework"], r["backend"], variant_of(r), r["mode"]),
                     "peer" if r.get("peer") else "ours", str(r["tokens"]),
                     _fmt(r["ms"], ".4g"), _fmt(r.get("stream_ms"), ".4g"), _fmt(r.get("wall_ms"), ".4g"),
                     _fmt(r.get("graphed_ms"), ".4g"), _fmt(r["floor_ms"], ".3g"),
                     _fmt(r["floor_ms"] / r["ms"], ".3f"),
                     _fmt(r["tflops"], ".3g"), _fmt(r["peak_mem_gib"], ".3g"), _fmt(r["rel_err"], ".2e")))
    return _columns(rows, left=3)


def _columns(rows: Sequence[Sequence[str]], left: int) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def versus(records: Sequence[Mapping]) -> list[dict]:
    """Every peer point next to our same-named backend at the same config, framework, mode, variant and tokens:
    dicts with both records' ms and ``ratio`` = ours / theirs (below 1: ours is faster)."""
    ours = {(r["config"], r["framework"], r["backend"], r["mode"], variant_of(r), r["tokens"]): r
            for r in records if not r.get("peer")}
    pairs = []
    for r in sorted(records, key=_sort_key):
        if not r.get("peer"):
            continue
        mine = ours.get((r["config"], r["framework"], counterpart(r), r["mode"], variant_of(r), r["tokens"]))
        if mine is not None:
            pairs.append({"config": r["config"], "mode": r["mode"], "tokens": r["tokens"],
                          "ours": series(mine["framework"], mine["backend"], variant_of(mine)),
                          "theirs": series(r["framework"], r["backend"], variant_of(r)),
                          "ours_ms": mine["ms"], "theirs_ms": r["ms"], "ratio": mine["ms"] / r["ms"]})
    return pairs


def versus_table(records: Sequence[Mapping]) -> str:
    """``versus`` as text; empty when no peer ran."""
    pairs = versus(records)
    if not pairs:
        return ""
    rows = [("config", "mode", "ours", "theirs", "tokens", "ours_ms", "theirs_ms", "ours/theirs")]
    rows += [(p["config"], p["mode"], p["ours"], p["theirs"], str(p["tokens"]), _fmt(p["ours_ms"], ".4g"),
              _fmt(p["theirs_ms"], ".4g"), _fmt(p["ratio"], ".2f")) for p in pairs]
    return _columns(rows, left=4)


def _tokens(tokens: list[int]) -> str:
    return "all tokens" if None in tokens else "T=" + ",".join(map(str, sorted(tokens)))


def summary(meta: Mapping, unavailable: Mapping[str, Mapping[str, str]], skipped: Sequence[Mapping],
            errors: Sequence[Mapping], crossover: Mapping[str, Mapping[str, Mapping]],
            records: Sequence[Mapping] = ()) -> str:
    lines = [f"device: {meta['device']}  peaks: {meta['peak_tflops']:.4g} TFLOP/s, {meta['peak_tbs']:.4g} TB/s "
             f"({meta['dtype']} matmul, copy)"]
    if meta.get("environment"):
        lines.append("environment: " + " ".join(f"{k}={v}" for k, v in meta["environment"].items()))
    if meta.get("jax_host_memory"):
        lines.append(f"glibc's allocator (moe_jax.host_memory): {meta['jax_host_memory']}")
    for fw, reasons in unavailable.items():
        for backend, reason in reasons.items():
            lines.append(f"unavailable {fw}:{backend}: {reason}")
    groups: dict[tuple, list[Mapping]] = {}
    for s in sorted(skipped, key=_sort_key):
        kind = s["reason"].split(":", 1)[0]
        groups.setdefault((s["config"], series(s["framework"], s["backend"], variant_of(s), s["mode"]), kind),
                          []).append(s)
    for (cfg, name, _), group in groups.items():
        reasons = {s["reason"] for s in group}
        lines.append(f"skipped {cfg} {name} {_tokens([s['tokens'] for s in group])}: "
                     f"{'e.g. ' if len(reasons) > 1 else ''}{group[0]['reason']}")
    without_graphs: dict[tuple, list[Mapping]] = {}
    for r in sorted(records, key=_sort_key):
        if r.get("cudagraph_skips"):
            without_graphs.setdefault((r["config"], series(r["framework"], r["backend"], variant_of(r), r["mode"])),
                                      []).append(r)
    for (cfg, name), group in without_graphs.items():
        lines.append(f"no CUDA graphs {cfg} {name} {_tokens([r['tokens'] for r in group])}: inductor ran "
                     f"{sum(r['cudagraph_skips'] for r in group)} compiled graph(s) without the CUDA graphs of "
                     f"mode {variant_of(group[0])} (its 'skipping cudagraphs due to' warnings say why)")
    for r in sorted(records, key=_sort_key):
        if (r.get("cpu_steal") or 0) > STEAL_NOTED:
            name = series(r["framework"], r["backend"], variant_of(r), r["mode"])
            lines.append(f"hypervisor steal {r['config']} {name} T={r['tokens']}: {100 * r['cpu_steal']:.1f}% of the "
                         f"CPUs' time was taken from the machine while it was timed (its times may be high)")
    for e in errors:
        lines.append(f"ERROR {e['config']} {series(e['framework'], e['backend'], variant_of(e), e['mode'])} "
                     f"T={e['tokens']}: {e['error']}")
    for cfg, per_fw in crossover.items():
        for fw, c in per_fw.items():
            lines.append(f"decode crossover {cfg} {fw} ({meta['device_class']}): batched_mm beats grouped_mm up to "
                         f"{c['tokens']} tokens = {c['slots']} slots (T*k) = {c['mib']:g} MiB of weights gathered")
    return "\n".join(lines)


def write_json(path: Path, meta: Mapping, records: Sequence[Mapping]) -> None:
    """Written whole or not at all (a run stopped mid-write leaves the previous file)."""
    scratch = path.with_name(path.name + ".part")
    scratch.write_text(json.dumps({"meta": dict(meta), "records": [dict(r) for r in records]}, indent=1) + "\n")
    scratch.replace(path)


CSV_KEYS = (*RECORD_KEYS, "measured_in")  # measured_in: "<date> <commit>" of an earlier run (--resume), else empty


def write_csv(path: Path, records: Sequence[Mapping]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_KEYS)
        writer.writeheader()
        for r in records:
            run = r.get("measured_in")
            writer.writerow({k: r.get(k) for k in RECORD_KEYS}  # records of older runs lack later keys
                            | {"measured_in": f"{run['date']} {run['commit']}" if run else ""})


def write_png(path: Path, records: Sequence[Mapping], title: str) -> bool:
    """ms vs tokens (log-log), one panel per mode, a line per framework:backend[:variant] (peers: crosses,
    dash-dotted lines) and the floor.
    False (with a message on stderr) if matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: not writing {path} (pip install matplotlib)", file=sys.stderr)
        return False
    modes = sorted({r["mode"] for r in records})
    fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 5.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        mine = [r for r in records if r["mode"] == mode]
        lines: dict[tuple, list] = {}
        floor: dict[int, float] = {}
        for r in sorted(mine, key=_sort_key):
            key = (series(r["framework"], r["backend"], variant_of(r)), r["framework"], bool(r.get("peer")),
                   variant_of(r) not in (None, JIT))
            lines.setdefault(key, []).append((r["tokens"], r["ms"]))
            floor[r["tokens"]] = min(floor.get(r["tokens"], float("inf")), r["floor_ms"])
        for (name, framework, peer, compiled), points in lines.items():
            ax.plot(*zip(*points), marker=_PEER_MARKER if peer else _MARKERS.get(framework, "^"), markersize=4,
                    label=f"{name} (peer)" if peer else name,
                    linestyle={(False, False): "-", (False, True): ":", (True, False): "-.", (True, True): (0, (1, 3))}
                    [peer, compiled], linewidth=1.0 if peer else 1.5)
        ax.plot(*zip(*sorted(floor.items())), "k--", linewidth=1.5, label="floor (roofline)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"{title} — {mode}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
