"""The decode crossover: up to which token count batched_mm beats grouped_mm, per framework.

``python -m bench.crossover RESULTS.json [...]`` prints the ``[decode.max_slots]`` lines for shared/spec.toml:
measured device classes take the smallest threshold over the files given, the others keep the spec's value.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from moe_shared import DEVICE_CLASSES, load_spec

FAST, SLOW = "batched_mm", "grouped_mm"


def crossover(records: Iterable[Mapping]) -> dict[str, dict]:
    """framework -> {"tokens": N, "slots": N*k}: N is the largest measured token count such that batched_mm's
    forward is faster than grouped_mm's at it and at every smaller measured count (0 if it is not faster at the
    smallest). Each backend's time per token count is its best over the compiled variants. Frameworks missing
    either backend are left out. ``records`` must come from one config."""
    fwd = [r for r in records if r["mode"] == "fwd" and r["backend"] in (FAST, SLOW)]
    configs = {r["config"] for r in fwd}
    if len(configs) > 1:
        raise ValueError(f"records: expected one config, got {sorted(configs)}")
    best: dict[tuple[str, str, int], float] = {}
    for r in fwd:
        key = (r["framework"], r["backend"], r["tokens"])
        best[key] = min(best.get(key, float("inf")), r["ms"])
    top_k = {r["top_k"] for r in fwd}
    result = {}
    for fw in sorted({r["framework"] for r in fwd}):
        common = sorted({t for (f, b, t) in best if f == fw and b == FAST} & {t for (f, b, t) in best
                                                                                 if f == fw and b == SLOW})
        if not common:
            continue
        n = 0
        for t in common:
            if best[fw, FAST, t] >= best[fw, SLOW, t]:
                break
            n = t
        (k,) = top_k
        result[fw] = {"tokens": n, "slots": n * k}
    return result


def spec_lines(measured: Mapping[str, Mapping[str, int]], current: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The ``[decode.max_slots]`` table: ``measured`` (framework -> device class -> slots) over ``current``."""
    lines = ["[decode.max_slots]"]
    for fw in list(current) + [f for f in measured if f not in current]:
        values = dict(current.get(fw, {})) | dict(measured.get(fw, {}))
        ordered = [c for c in DEVICE_CLASSES if c in values] + [c for c in values if c not in DEVICE_CLASSES]
        lines.append(f"{fw} = {{ " + ", ".join(f"{c} = {values[c]}" for c in ordered) + " }")
    return lines


def from_files(paths: Sequence[Path]) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Smallest slots per framework and device class over the result files, and one note per file."""
    measured: dict[str, dict[str, int]] = {}
    notes = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta, records = data["meta"], data["records"]
        device_class = meta["device_class"]
        for cfg in sorted({r["config"] for r in records}):
            found = crossover(r for r in records if r["config"] == cfg)
            for fw, c in found.items():
                slots = measured.setdefault(fw, {})
                slots[device_class] = min(slots.get(device_class, c["slots"]), c["slots"])
            summary = ", ".join(f"{fw} {c['tokens']} tokens = {c['slots']} slots" for fw, c in found.items())
            notes.append(f"# {path}: {cfg} on {meta['device']} ({device_class}): {summary or 'no data'}")
    return measured, notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.crossover", description=__doc__.splitlines()[2])
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files written by python -m bench")
    args = parser.parse_args(argv)
    measured, notes = from_files(args.results)
    current = load_spec().decode_max_slots
    print("\n".join(notes))
    kept = sorted(f"{fw}.{c}" for fw, v in current.items() for c in v if c not in measured.get(fw, {}))
    if kept:
        print(f"# kept from shared/spec.toml (not measured): {', '.join(kept)}")
    print("\n".join(spec_lines(measured, current)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
