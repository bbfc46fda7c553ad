"""The expert loop's row kernel on CPU: ``x[:count] @ w[e].T`` in float32 for a block of rows, reading expert e's
bfloat16 weights where they lie in ``w`` [E, N, K]; ``expert_rows_add`` adds those rows, rounded to bfloat16 and
scaled, into token rows instead (the down projection and the combine in one call); ``expert_rows_transposed`` runs
the other orientation, ``x[:count] @ w[e]``, on the same weights in place (the backward's input gradients).

XLA:CPU copies a dynamic slice of the weights before every dot, and at decode that copy costs as much as the dot
(qwen3-cpu, 2-row blocks: 85 us to copy an expert's gate/up weights, 80 us for the dot). The kernel
(``moe_shared/kernels/expert_rows.h``, on AMX tiles where the CPU has them, else AVX512-BF16 dot products) reads
them in place and skips the block's padding rows; ``expert_rows.cc`` binds it as an XLA FFI custom call, built on
first use against jaxlib's FFI headers (``moe_shared.native``).

``MOE_JAX_ROW_KERNEL``: ``auto`` (default) uses it where the host has AVX512-BF16, the build succeeds and JAX's
default backend is the CPU, else XLA's dots (with a warning when the build failed); ``on`` raises
``RuntimeError`` with the reason where it cannot run; ``off`` never uses it. ``MOE_JAX_ROW_KERNEL_AMX=0``: no AMX.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp

from moe_shared import native

SOURCE = Path(__file__).with_name("expert_rows.cc")
TARGET = "moe_expert_rows"
ADD_TARGET = "moe_expert_rows_add"
TRANSPOSED_TARGET = "moe_expert_rows_transposed"
GROUPED_TARGETS = {False: "moe_grouped_rows", True: "moe_grouped_rows_transposed"}
ZEROS_TARGET = "moe_zeros"
WEIGHT_GRADS_TARGET = "moe_weight_grads"
VARIABLE = "MOE_JAX_ROW_KERNEL"
_LOADED: list = []  # the loaded library stays referenced while the process runs


@cache
def unavailable() -> str | None:
    """Why the row kernel cannot run on this host (None: it is built and registered)."""
    import jaxlib
    library, reason = native.load(SOURCE, include_dirs=(jax.ffi.include_dir(),), key=f"jaxlib {jaxlib.__version__}")
    if library is not None:
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.moe_expert_rows), platform="cpu")
        jax.ffi.register_ffi_target(ADD_TARGET, jax.ffi.pycapsule(library.moe_expert_rows_add), platform="cpu")
        jax.ffi.register_ffi_target(TRANSPOSED_TARGET, jax.ffi.pycapsule(library.moe_expert_rows_transposed),
                                    platform="cpu")
        for target in GROUPED_TARGETS.values():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
        jax.ffi.register_ffi_target(ZEROS_TARGET, jax.ffi.pycapsule(library.moe_zeros), platform="cpu")
        jax.ffi.register_ffi_target(WEIGHT_GRADS_TARGET, jax.ffi.pycapsule(library.moe_weight_grads),
                                    platform="cpu")
        _LOADED.append(library)
    return reason


def enabled() -> bool:
    """Whether the expert loop uses the row kernel (see ``MOE_JAX_ROW_KERNEL``). ``auto`` uses it only in a
    process whose default backend is the CPU: beside an accelerator, grouped_mm's CPU branch is traced but not what
    runs (``platform_dependent``), and nothing is built or registered for it."""
    if native.mode(VARIABLE) == "auto" and jax.default_backend() != "cpu":
        return False
    return native.enabled(VARIABLE, unavailable, "moe_jax's expert loop runs XLA's dots")


def amx() -> bool:
    """Whether the kernel runs on AMX tiles (``native.amx``), else on AVX512-BF16 dot products."""
    return native.amx(VARIABLE)


def _check(x, weights, contracted: int) -> None:
    """ValueError unless ``x`` is [B, weights.shape[contracted]] and ``weights`` [E, N, K], both bfloat16."""
    for name, array, rank in (("x", x, 2), ("weights", weights, 3)):
        if array.dtype != jnp.bfloat16:
            raise ValueError(f"{name}: expected dtype bfloat16 (the row kernel's only one), got dtype {array.dtype}")
        if array.ndim != rank:
            raise ValueError(f"{name}: expected a {rank}-D array, got shape {tuple(array.shape)}")
    if x.shape[1] != weights.shape[contracted]:
        axis = "ENK"[contracted]
        raise ValueError(f"x: expected shape [B, {axis}] = (?, {weights.shape[contracted]}) for weights of shape "
                         f"{tuple(weights.shape)}, got shape {tuple(x.shape)}")


def expert_rows(x, weights, expert, count):
    """float32 [B, N]: the first ``count`` rows of ``x`` [B, K] times ``weights[expert]`` [N, K] transposed, zeros
    below them; bfloat16 operands, ``expert`` and ``count`` int32 scalars."""
    _check(x, weights, 2)
    B, N = x.shape[0], weights.shape[1]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((B, N), jnp.float32), vmap_method="sequential")
    return call(x, weights, jnp.asarray(expert, jnp.int32), jnp.asarray(count, jnp.int32), amx=amx())


def expert_rows_add(out, x, weights, expert, count, token, scale):
    """``out`` [T, N] float32 with, for each of the first ``count`` rows b of ``x`` [B, K], ``x[b] @
    weights[expert].T`` rounded to bfloat16, times ``scale[b]``, added into row ``token[b]`` (in row order; the
    same sums as ``out.at[token].add(y.astype(float32) * scale[:, None])`` on the rounded products y); updated in
    place. ``token`` [B] int32 in [0, T), ``scale`` [B] float32."""
    _check(x, weights, 2)
    call = jax.ffi.ffi_call(ADD_TARGET, jax.ShapeDtypeStruct(out.shape, jnp.float32), vmap_method="sequential",
                            input_output_aliases={6: 0})
    return call(x, weights, jnp.asarray(expert, jnp.int32), jnp.asarray(count, jnp.int32), token.astype(jnp.int32),
                scale.astype(jnp.float32), out, amx=amx())


def expert_rows_transposed(x, weights, expert, count):
    """float32 [B, K]: the first ``count`` rows of ``x`` [B, N] times ``weights[expert]`` [N, K] (the weights'
    first dimension contracted, as in ``expert_rows``' VJP with respect to x), zeros below them; bfloat16 operands,
    ``expert`` and ``count`` int32 scalars. Float32 sums of the exact bfloat16 products, as ``expert_rows``; each
    pair of weight rows is interleaved on the fly (no transposed copy of the weights)."""
    _check(x, weights, 1)
    B, K = x.shape[0], weights.shape[2]
    call = jax.ffi.ffi_call(TRANSPOSED_TARGET, jax.ShapeDtypeStruct((B, K), jnp.float32), vmap_method="sequential")
    return call(x, weights, jnp.asarray(expert, jnp.int32), jnp.asarray(count, jnp.int32), amx=amx())


def grouped_rows(x, weights, group_sizes, *, transposed: bool = False):
    """float32 [S, N]: the rows of ``x`` [S, K], sorted by expert (``group_sizes[e]`` rows of expert e after those
    of expert e - 1), each times its expert's ``weights[e]`` [N, K] transposed, in one call (the sums of
    ``expert_rows`` on each group); zeros past the groups' rows. With ``transposed``, ``x`` [S, N] times
    ``weights[e]``: float32 [S, K]. ``group_sizes`` [E] int32, summing to at most S."""
    _check(x, weights, 1 if transposed else 2)
    if group_sizes.shape != (weights.shape[0],):
        raise ValueError(f"group_sizes: expected shape ({weights.shape[0]},) for weights of shape "
                         f"{tuple(weights.shape)}, got shape {tuple(group_sizes.shape)}")
    shape = (x.shape[0], weights.shape[2] if transposed else weights.shape[1])
    call = jax.ffi.ffi_call(GROUPED_TARGETS[transposed], jax.ShapeDtypeStruct(shape, jnp.float32),
                            vmap_method="sequential")
    return call(x, weights, group_sizes.astype(jnp.int32), amx=amx())


def weight_grads(left, right, right_row, start, end):
    """[E, N, K] bfloat16: per expert e that has rows, the sum over rows r in [start[e], end[e]) of the outer product
    of ``left[r]`` [N] and ``right[right_row[r]]`` [K] (float32 sums of exact bfloat16 products, two rows at a time in
    row order, rounded once): an expert's weight gradient written once, straight into the result; zeros for the
    others (``zero_pages.h``: pages not in memory released, not written, so the idle experts of a decode step cost
    nothing on fresh memory; with ``MOE_EXPERTS_HUGE_PAGES=1`` at tracing a large result is marked for transparent
    huge pages, as ``zeros``'). ``left`` [S, N] and ``right`` [R, K] bfloat16; ``right_row`` [S], ``start`` and
    ``end`` [E] int32."""
    for name, array in (("left", left), ("right", right)):
        if array.dtype != jnp.bfloat16 or array.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D bfloat16 array, got {array.dtype} of shape {tuple(array.shape)}")
    if start.shape != end.shape or start.ndim != 1:
        raise ValueError(f"start, end: expected two [E] arrays, got shapes {tuple(start.shape)} and {tuple(end.shape)}")
    kind = jax.ShapeDtypeStruct((start.shape[0], left.shape[1], right.shape[1]), jnp.bfloat16)
    call = jax.ffi.ffi_call(WEIGHT_GRADS_TARGET, kind, vmap_method="sequential")
    return call(left, right, right_row.astype(jnp.int32), start.astype(jnp.int32), end.astype(jnp.int32),
                from_bytes=_huge_pages_from_bytes())


def zeros(shape: tuple[int, ...], dtype) -> jax.Array:
    """``jnp.zeros(shape, dtype)`` from the kernel's library: a large result's pages that are not in memory are
    released rather than written (``zero_pages.h``: they read as zeros and take memory only where written), the
    others written; with ``MOE_EXPERTS_HUGE_PAGES=1`` at tracing, from ``native.HUGE_PAGES_FROM_BYTES`` on its memory
    is marked for transparent huge pages (XLA's allocator cannot be advised; a fresh buffer faults once per 4 KB page
    where it is written). The kernel's library must be loaded (``enabled()``)."""
    call = jax.ffi.ffi_call(ZEROS_TARGET, jax.ShapeDtypeStruct(shape, dtype))
    return call(from_bytes=_huge_pages_from_bytes())


def _huge_pages_from_bytes() -> int:
    """The ``from_bytes`` attribute of the calls that make large results: ``native.huge_pages_from_bytes()`` at
    tracing, -1 for none."""
    from_bytes = native.huge_pages_from_bytes()
    return -1 if from_bytes is None else from_bytes
