"""Error measures shared by the tests and the benchmark."""

from __future__ import annotations

import numpy as np


def relative_l2(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64; the absolute norm of the difference if expected is zero."""
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    if a.shape != e.shape:
        raise ValueError(f"actual: expected shape {e.shape}, got shape {a.shape}")
    diff = float(np.linalg.norm((a - e).ravel()))
    scale = float(np.linalg.norm(e.ravel()))
    return diff / scale if scale > 0 else diff
