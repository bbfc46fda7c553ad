"""On a GPU host: JAX grouped_mm in bfloat16 under jit, with warnings as errors; the CPU row kernel must not be built."""
import os, warnings, tempfile
os.environ["MOE_EXPERTS_CACHE"] = tempfile.mkdtemp()
warnings.simplefilter("error")
import jax, jax.numpy as jnp, numpy as np
from moe_jax import experts_forward, expert_rows
rng = np.random.default_rng(0)
T, H, I, E, k = 64, 256, 128, 8, 2
x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
ids = jnp.asarray(rng.integers(0, E, (T, k)), jnp.int32)
w = jnp.asarray(rng.random((T, k)), jnp.bfloat16)
gu = jnp.asarray(rng.standard_normal((E, 2 * I, H)) * 0.05, jnp.bfloat16)
dn = jnp.asarray(rng.standard_normal((E, H, I)) * 0.05, jnp.bfloat16)
f = jax.jit(lambda *a: experts_forward(*a, implementation="grouped_mm"))
out = f(x, ids, w, gu, dn)
print("default backend", jax.default_backend(), "out", out.shape, out.dtype, float(jnp.abs(out.astype(jnp.float32)).mean()))
print("row kernel looked at:", expert_rows.unavailable.cache_info().currsize, "built files:", os.listdir(os.environ["MOE_EXPERTS_CACHE"]))
