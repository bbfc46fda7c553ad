"""Markdown tables rendered from the spec, kept in README.md between ``<!-- spec:NAME -->`` markers.

``python -m moe_shared.tables --write README.md`` refreshes them; a test fails when README.md and the spec differ.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from .spec import FRAMEWORKS, Spec, load_spec


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header, rows) -> str:
    return "\n".join([_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)])


def _list(values) -> str:
    return ", ".join(values) if values else "-"


def _dotted(version) -> str:
    return ".".join(str(v) for v in version)


# Each kind of requirement as the words of the requires column.
_REQUIREMENT_WORDS = (
    lambda r: [f"{p} ([{e}])" for p, e in r.packages.items()],
    lambda r: [f"CC >= {_dotted(r.compute_capability)}"] if r.compute_capability else [],
    lambda r: ["nvcc >= " + " / ".join(f"{_dotted(v)} (CC {_dotted(cc)})" for cc, v in r.nvcc.items())]
    if r.nvcc else [],
    lambda r: [f"{r.abi['distribution']} built for the installed {r.abi['framework']}"] if r.abi else [],
    lambda r: [f"{d} {' or '.join(v)} (no-deps)" for d, v in r.versions.items()],
    lambda r: list(r.other.values()),
)


def backends_table(spec: Spec) -> str:
    rows = []
    for name, b in spec.backends.items():
        for fw in FRAMEWORKS:
            if fw not in b.frameworks:
                continue
            s = b.frameworks[fw]
            traced = ("torch.compile fullgraph" if s.compile and s.compile.fullgraph else "torch.compile (graph breaks)"
                      if s.compile else "jax.jit" if s.jit else "eager only")
            needs = _list([words for kind in _REQUIREMENT_WORDS for words in kind(s.requires)])
            rows.append([f"`{name}`", fw, _list(s.devices), _list(s.dtypes), _list(s.quantized), traced,
                         "yes" if s.training else "no", needs, b.description])
    return _table(["backend", "framework", "devices", "dtypes", "quantized", "compile / jit", "training",
                   "requires", "what it does"], rows)


def compile_table(spec: Spec) -> str:
    rows = []
    for name, b in spec.backends.items():
        s = b.frameworks.get("torch")
        if s is None or s.compile is None:
            continue
        rows.append([f"`{name}`", _list(s.compile.modes), _list(s.compile.dtypes),
                     "Yes" if s.compile.fullgraph else "No"])
    return _table(["backend", "torch.compile modes", "dtypes", "`fullgraph=True`"], rows)


def tolerance_table(spec: Spec) -> str:
    return _table(["dtype", "relative L2 vs float64 (forward and every gradient)"],
                  [[d, f"{t:g}"] for d, t in spec.tolerance.items()])


def decode_table(spec: Spec) -> str:
    table = spec.decode_max_gathered_mib
    classes = sorted({dc for per in table.values() for dc in per})
    rows = [[fw] + [table[fw].get(dc, "-") for dc in classes] for fw in table]
    return _table(["framework"] + [f"{dc}: max MiB gathered by batched_mm" for dc in classes], rows)


TABLES = {"backends": backends_table, "compile": compile_table, "tolerance": tolerance_table,
          "decode": decode_table}


def render_into(text: str, spec: Spec | None = None) -> str:
    """``text`` with every marked table replaced by the one rendered from the spec."""
    spec = spec or load_spec()
    for name, render in TABLES.items():
        pattern = re.compile(rf"(<!-- spec:{name} -->\n).*?(<!-- /spec:{name} -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + render(spec) + "\n" + m.group(2), text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", type=Path, help="rewrite the marked tables of this file in place")
    args = parser.parse_args()
    if args.write:
        args.write.write_text(render_into(args.write.read_text()))
    else:
        spec = load_spec()
        for name, render in TABLES.items():
            print(f"## {name}\n\n{render(spec)}\n")


if __name__ == "__main__":
    main()
