"""The outputs: the table and summary on stdout, and per config a JSON, a CSV and a PNG."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from .runners import series

RECORD_KEYS = ("framework", "backend", "config", "hidden", "intermediate", "experts", "top_k", "tokens", "dtype",
               "mode", "compiled", "ms", "floor_ms", "tflops", "peak_mem_gib", "rel_err")
_MARKERS = {"torch": "o", "jax": "s"}
META_KEYS = ("device", "torch", "jax", "triton", "commit", "date", "peak_tflops", "peak_tbs")


def _sort_key(r: Mapping) -> tuple:
    return r["config"], r["framework"], r["backend"], r["compiled"], r["mode"], r["tokens"] or 0


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(records: Sequence[Mapping]) -> str:
    header = ("config", "series", "tokens", "ms", "floor_ms", "floor/ms", "TFLOP/s", "mem_GiB", "rel_err")
    rows = [header]
    for r in sorted(records, key=_sort_key):
        rows.append((r["config"], series(r["framework"], r["backend"], r["compiled"], r["mode"]), str(r["tokens"]),
                     _fmt(r["ms"], ".4g"), _fmt(r["floor_ms"], ".3g"), _fmt(r["floor_ms"] / r["ms"], ".3f"),
                     _fmt(r["tflops"], ".3g"), _fmt(r["peak_mem_gib"], ".3g"), _fmt(r["rel_err"], ".2e")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def _tokens(tokens: list[int]) -> str:
    return "all tokens" if None in tokens else "T=" + ",".join(map(str, sorted(tokens)))


def summary(meta: Mapping, unavailable: Mapping[str, Mapping[str, str]], skipped: Sequence[Mapping],
            errors: Sequence[Mapping], crossover: Mapping[str, Mapping[str, Mapping]]) -> str:
    lines = [f"device: {meta['device']}  peaks: {meta['peak_tflops']:.4g} TFLOP/s, {meta['peak_tbs']:.4g} TB/s "
             f"({meta['dtype']} matmul, copy)"]
    for fw, reasons in unavailable.items():
        for backend, reason in reasons.items():
            lines.append(f"unavailable {fw}:{backend}: {reason}")
    groups: dict[tuple, list[Mapping]] = {}
    for s in sorted(skipped, key=_sort_key):
        kind = s["reason"].split(":", 1)[0]
        groups.setdefault((s["config"], series(s["framework"], s["backend"], s["compiled"], s["mode"]), kind),
                          []).append(s)
    for (cfg, name, _), group in groups.items():
        reasons = {s["reason"] for s in group}
        lines.append(f"skipped {cfg} {name} {_tokens([s['tokens'] for s in group])}: "
                     f"{'e.g. ' if len(reasons) > 1 else ''}{group[0]['reason']}")
    for e in errors:
        lines.append(f"ERROR {e['config']} {series(e['framework'], e['backend'], e['compiled'], e['mode'])} "
                     f"T={e['tokens']}: {e['error']}")
    for cfg, per_fw in crossover.items():
        for fw, c in per_fw.items():
            lines.append(f"decode crossover {cfg} {fw} ({meta['device_class']}): batched_mm beats grouped_mm up to "
                         f"{c['tokens']} tokens = {c['slots']} slots (T*k)")
    return "\n".join(lines)


def write_json(path: Path, meta: Mapping, records: Sequence[Mapping]) -> None:
    path.write_text(json.dumps({"meta": dict(meta), "records": [dict(r) for r in records]}, indent=1) + "\n")


def write_csv(path: Path, records: Sequence[Mapping]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RECORD_KEYS)
        writer.writeheader()
        for r in records:
            writer.writerow({k: r[k] for k in RECORD_KEYS})


def write_png(path: Path, records: Sequence[Mapping], title: str) -> bool:
    """ms vs tokens (log-log), one panel per mode, a line per framework:backend[:variant] and the floor.
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
        lines: dict[str, list] = {}
        floor: dict[int, float] = {}
        for r in sorted(mine, key=_sort_key):
            lines.setdefault(series(r["framework"], r["backend"], r["compiled"]), []).append((r["tokens"], r["ms"]))
            floor[r["tokens"]] = min(floor.get(r["tokens"], float("inf")), r["floor_ms"])
        for name, points in lines.items():
            framework, _, rest = name.partition(":")
            ax.plot(*zip(*points), marker=_MARKERS.get(framework, "^"), markersize=3, label=name,
                    linestyle=":" if rest.endswith(":compiled") else "-")
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
