"""Grouped matmul over rows sorted by expert: ``y[rows of e] = x[rows of e] @ w[e].T``.

Shape legend: S rows (routed slots, sorted by expert), K input width, N output width, E experts.
``w`` is [E, N, K]; ``group_sizes`` [E] int32 counts the rows of each expert, in order; rows past their sum are
zero in the result. Two kernels, chosen per platform when the program is lowered (``jax.lax.platform_dependent``):

- ``ragged_dot``: ``jax.lax.ragged_dot_general``; a real grouped kernel on GPU/TPU, a dense masked matmul over all
  experts on CPU (cost grows with E * S).
- ``segment_loop``: a loop over the experts that received rows and, inside, over fixed-size blocks of their rows
  (large blocks for the bulk, small ones for the tail); each block is one dense matmul with that expert's weights.
  Cost grows with S + E * small block, never with E * S.
  Differentiated by its own VJP (the input gradient is again a segment loop, the weight gradient a blocked
  transposed product).
- ``triton``: the Triton grouped GEMM of ``moe_shared.kernels`` through moe_jax's Triton launcher (CUDA), with its
  own VJP (the input gradient on the transposed weights, the weight gradient a K-grouped GEMM over each expert's
  rows).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache, partial

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST  # float32 stays float32 on every platform (no TF32)


def block_rows(rows: int, experts: int) -> tuple[int, ...]:
    """Rows per block of the segment loop: about the mean rows per expert (a power of two in [1, 512]). Small
    blocks are bound by reading the expert's weights, so one size covers a group in as few blocks as possible;
    from 64 rows on, blocks are bound by compute and a quarter-size tail block keeps the padding of a group's
    last block under a quarter of the bulk size."""
    mean = max(1, -(-rows // max(experts, 1)))
    bulk = int(min(512, 1 << (mean - 1).bit_length()))
    return (bulk, bulk // 4) if bulk >= 64 else (bulk,)


def blocked(start, end, sizes, step, carry):
    """Run ``step(row, size, carry) -> carry`` over [start, end) in blocks: every size but the last while a whole
    block fits, the last size until ``end`` is covered (its final block may run past ``end``)."""
    row = start
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        fits = (lambda c, size=size: c[0] < end) if last else (lambda c, size=size: c[0] + size <= end)
        row, carry = lax.while_loop(fits, lambda c, size=size: (c[0] + size, step(c[0], size, c[1])), (row, carry))
    return carry


def _contract(transpose_w: bool):
    # x [*, K] with w[e] [N, K] (transpose_w) or [K, N]
    return (((1,), (1,)), ((), ())) if transpose_w else (((1,), (0,)), ((), ()))


def _ragged(x, w, group_sizes, transpose_w: bool):
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)) if transpose_w else ((1,), (1,)), ((), ())),
        lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=(0,),
    )
    y = lax.ragged_dot_general(x, w, group_sizes, dims, precision=_HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def hit_experts(group_sizes):
    E = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    hit = jnp.nonzero(group_sizes > 0, size=E, fill_value=0)[0]
    return hit, jnp.sum(group_sizes > 0), ends - group_sizes, ends


_BITS = {2: jnp.uint16, 4: jnp.uint32}


def bits_dtype(dtype):
    """The unsigned integer type of ``dtype``'s width (row buffers are updated as raw bits, see below)."""
    return _BITS[jnp.dtype(dtype).itemsize]


def bits(a):
    return lax.bitcast_convert_type(a, bits_dtype(a.dtype))


def from_bits(a, dtype):
    return lax.bitcast_convert_type(a, dtype)


# XLA:CPU computes slices of bfloat16/float16 arrays in float32. Inside a loop it then hoists a float32 copy of
# the whole loop-invariant operand (all expert weights) out of the loop, on every call. Carrying the sliced arrays
# through the loop state behind an optimization barrier keeps each slice a slice; the output buffer is kept as raw
# bits so that its in-place block updates are integer copies.


def _segment_forward(x, w, group_sizes, transpose_w: bool):
    S, K = x.shape
    N = w.shape[1] if transpose_w else w.shape[2]
    sizes = block_rows(S, w.shape[0])
    hit, n_hit, starts, ends = hit_experts(group_sizes)
    dims = _contract(transpose_w)

    def expert(carry):
        i, out, w, xp = carry
        w, xp = lax.optimization_barrier((w, xp))
        e = hit[i]
        we = lax.dynamic_index_in_dim(w, e, 0, keepdims=False)

        def step(row, size, c):
            out, xp = c
            xp = lax.optimization_barrier(xp)
            xb = lax.dynamic_slice(xp, (row, 0), (size, K))
            yb = lax.dot_general(xb, we, dims, precision=_HIGHEST, preferred_element_type=jnp.float32)
            # rows past this expert's end belong to later experts, which overwrite them afterwards
            return lax.dynamic_update_slice(out, bits(yb.astype(x.dtype)), (row, 0)), xp

        out, xp = blocked(starts[e], ends[e], sizes, step, (out, xp))
        return i + 1, out, w, xp

    out = jnp.zeros((S + sizes[0], N), bits_dtype(x.dtype))
    xp = jnp.pad(x, ((0, sizes[0]), (0, 0)))
    out = lax.while_loop(lambda c: c[0] < n_hit, expert, (0, out, w, xp))[1]
    return from_bits(out[:S], x.dtype)


def _segment_weight_grad(dy, x, group_sizes, num_experts: int, transpose_w: bool):
    """dw[e] = dy[rows]^T x[rows] ([E, N, K]) if transpose_w, else x[rows]^T dy[rows] ([E, K, N]).

    At most min(E, S) experts have rows: their gradients are accumulated in a buffer of that many, then gathered
    into the [E, ...] gradient."""
    S = dy.shape[0]
    sizes = block_rows(S, num_experts)
    hit, n_hit, starts, ends = hit_experts(group_sizes)
    a, b = (dy, x) if transpose_w else (x, dy)
    shape = (num_experts, a.shape[1], b.shape[1])
    raw = bits_dtype(x.dtype)
    capacity = min(num_experts, S)

    def expert(carry):
        i, grads, ap, bp = carry
        ap, bp = lax.optimization_barrier((ap, bp))
        e = hit[i]

        def step(row, size, c):
            acc, ap, bp = c
            ap, bp = lax.optimization_barrier((ap, bp))
            live = (row + jnp.arange(size) < ends[e])[:, None]
            ab = jnp.where(live, lax.dynamic_slice(ap, (row, 0), (size, ap.shape[1])), 0)
            bb = lax.dynamic_slice(bp, (row, 0), (size, bp.shape[1]))
            acc = acc + lax.dot_general(ab, bb, (((0,), (0,)), ((), ())), precision=_HIGHEST,
                                        preferred_element_type=jnp.float32)
            return acc, ap, bp

        acc, ap, bp = blocked(starts[e], ends[e], sizes, step, (jnp.zeros(shape[1:], jnp.float32), ap, bp))
        grads = lax.dynamic_update_index_in_dim(grads, bits(acc.astype(x.dtype)), i, 0)
        return i + 1, grads, ap, bp

    pad = ((0, sizes[0]), (0, 0))
    grads = jnp.zeros((capacity, *shape[1:]), raw)
    grads = lax.while_loop(lambda c: c[0] < n_hit, expert, (0, grads, jnp.pad(a, pad), jnp.pad(b, pad)))[1]
    # one pass writes the whole gradient: expert e takes its accumulated slab, or an appended zero slab
    filled = jnp.arange(capacity, dtype=jnp.int32)
    targets = jnp.where(filled < n_hit, hit[:capacity], num_experts)
    slab = jnp.full((num_experts,), capacity, jnp.int32).at[targets].set(filled, mode="drop")
    grads = jnp.concatenate([grads, jnp.zeros((1, *shape[1:]), raw)])
    return from_bits(grads[slab], x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _segment(x, w, group_sizes, transpose_w: bool):
    return _segment_forward(x, w, group_sizes, transpose_w)


def _segment_fwd(x, w, group_sizes, transpose_w):
    return _segment_forward(x, w, group_sizes, transpose_w), (x, w, group_sizes)


def _segment_bwd(transpose_w, residuals, dy):
    x, w, group_sizes = residuals
    dx = _segment(dy, w, group_sizes, not transpose_w)
    dw = _segment_weight_grad(dy, x, group_sizes, w.shape[0], transpose_w).astype(w.dtype)
    return dx, dw, None


_segment.defvjp(_segment_fwd, _segment_bwd)

def _triton(x, w, group_sizes, transpose_w: bool):
    from .backends.triton import grouped_matmul as triton_grouped_matmul
    return triton_grouped_matmul(x, w, group_sizes, transpose_w)


KERNELS: dict[str, Callable] = {
    "ragged_dot": _ragged,
    "segment_loop": lambda x, w, gs, transpose_w: _segment(x, w, gs, transpose_w),
    "triton": _triton,  # moe_shared.kernels' Triton grouped GEMM (CUDA only)
}


@cache
def platform_present(platform: str) -> bool:
    """Whether this process has devices of ``platform``: branches for absent platforms are not traced (a CUDA
    kernel's binding cannot be traced on a CPU-only jaxlib)."""
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False

JAX_PLATFORMS = {"cpu": "cpu", "cuda": "cuda", "tpu": "tpu"}  # spec device class -> lowering platform


def grouped_matmul(x, w, group_sizes, *, kernels: Mapping[str, str], transpose_w: bool = True):
    """``x`` [S, K] by ``w`` [E, N, K] per group (``transpose_w``) or [E, K, N]; ``kernels`` maps a spec device
    class to a kernel name, ``"default"`` for the rest."""
    chosen = {JAX_PLATFORMS[dc]: KERNELS[name] for dc, name in kernels.items()
              if dc != "default" and name in KERNELS and platform_present(JAX_PLATFORMS[dc])}
    default = KERNELS[kernels.get("default", "ragged_dot")]
    if not chosen:
        return default(x, w, group_sizes, transpose_w)
    branches = {p: partial(fn, transpose_w=transpose_w) for p, fn in chosen.items()}
    return lax.platform_dependent(x, w, group_sizes, default=partial(default, transpose_w=transpose_w), **branches)
