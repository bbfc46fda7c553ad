"""On a GPU host (run on the lent H200, not collected by pytest): JAX grouped_mm in bfloat16 under jit, with every
warning an error. grouped_mm traces its CPU branch beside the GPU's (``platform_dependent``); the CPU row kernel
must be neither built nor looked at there. Result: tests/device_results/nvidia-h200-row-kernel-beside-gpu.txt.

    python tests/device_row_kernel_check.py
"""

import os
import tempfile
import warnings

os.environ["MOE_EXPERTS_CACHE"] = tempfile.mkdtemp()
warnings.simplefilter("error")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moe_jax import experts_forward, expert_rows  # noqa: E402

rng = np.random.default_rng(0)
T, H, I, E, k = 64, 256, 128, 8, 2
x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
ids = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
w = jnp.asarray(rng.random((T, k)), jnp.bfloat16)
gate_up = jnp.asarray(rng.standard_normal((E, 2 * I, H)) * 0.05, jnp.bfloat16)
down = jnp.asarray(rng.standard_normal((E, H, I)) * 0.05, jnp.bfloat16)
out = jax.jit(lambda *a: experts_forward(*a, implementation="grouped_mm"))(x, ids, w, gate_up, down)
print("default backend", jax.default_backend(), "out", out.shape, out.dtype,
      float(jnp.abs(out.astype(jnp.float32)).mean()))
print("row kernel looked at:", expert_rows.unavailable.cache_info().currsize,
      "built files:", os.listdir(os.environ["MOE_EXPERTS_CACHE"]))
