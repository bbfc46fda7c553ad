"""Checked-in test vectors: inputs, an upstream gradient, and the float64 reference's outputs and gradients.

Inputs are stored exactly representable in their case dtype (float32 for float32 and bfloat16 cases, float16 for
float16 cases); the reference results are computed in float64 and stored rounded to float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

VECTORS_DIR = Path(__file__).parent
MANIFEST = VECTORS_DIR / "manifest.json"
INPUT_NAMES = ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj",
               "gate_up_bias", "down_bias")


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str
    activation: str
    routing: str
    T: int
    H: int
    I: int
    E: int
    k: int
    bias: bool
    inputs: dict[str, np.ndarray] = field(repr=False)
    grad_output: np.ndarray = field(repr=False)
    expected: dict[str, np.ndarray] = field(repr=False)  # "out" and "grad_<argument>"


def load_cases(directory: Path = VECTORS_DIR) -> list[Case]:
    manifest = json.loads((directory / "manifest.json").read_text())
    cases = []
    for entry in manifest["cases"]:
        with np.load(directory / entry["file"]) as z:
            arrays = {k: z[k] for k in z.files}
        cases.append(Case(
            name=entry["name"], dtype=entry["dtype"], activation=entry["activation"], routing=entry["routing"],
            T=entry["T"], H=entry["H"], I=entry["I"], E=entry["E"], k=entry["k"], bias=entry["bias"],
            inputs={n: arrays[n] for n in INPUT_NAMES if n in arrays},
            grad_output=arrays["grad_output"],
            expected={n: arrays[n] for n in arrays if n == "out" or n.startswith("grad_") and n != "grad_output"},
        ))
    return cases
