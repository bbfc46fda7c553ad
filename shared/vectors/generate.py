"""Regenerate the test vectors: ``python -m moe_shared.vectors.generate [--out DIR]``.

Seeded and written with fixed zip metadata, so regenerating gives byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import zipfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from .. import reference
from . import VECTORS_DIR

# (name, dtype, T, H, I, E, k, routing, activation, bias)
_SMALL = dict(H=18, I=10, E=5)
_ALIGNED = dict(H=16, I=8, E=4)
_HALF_ALIGNED = dict(H=18, I=8, E=4)  # I aligned for a native grouped GEMM, H (its output rows) not: found by fuzzing


def _case_table():
    rows = []
    for dt in ("float32", "bfloat16", "float16"):
        for T in (0, 1, 7, 64):
            rows.append((f"{dt}-uniform-T{T}", dt, T, _SMALL, 2, "uniform", "silu", False))
        rows += [
            (f"{dt}-one-expert-T64", dt, 64, _SMALL, 2, "one_expert", "silu", True),
            (f"{dt}-idle-experts-T64", dt, 64, _SMALL, 2, "idle_experts", "gelu", True),
            (f"{dt}-k1-T7", dt, 7, _SMALL, 1, "uniform", "relu", True),
            (f"{dt}-kE-T7", dt, 7, _SMALL, _SMALL["E"], "uniform", "gelu", False),
            (f"{dt}-empty-slots-T64", dt, 64, _SMALL, 3, "empty_slots", "silu", True),
            (f"{dt}-relu-T64", dt, 64, _SMALL, 2, "uniform", "relu", False),
            (f"{dt}-aligned-T64", dt, 64, _ALIGNED, 2, "uniform", "silu", True),
            (f"{dt}-half-aligned-T9", dt, 9, _HALF_ALIGNED, 2, "uniform", "silu", True),
        ]
    return rows


def _routing(rng: np.random.Generator, kind: str, T: int, E: int, k: int) -> np.ndarray:
    order = np.argsort(rng.random((T, E)), axis=1)  # a random permutation of the experts per token
    if kind == "uniform":
        idx = order[:, :k]
    elif kind == "one_expert":  # expert 0 takes every token
        rest = np.array([row[row != 0] for row in order]).reshape(T, E - 1)
        idx = np.concatenate([np.zeros((T, 1), np.int64), rest[:, : k - 1]], axis=1)
    elif kind == "idle_experts":  # only experts 1 and 3 receive tokens
        pair = np.array([1, 3])
        idx = np.stack([rng.permutation(pair)[:k] for _ in range(T)]) if T else np.zeros((0, k), np.int64)
    elif kind == "empty_slots":  # about a quarter of the slots are -1; token 0 has only empty slots
        idx = order[:, :k].copy()
        idx[rng.random((T, k)) < 0.25] = -1
        if T:
            idx[0] = -1
    else:
        raise ValueError(f"routing: unknown kind {kind!r}")
    return idx.astype(np.int32)


def _as_case_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    """Round to the case dtype and store in a NumPy dtype that holds it exactly."""
    if dtype == "float16":
        return a.astype(np.float16)
    if dtype == "bfloat16":
        return a.astype(ml_dtypes.bfloat16).astype(np.float32)
    return a.astype(np.float32)


def build_case(name, dtype, T, dims, k, routing, activation, bias):
    H, I, E = dims["H"], dims["I"], dims["E"]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    logits = rng.standard_normal((T, k))
    weights = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    inputs = {
        "hidden_states": rng.standard_normal((T, H)),
        "top_k_index": _routing(rng, routing, T, E, k),
        "top_k_weights": weights,
        "gate_up_proj": rng.standard_normal((E, 2 * I, H)) / np.sqrt(H),
        "down_proj": rng.standard_normal((E, H, I)) / np.sqrt(I),
    }
    if bias:
        inputs["gate_up_bias"] = 0.1 * rng.standard_normal((E, 2 * I))
        inputs["down_bias"] = 0.1 * rng.standard_normal((E, H))
    grad_output = _as_case_dtype(rng.standard_normal((T, H)), dtype)
    inputs = {n: a if n == "top_k_index" else _as_case_dtype(a, dtype) for n, a in inputs.items()}
    kw = dict(activation=activation, gate_up_bias=inputs.get("gate_up_bias"), down_bias=inputs.get("down_bias"))
    args = [inputs[n] for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")]
    expected = {"out": reference.experts_forward(*args, **kw)}
    expected |= {f"grad_{n}": g for n, g in reference.experts_backward(*args, grad_output, **kw).items()}
    arrays = inputs | {"grad_output": grad_output} | {n: a.astype(np.float32) for n, a in expected.items()}
    meta = dict(name=name, dtype=dtype, T=T, H=H, I=I, E=E, k=k, routing=routing, activation=activation, bias=bias)
    return meta, arrays


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for key in sorted(arrays):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, member.getvalue(), compresslevel=9)
    return buf.getvalue()


def generate(out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for name, dtype, T, dims, k, routing, activation, bias in _case_table():
        meta, arrays = build_case(name, dtype, T, dims, k, routing, activation, bias)
        data = _npz_bytes(arrays)
        (out / f"{name}.npz").write_bytes(data)
        cases.append(meta | {"file": f"{name}.npz", "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {
        "generator": "python -m moe_shared.vectors.generate",
        "note": "inputs exact in the case dtype; expected values: float64 reference rounded to float32",
        "cases": cases,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=VECTORS_DIR)
    args = parser.parse_args()
    manifest = generate(args.out)
    print(f"wrote {len(manifest['cases'])} cases to {args.out}")


if __name__ == "__main__":
    main()
