"""The decode crossover: up to which token count batched_mm beats grouped_mm, per framework, and how many MiB of
weights batched_mm gathers there (T*k times one expert's gate/up and down weights).

``python -m bench.crossover RESULTS.json [...]`` prints the ``[decode.max_gathered_mib]`` lines for
shared/spec.toml: for each measured framework and device class, the most MiB gathered at any config's crossover
that stays below every config's first loss (so the threshold holds across models of different expert sizes); the
device classes not measured keep the spec's value.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from moe_shared import DEVICE_CLASSES, load_spec

FAST, SLOW = "batched_mm", "grouped_mm"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
MIB = 2**20


def _expert_mib(record: Mapping) -> float:
    """One expert's gate/up [2I, H] and down [H, I] weights in MiB."""
    return 3 * record["hidden"] * record["intermediate"] * ITEMSIZE[record["dtype"]] / MIB


def crossover(records: Iterable[Mapping]) -> dict[str, dict]:
    """framework -> {"tokens": N, "slots": N*k, "mib": gathered MiB at N, "loses_mib": gathered MiB at the first
    measured count past N (None if batched_mm won at every one)}: N is the largest measured token count such that
    batched_mm's forward is faster than grouped_mm's at it and at every smaller measured count (0 if it is not
    faster at the smallest). Each backend's time per token count is its best over the compiled variants.
    Frameworks missing either backend are left out. ``records`` must come from one config."""
    fwd = [r for r in records if r["mode"] == "fwd" and r["backend"] in (FAST, SLOW)]
    configs = {r["config"] for r in fwd}
    if len(configs) > 1:
        raise ValueError(f"records: expected one config, got {sorted(configs)}")
    best: dict[tuple[str, str, int], float] = {}
    for r in fwd:
        key = (r["framework"], r["backend"], r["tokens"])
        best[key] = min(best.get(key, float("inf")), r["ms"])
    result = {}
    for fw in sorted({r["framework"] for r in fwd}):
        common = sorted({t for (f, b, t) in best if f == fw and b == FAST} & {t for (f, b, t) in best
                                                                                 if f == fw and b == SLOW})
        if not common:
            continue
        n, lost = 0, None
        for t in common:
            if best[fw, FAST, t] >= best[fw, SLOW, t]:
                lost = t
                break
            n = t
        (k,) = {r["top_k"] for r in fwd if r["framework"] == fw}
        mib = _expert_mib(next(r for r in fwd if r["framework"] == fw)) * k
        result[fw] = {"tokens": n, "slots": n * k, "mib": round(n * mib, 1),
                      "loses_mib": None if lost is None else round(lost * mib, 1)}
    return result


def threshold(found: Sequence[Mapping]) -> int:
    """The MiB threshold from several configs' crossovers: the largest gathered MiB at a crossover that is below
    every first loss (0 if none is)."""
    ceiling = min((c["loses_mib"] for c in found if c["loses_mib"] is not None), default=float("inf"))
    return int(max((c["mib"] for c in found if c["mib"] < ceiling), default=0))


def spec_lines(measured: Mapping[str, Mapping[str, int]], current: Mapping[str, Mapping[str, int]]) -> list[str]:
    """The ``[decode.max_gathered_mib]`` table: ``measured`` (framework -> device class -> MiB) over ``current``."""
    lines = ["[decode.max_gathered_mib]"]
    for fw in list(current) + [f for f in measured if f not in current]:
        values = dict(current.get(fw, {})) | dict(measured.get(fw, {}))
        ordered = [c for c in DEVICE_CLASSES if c in values] + [c for c in values if c not in DEVICE_CLASSES]
        lines.append(f"{fw} = {{ " + ", ".join(f"{c} = {values[c]}" for c in ordered) + " }")
    return lines


def from_files(paths: Sequence[Path]) -> tuple[dict[str, dict[str, int]], list[str]]:
    """The threshold per framework and device class over the result files' configs, and one note per config."""
    found: dict[tuple[str, str], list[dict]] = {}
    notes = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta, records = data["meta"], data["records"]
        device_class = meta["device_class"]
        for cfg in sorted({r["config"] for r in records}):
            per_fw = crossover(r for r in records if r["config"] == cfg)
            for fw, c in per_fw.items():
                found.setdefault((fw, device_class), []).append(c)
            summary = ", ".join(f"{fw} {c['tokens']} tokens = {c['slots']} slots = {c['mib']:g} MiB (behind at "
                                f"{'-' if c['loses_mib'] is None else format(c['loses_mib'], 'g')} MiB)"
                                for fw, c in per_fw.items())
            notes.append(f"# {path}: {cfg} on {meta['device']} ({device_class}): {summary or 'no data'}")
    measured: dict[str, dict[str, int]] = {}
    for (fw, device_class), cs in found.items():
        measured.setdefault(fw, {})[device_class] = threshold(cs)
    return measured, notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.crossover", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files written by python -m bench")
    args = parser.parse_args(argv)
    measured, notes = from_files(args.results)
    current = load_spec().decode_max_gathered_mib
    print("\n".join(notes))
    kept = sorted(f"{fw}.{c}" for fw, v in current.items() for c in v if c not in measured.get(fw, {}))
    if kept:
        print(f"# kept from shared/spec.toml (not measured): {', '.join(kept)}")
    print("\n".join(spec_lines(measured, current)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
