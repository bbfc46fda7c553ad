"""The expert loop, grouped_mm's CPU kernel: the whole expert MLP per block of sorted rows.

A loop over the experts that received slots. Each expert's rows (slots sorted by expert) go through as few blocks as
possible: one block of a size from a short list (``block_sizes``) that covers the rows up to a multiple of the
largest size, then blocks of the largest size. A block gathers its tokens' rows, runs the gate/up matmul, the
activation and the down matmul with that expert's weights, and adds its rows, times their routing weights, into
float32 token rows (a scatter-add, in order on the CPU: the same bits on every run; in bfloat16 without a down bias
the down projection's row-kernel call adds them itself, ``expert_rows_add``). Nothing [T*k, H] is made: each
temporary is one block's, so the forward allocates no big buffers (fresh memory costs page faults on the CPU). At a
few rows per expert (``GROUPED_MEAN_ROWS``) a bfloat16 forward without biases is no loop: two ``grouped_rows``
calls over every expert's rows and one scatter-add, the same bits.

Differentiated by its own VJP: the forward under differentiation keeps the pre-activations of the sorted rows; the
backward is the same loop. Per block: the routing weights' gradient (a dot over I of the activation and the output
gradient through the down weights), the activation's VJP, the input gradient scatter-added into float32 token rows
(each token's k slots summed in float32), and the weight and bias gradients, summed over an expert's blocks in
float32 (most experts take one block: nothing to add). Where the forward runs on ``expert_rows``, the backward's two
products through the weights (the output gradient through the down weights, the pre-activation gradient through
the gate/up weights) run on its transposed mode (``expert_rows_transposed``), the weights read in place. In bfloat16
without biases where the kernel's library runs (up to WEIGHT_GRADS_MEAN_ROWS rows per expert with AMX, any number
without), the loop only keeps each row of dh, gw and a, and one ``moe_weight_grads`` call per weight writes every
expert's gradient once, in bfloat16, after it (no float32 [N, H] per expert rounded into the gradient: on the
qwen3-cpu shape that took 80 of a 122 ms training step at T=64).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial

import jax
import jax.numpy as jnp
from jax import lax

from moe_shared import native

from . import expert_rows
from .base import ACTIVATIONS, HIGHEST, gate
from .grouped_matmul import bits, bits_dtype, from_bits, hit_experts

MAX_BLOCK = 256  # rows per matmul from which XLA:CPU's dot runs at its rate on an expert's weights
_LADDER = tuple(range(16, MAX_BLOCK + 1, 16))  # block sizes where matmuls are bound by compute


@cache
def one_row_decode() -> bool:
    """Whether the forward runs one-row blocks at decode: yes unless the host's CPU has AMX. With one row,
    XLA:CPU runs a float32 matrix-vector product on the expert's weights converted once; with two or more, a
    bfloat16 matrix product on YNNPACK, which with AMX reads the bfloat16 weights faster than the conversion does
    (qwen3-cpu forward on a 2-core Xeon with AMX: 17.3 against 36.2 ms at T=16, 8.1 against 13.8 at T=4; on a
    2-core EPYC without it the one-row blocks were the faster)."""
    return "amx_bf16" not in native.cpu_flags()


def _mean_rows(rows: int, experts: int) -> int:
    return max(1, -(-rows // max(experts, 1)))


# mean rows per expert under which the forward runs on ``expert_rows`` (None: any), and its largest block, by
# expert_rows.amx(). With AMX at every size: qwen3-cpu gate/up weights on a 2-core Xeon, per expert, 50 us at 16
# rows, 92 at 64, 145 at 128, 294 at 256, against XLA's copy and dot 160, 209, 250-400, 410-540; the whole forward
# 29 against 31 ms at T=512, 35 against 45 at 1024, 62 against 68 at 2048, 112 against 123 at 4096 (blocks of up to
# MAX_BLOCK rows). Its AVX512-BF16 way, the whole forward on a 2-core EPYC (one process, three interleaved rounds):
# 18.8 against 24.1 ms at T=64 (8 rows), 23.0 against 27.3 at 128, 27.7 against 32.8 at 192, 35.0 against 39.0 at
# 256 (32 rows); with its sums reduced in registers (expert_rows.h's Sum4), fastest of three: 29.4 against 37.2 at
# T=384 (48 rows), 36.9 against 43.9 at 512, 67.2 against 68.7 at 1024, 124 against 129 at 2048 (blocks of 64, 128
# or 256 rows within 5% of each other)
ROW_KERNEL_MEAN_ROWS = {True: None, False: None}
ROW_KERNEL_BLOCK = {True: MAX_BLOCK, False: 64}
# the bound for the backward's products through the weights: its AVX512-BF16 way matched XLA's at 8 rows; with the
# backward on it at 16 and 32 rows per expert (T = 128, 256), a qwen3-cpu training step on a 2-core EPYC took
# 116-123 and 187-201 ms, against 111 and 160 on XLA's dots
BACKWARD_ROW_KERNEL_MEAN_ROWS = {True: None, False: 8}
# mean rows per expert up to which the forward without biases on the row kernel makes two calls over every expert's
# rows (``expert_rows.grouped_rows``) instead of a loop over the experts with calls per block
GROUPED_MEAN_ROWS = {True: 0, False: 64}
# mean rows per expert up to which the backward's weight gradients come from moe_weight_grads (each expert's written
# once in bfloat16, from the rows of all its blocks kept in the loop; None: any) rather than from XLA's dots per
# block summed into float32 [N, H] and [H, I] and rounded into the gradients per expert, by expert_rows.amx(). On a
# 2-core Xeon with AMX, qwen3-cpu training step, one process: T=1 8.0 against 13.4 ms, T=4 25 against 46, T=8 43
# against 79, T=16 65 against 95, T=64 83 against 113, T=128 (16 rows) 95 against 113; at T=256 (32 rows) 129
# against 122, its AVX512-BF16 products (one output row at a time then) losing to XLA's AMX dots. On the 2-core EPYC,
# with the products summed in registers and stored non-temporally (weight_grads.h), three interleaved rounds in one
# process: T=256 83.7 against 98.2 ms (fastest), T=512 135 against 153, T=1024 230 against 247, T=2048 391 against
# 479
WEIGHT_GRADS_MEAN_ROWS = {True: 16, False: None}


def _within(bounds: dict, rows: int, experts: int, operands, *, inclusive: bool = False) -> bool:
    """bfloat16 ``operands`` where ``expert_rows.enabled()``, at a mean of rows per expert under this host's bound in
    ``bounds`` (at it too with ``inclusive``; None: any)."""
    if not (all(a.dtype == jnp.bfloat16 for a in operands) and expert_rows.enabled()):
        return False
    bound = bounds[expert_rows.amx()]
    return bound is None or _mean_rows(rows, experts) < bound + inclusive


def uses_row_kernel(rows: int, experts: int, *operands, backward: bool = False) -> bool:
    """Whether the forward's matmuls (the backward's, with ``backward``) run on ``expert_rows`` (the weights read in
    place, padding rows skipped): with bfloat16 operands where ``expert_rows.enabled()``, on AMX at any rows per
    expert, else at few (ROW_KERNEL_MEAN_ROWS, BACKWARD_ROW_KERNEL_MEAN_ROWS)."""
    return _within(BACKWARD_ROW_KERNEL_MEAN_ROWS if backward else ROW_KERNEL_MEAN_ROWS, rows, experts, operands)


def fused_weight_grads(rows: int, experts: int, *operands) -> bool:
    """Whether the backward's weight gradients (without biases) come from ``moe_weight_grads``: with bfloat16
    operands where ``expert_rows.enabled()``, up to WEIGHT_GRADS_MEAN_ROWS rows per expert, whichever way the
    backward's products through the weights run."""
    return _within(WEIGHT_GRADS_MEAN_ROWS, rows, experts, operands, inclusive=True)


def block_sizes(rows: int, experts: int, *, backward: bool = False, row_kernel: bool = False) -> tuple[int, ...]:
    """Block sizes, ascending (capped at the rows rounded up to a power of two). With a few rows per expert
    (decode), matmuls are bound by reading the expert's weights: in the forward, at most two rows per expert on
    average, one-row blocks where ``one_row_decode()``; else, under 16 rows, one size, twice the mean rounded up
    to a power of two, so that an expert takes one block (in the backward every further block adds to the weight
    gradients). From 16 rows on, _LADDER: an expert's first block is the smallest size that covers its rows modulo
    the largest, padding under a third of them; each size costs a loop, so there are few. With ``row_kernel`` (the
    forward on ``expert_rows``, which skips padding rows), one size, twice the mean rounded up to a power of two, at
    most ROW_KERNEL_BLOCK."""
    mean = _mean_rows(rows, experts)
    cap = min(MAX_BLOCK, 1 << max(rows - 1, 0).bit_length())
    if row_kernel:
        return (min(cap, 2 << (mean - 1).bit_length(), ROW_KERNEL_BLOCK[expert_rows.amx()]),)
    if mean <= 2 and not backward and one_row_decode():
        return (1,)
    if mean < _LADDER[0]:
        return (min(cap, 2 << (mean - 1).bit_length()),)
    return tuple(sorted({min(cap, size) for size in _LADDER}))


def _cover(start, end, sizes: tuple[int, ...], step: Callable, carry):
    """``step(row, limit, carry, size=, first=) -> carry`` over the rows [start, end): first one block of the
    smallest size that covers the rows up to a multiple of the largest size (``limit``: the end of its rows), then
    blocks of the largest size. Each size is a loop that runs once or not at all (a conditional would copy the
    carried buffers in and out)."""
    big = sizes[-1]
    full = jnp.maximum(end - start - 1, 0) // big
    head_end = end - full * big
    which = jnp.sum(jnp.asarray(sizes) < head_end - start)
    for index, size in enumerate(sizes):
        once = partial(step, start, head_end, size=size, first=True)
        carry = lax.while_loop(lambda c, index=index: (c[0] == 0) & (which == index),
                               lambda c, once=once: (1, once(c[1])), (0, carry))[1]
    body = lambda j, c: step(head_end + j * big, end, c, size=big, first=False)
    return lax.fori_loop(0, full, body, carry)


def _dot(a, b, contract: tuple[int, int]):
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=HIGHEST,
                           preferred_element_type=jnp.float32)


def _expert(weights, bias, e):
    """Expert e's weights and bias, sliced as raw bits (a slice of bfloat16 would be computed in float32)."""
    def pick(a):
        return None if a is None else from_bits(lax.dynamic_index_in_dim(bits(a), e, 0, keepdims=False), a.dtype)
    return pick(weights), pick(bias)


def _through(weights, e, row_kernel: bool, *, transposed: bool):
    """A block's rows times expert e's weights [N, K]: ``rows @ w.T``, or ``rows @ w`` if ``transposed``, as a
    function of (rows, live). On the row kernel the weights stay where they are and rows from ``live`` on come out
    zero; else XLA's dot on the expert's slice."""
    if row_kernel:
        kernel = expert_rows.expert_rows_transposed if transposed else expert_rows.expert_rows
        return lambda rows, live: kernel(rows, weights, e, live)
    w = _expert(weights, None, e)[0]
    return lambda rows, live: _dot(rows, w, (1, 0) if transposed else (1, 1))


def _gate(activation, h, intermediate: int):
    """act(g) * u for [g; u] = h, computed in float32 on h's values and rounded once to h's dtype (XLA:CPU runs
    bfloat16 elementwise ops as float32 ones with a conversion each); a custom gate runs in h's dtype."""
    if callable(activation):
        return activation(h)
    return gate(activation, h.astype(jnp.float32), intermediate).astype(h.dtype)


def _gate_vjp(activation, h, intermediate: int):
    """(the gate's output in float32, its VJP from a float32 cotangent to h's dtype). Named activations run in
    float32 on the rounded pre-activations (one rounding at the end instead of one per elementwise op: fewer,
    larger fusions) and differentiate g and u apart (the VJP of two slices of h would add two zero-padded halves);
    a custom gate runs in h's dtype, as in the forward."""
    if callable(activation):
        a, vjp = jax.vjp(activation, h)
        return a.astype(jnp.float32), lambda da: vjp(da.astype(a.dtype))[0]
    h32 = h.astype(jnp.float32)
    a, vjp = jax.vjp(lambda g, u: ACTIVATIONS[activation](g) * u, h32[:, :intermediate], h32[:, intermediate:])
    return a, lambda da: jnp.concatenate(vjp(da), axis=1).astype(h.dtype)


def _gather(a, rows):
    """a[rows], gathered as raw bits (XLA:CPU gathers bfloat16 in float32 and converts back)."""
    return from_bits(bits(a)[rows], a.dtype)


def _transposed(a):
    """a.T laid out row-major. XLA:CPU runs a bfloat16 dot on YNNPACK (several times Eigen's rate) only when the
    left operand contracts its last dimension in a row-major buffer; a transpose folded into the dot, or given a
    column-major layout, sends it to Eigen in float32 (measured: about 0.35 against 0.9 TFLOP/s). Flattening the
    transposed bits behind a barrier makes the transpose a copy of its own."""
    flat = lax.optimization_barrier(bits(a).T.reshape(-1))
    return from_bits(flat.reshape(a.shape[::-1]), a.dtype)


def _with_bias(y, bias):
    return y if bias is None else y + bias


def _rows(token, weights, row, size: int, limit):
    """The block's tokens and routing weights, zero for rows past ``limit``."""
    live = row + jnp.arange(size) < limit
    return lax.dynamic_slice(token, (row,), (size,)), jnp.where(live, lax.dynamic_slice(weights, (row,), (size,)), 0.)


# XLA:CPU computes slices and updates of bfloat16/float16 arrays in float32 and, inside a loop, hoists a float32 copy
# of a loop-invariant operand (all expert weights) out of it on every call: the invariants ride in the loop state
# behind an optimization barrier, and buffers are sliced and updated as raw bits (as in moe_jax.grouped_matmul).

def _grouped_forward(x, weights, token, group_sizes, gate_up, down, *, activation, tokens: int,
                     keep_pre_activations: bool):
    """``_forward`` without biases as two ``grouped_rows`` calls over every expert's rows, with the gate between
    them, and one scatter-add of the rounded, weighted rows into the token rows in sorted order: the sums of the
    loop's ``expert_rows_add``, without a loop iteration per expert."""
    S = token.shape[0] - MAX_BLOCK
    I = down.shape[2]
    rows = jnp.arange(S) < jnp.sum(group_sizes)
    h = expert_rows.grouped_rows(_gather(x, token[:S]), gate_up, group_sizes).astype(x.dtype)
    y = expert_rows.grouped_rows(_gate(activation, h, I), down, group_sizes).astype(x.dtype)
    into = jnp.where(rows, token[:S], tokens)  # the rows past the groups: dropped, not added
    out = jnp.zeros((tokens, down.shape[1]), jnp.float32).at[into].add(
        y.astype(jnp.float32) * weights[:S, None], mode="drop")
    pre = jnp.pad(bits(h), ((0, MAX_BLOCK), (0, 0))) if keep_pre_activations else None
    return out, pre


def _forward(x, weights, token, group_sizes, gate_up, down, gate_up_bias, down_bias, *, activation, tokens: int,
             keep_pre_activations: bool):
    """(float32 [T, H] output, the sorted rows' pre-activations as bits, or None)."""
    E, H, I = down.shape
    S = token.shape[0] - MAX_BLOCK
    row_kernel = uses_row_kernel(S, E, x, gate_up, down)
    # without a down bias, the down projection adds its rows, times their routing weights, into the float32 token
    # rows on the row kernel (expert_rows_add: no [B, H] float32 temporary, no XLA scatter; qwen3-cpu forward on a
    # 2-core Xeon with AMX: 41 against 52 ms at T=1024, 68 against 78 at 2048). Wherever the forward runs on the
    # kernel (on the 2-core EPYC, the figures of ROW_KERNEL_MEAN_ROWS are with it)
    add_down = row_kernel and down_bias is None
    if add_down and gate_up_bias is None and _within(GROUPED_MEAN_ROWS, S, E, (x, gate_up, down)):
        return _grouped_forward(x, weights, token, group_sizes, gate_up, down, activation=activation, tokens=tokens,
                                keep_pre_activations=keep_pre_activations)
    sizes = block_sizes(S, E, row_kernel=row_kernel)
    hit, n_hit, starts, ends = hit_experts(group_sizes)

    def expert(carry):
        i, out, pre, invariant = carry
        invariant = lax.optimization_barrier(invariant)
        x, gate_up, down, gate_up_bias, down_bias = invariant
        e = hit[i]
        (_, b1), (_, b2) = _expert(None, gate_up_bias, e), _expert(None, down_bias, e)
        up, project = (_through(w, e, row_kernel, transposed=False) for w in (gate_up, down))

        def step(row, limit, carry, *, size, first):
            out, pre, x = carry
            x = lax.optimization_barrier(x)
            tok, w = _rows(token, weights, row, size, limit)
            live = jnp.clip(limit - row, 0, size)
            h = _with_bias(up(_gather(x, tok), live).astype(x.dtype), b1)
            if pre is not None:  # rows past the block's own belong to later blocks, which write them afterwards
                pre = lax.dynamic_update_slice(pre, bits(h), (row, 0))
            a = _gate(activation, h, I)
            if add_down:
                return expert_rows.expert_rows_add(out, a, down, e, live, tok, w), pre, x
            y = _with_bias(project(a, live).astype(x.dtype), b2)
            return out.at[tok].add(y.astype(jnp.float32) * w[:, None]), pre, x

        out, pre, x = _cover(starts[e], ends[e], sizes, step, (out, pre, x))
        return i + 1, out, pre, (x, gate_up, down, gate_up_bias, down_bias)

    out = jnp.zeros((tokens, H), jnp.float32)
    pre = jnp.zeros((token.shape[0], gate_up.shape[1]), bits_dtype(x.dtype)) if keep_pre_activations else None
    invariant = (x, gate_up, down, gate_up_bias, down_bias)
    _, out, pre, _ = lax.while_loop(lambda c: c[0] < n_hit, expert, (0, out, pre, invariant))
    return out, pre


def _backward(x, weights, token, group_sizes, gate_up, down, gate_up_bias, down_bias, pre, dout, *, activation):
    E, H, I = down.shape
    N = gate_up.shape[1]
    S = token.shape[0] - MAX_BLOCK
    sizes = block_sizes(S, E, backward=True)
    hit, n_hit, starts, ends = hit_experts(group_sizes)
    biased = gate_up_bias is not None
    row_kernel = uses_row_kernel(S, E, x, gate_up, down, backward=True)
    fused = not biased and fused_weight_grads(S, E, x, gate_up, down)

    def expert(carry):
        i, dx, dweights, grads, acc, invariant = carry
        invariant = lax.optimization_barrier(invariant)
        x, dout, pre, gate_up, down, gate_up_bias, down_bias = invariant
        e = hit[i]
        b2 = _expert(None, down_bias, e)[1]
        through_down, through_gate_up = (_through(w, e, row_kernel, transposed=True) for w in (down, gate_up))

        def step(row, limit, carry, *, size, first):
            dx, dweights, acc, rows = carry
            rows = lax.optimization_barrier(rows)
            x, dout, pre = rows
            tok, w = _rows(token, weights, row, size, limit)
            live = jnp.clip(limit - row, 0, size)
            w = w[:, None]
            h = from_bits(lax.dynamic_slice(pre, (row, 0), (size, N)), x.dtype)
            a, act_vjp = _gate_vjp(activation, h, I)
            g = _gather(dout, tok)
            t = through_down(g, live)  # [B, I]: the output gradient through the down weights
            dw = jnp.sum(t * a, axis=1)
            if biased:
                dw = dw + _dot(g, b2, (1, 0))
            # rows past the block's own: later blocks write them, empty slots' are dropped outside
            dweights = lax.dynamic_update_slice(dweights, dw, (row,))
            gw = (g.astype(jnp.float32) * w).astype(x.dtype)  # zero past the block's rows
            dh = act_vjp(t * w)
            if fused:  # the rows the weight gradients are made of, kept for moe_weight_grads after the loop
                acc = tuple(lax.dynamic_update_slice(kept, bits(v.astype(x.dtype)), (row, 0))
                            for kept, v in zip(acc, (dh, gw, a)))
            else:
                terms = (_dot(_transposed(gw), a.astype(x.dtype), (1, 0)),
                         _dot(_transposed(dh), _gather(x, tok), (1, 0)),
                         jnp.sum(gw.astype(jnp.float32), axis=0) if biased else None,
                         jnp.sum(dh.astype(jnp.float32), axis=0) if biased else None)
                acc = terms if first else jax.tree.map(jnp.add, acc, terms)
            dx = dx.at[tok].add(through_gate_up(dh, live))
            return dx, dweights, acc, (x, dout, pre)

        # the expert's first block replaces acc (the previous expert's sums: no fresh zeros per expert)
        dx, dweights, acc, _ = _cover(starts[e], ends[e], sizes, step, (dx, dweights, acc, (x, dout, pre)))
        # written as raw bits into gradients kept in their dtype: XLA:CPU updates them in place, and they are the
        # outputs (a buffer of bits would be copied out once more)
        if not fused:
            grads = tuple(None if g is None else from_bits(
                lax.dynamic_update_index_in_dim(bits(g), bits(a.astype(g.dtype)), e, 0), g.dtype)
                for g, a in zip(grads, acc))
        return i + 1, dx, dweights, grads, acc, (x, dout, pre, gate_up, down, gate_up_bias, down_bias)

    dx = jnp.zeros(x.shape, jnp.float32)
    dweights = jnp.zeros(weights.shape, jnp.float32)
    if fused:  # the rows of dh, gw and a (released pages: only the experts' rows are written, and read)
        grads = ()
        acc = tuple(expert_rows.zeros((token.shape[0], width), bits_dtype(x.dtype)) for width in (N, H, I))
    else:
        # (with biases, in another dtype, or above WEIGHT_GRADS_MEAN_ROWS) the library's zeros release the pages of
        # the weight gradients where most experts get no slot (fewer slots than experts); where most get some, XLA's
        # own zeros were faster (measured on this path before moe_weight_grads, qwen3-cpu training step on a 2-core
        # Xeon: 46 against 61 ms at T=4, 79 against 82 at T=8, 109 against 100 at T=16, 122 against 113 at T=64, 143
        # against 122 at T=256; memset from the library instead, 90, 112, 129, 162, 187 ms: XLA's buffers are fresh)
        zeros = expert_rows.zeros if row_kernel and S < E else jnp.zeros
        grads = tuple(None if a is None else zeros(a.shape, a.dtype) for a in (down, gate_up, down_bias, gate_up_bias))
        acc = (jnp.zeros((H, I), jnp.float32), jnp.zeros((N, H), jnp.float32),
               jnp.zeros((H,), jnp.float32) if biased else None, jnp.zeros((N,), jnp.float32) if biased else None)
    invariant = (x, dout.astype(x.dtype), pre, gate_up, down, gate_up_bias, down_bias)
    _, dx, dweights, grads, acc, _ = lax.while_loop(lambda c: c[0] < n_hit, expert,
                                                    (0, dx, dweights, grads, acc, invariant))
    if fused:  # each expert's gradient written once: its products, or zeros (released pages where not in memory)
        dh, gw, a = (from_bits(kept, x.dtype) for kept in acc)
        d_gate_up = expert_rows.weight_grads(dh, x, token, starts, ends)
        d_down = expert_rows.weight_grads(gw, a, jnp.arange(token.shape[0], dtype=jnp.int32), starts, ends)
        return dx.astype(x.dtype), dweights, d_gate_up, d_down, None, None
    d_down, d_gate_up, d_down_b, d_gate_up_b = grads
    return dx.astype(x.dtype), dweights, d_gate_up, d_down, d_gate_up_b, d_down_b


@partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _mlp(x, weights, token, group_sizes, gate_up, down, gate_up_bias, down_bias, activation, tokens):
    return _forward(x, weights, token, group_sizes, gate_up, down, gate_up_bias, down_bias, activation=activation,
                    tokens=tokens, keep_pre_activations=False)[0]


def _mlp_fwd(x, weights, token, group_sizes, gate_up, down, gate_up_bias, down_bias, activation, tokens):
    out, pre = _forward(x, weights, token, group_sizes, gate_up, down, gate_up_bias, down_bias,
                        activation=activation, tokens=tokens, keep_pre_activations=True)
    return out, (x, weights, token, group_sizes, gate_up, down, gate_up_bias, down_bias, pre)


def _mlp_bwd(activation, tokens, residuals, dout):
    x, weights, token, group_sizes, gate_up, down, gate_up_bias, down_bias, pre = residuals
    dx, dweights, d_gate_up, d_down, d_gate_up_b, d_down_b = _backward(
        x, weights, token, group_sizes, gate_up, down, gate_up_bias, down_bias, pre, dout, activation=activation)
    return dx, dweights, None, None, d_gate_up, d_down, d_gate_up_b, d_down_b


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def experts_mlp(x, weights, order, group_sizes, gate_up, down, gate_up_bias, down_bias, *,
                activation: str | Callable, k: int):
    """sum over each token's slots of weight * expert MLP, float32 [T, H]. ``x`` [T, H] in the weights' dtype;
    ``weights`` [S] float32, the sorted slots' routing weights (zero for empty slots); ``order`` [S] the slot of each
    sorted row; ``group_sizes`` [E] the rows of each expert (empty slots sort last, in no group)."""
    T, H = x.shape
    if not T:
        return jnp.zeros((0, H), jnp.float32)
    # padded so that a block starting at any row stays in bounds (XLA would shift a dynamic slice back inside)
    token = jnp.pad(order // k, (0, MAX_BLOCK))
    weights = jnp.pad(weights, (0, MAX_BLOCK))
    return _mlp(x, weights, token, group_sizes, gate_up, down, gate_up_bias, down_bias, activation, T)
