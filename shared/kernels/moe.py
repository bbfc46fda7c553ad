"""The fused MoE Triton kernels, written once for torch and JAX (this module imports only triton).

Shape legend: T tokens, H hidden, I intermediate, E experts, k top-k, S = T*k routed slots (token-major: slot s
belongs to token s // k). Rows "sorted" are slots in expert order: ``order[r]`` is the slot of sorted row r, and
expert e owns the sorted rows ``starts[e] .. starts[e] + counts[e]``. An id outside [0, E) is an empty slot: it is
never given a sorted row, never read and never written (except by the sort with ``EMPTY_TO_FIRST``, for SonicMoE's
kernels, which cannot skip a slot: there it takes a row of expert 0 at the routing weight 0).

Every kernel takes its arrays first (inputs, then run-time scalars, then outputs) and its tile sizes and shape
constants as ``tl.constexpr`` keywords; both bindings call them that way (moe_jax's launcher passes the outputs as
the custom call's result buffers, in that order). None uses atomics except ``grouped_gemm_kernel`` with
``ACCUMULATE`` (the non-deterministic combine), so the same inputs give the same bits on every run and in both
frameworks.
"""

import triton
import triton.language as tl

# ACTIVATION and EPILOGUE codes (globals a kernel reads must be constexpr)
SILU, GELU, RELU = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
PLAIN, GATED_FORWARD, GATED_BACKWARD = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# B_DESC codes: weight tiles through masked pointers, or a tensor descriptor whose rows are n, or k
B_POINTERS, B_K_ROWS, B_N_ROWS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _routed(ids, E: tl.constexpr):
    """Whether each slot is routed: its id in [0, E)."""
    return (ids >= 0) & (ids < E)


@triton.jit
def _expert_key(ids, E: tl.constexpr, EMPTY_TO_FIRST: tl.constexpr):
    """The sort key of a slot: its expert; for an empty slot E, or with ``EMPTY_TO_FIRST`` expert 0 (kernels that
    cannot skip a slot: it then takes a row of expert 0, and its routing weight is made zero)."""
    return tl.where(_routed(ids, E), ids, 0 if EMPTY_TO_FIRST else E).to(tl.int32)


@triton.jit
def _activate(g, ACTIVATION: tl.constexpr):
    if ACTIVATION == SILU:
        out = g * tl.sigmoid(g)
    elif ACTIVATION == GELU:
        out = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        out = tl.maximum(g, 0.0)
    return out


@triton.jit
def _activate_with_grad(g, ACTIVATION: tl.constexpr):
    """act(g) and d act / d g."""
    if ACTIVATION == SILU:
        sig = tl.sigmoid(g)
        out = g * sig
        grad = sig * (1.0 + g * (1.0 - sig))
    elif ACTIVATION == GELU:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        out = g * cdf
        grad = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        out = tl.maximum(g, 0.0)
        grad = (g > 0.0).to(tl.float32)
    return out, grad


# --- routing: a stable counting sort of the slots by expert, on the device ---------------------------------------

@triton.jit
def route_histogram_kernel(ids_ptr, S, hist_ptr, E: tl.constexpr, CHUNK: tl.constexpr, EB: tl.constexpr,
                           EMPTY_TO_FIRST: tl.constexpr):
    """hist[c, e]: slots of chunk c (CHUNK slots) routed to expert e; bin E counts the empty slots."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    live = offs < S
    key = _expert_key(tl.load(ids_ptr + offs, mask=live, other=-1), E, EMPTY_TO_FIRST)
    tl.store(hist_ptr + c * EB + tl.arange(0, EB), tl.histogram(key, EB, mask=live))


@triton.jit
def route_sort_kernel(ids_ptr, hist_ptr, S, order_ptr, counts_ptr, starts_ptr,
                      E: tl.constexpr, CHUNK: tl.constexpr, EB: tl.constexpr, SINGLE_CHUNK: tl.constexpr,
                      EMPTY_TO_FIRST: tl.constexpr):
    """order[r]: the slot of sorted row r (stable: slots of one expert keep their order); counts[e]; starts[e]
    (starts[E] = number of routed slots). With SINGLE_CHUNK (S <= CHUNK) ``hist`` is not read."""
    c = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    offs = c * CHUNK + lane
    live = offs < S
    key = tl.where(live, _expert_key(tl.load(ids_ptr + offs, mask=live, other=-1), E, EMPTY_TO_FIRST), E + 1)
    bins = tl.arange(0, EB)
    own = tl.histogram(key, EB)
    if SINGLE_CHUNK:
        total = own
        before = tl.zeros([EB], dtype=tl.int32)
    else:
        total = tl.zeros([EB], dtype=tl.int32)
        before = tl.zeros([EB], dtype=tl.int32)
        i = 0
        while i < tl.cdiv(S, CHUNK):  # run-time loop bounds are while loops: the interpreter cannot index by them
            h = tl.load(hist_ptr + i * EB + bins)
            total += h
            before += h * (i < c).to(tl.int32)
            i += 1
    expert_start = tl.cumsum(total, 0) - total
    # sorted row of the chunk's p-th element in (key, slot) order: shift[key] + p
    shift = expert_start + before - (tl.cumsum(own, 0) - own)
    ordered = tl.sort(key * CHUNK + lane)
    sorted_key = ordered // CHUNK
    dest = tl.gather(shift, sorted_key, 0) + lane
    tl.store(order_ptr + dest, c * CHUNK + ordered % CHUNK, mask=sorted_key < E)
    if c == 0:
        tl.store(counts_ptr + bins, total, mask=bins < E)
        tl.store(starts_ptr + bins, expert_start, mask=bins <= E)


@triton.jit
def sonic_routing_kernel(order_ptr, ids_ptr, w_ptr, S, x_gather_ptr, s_scatter_ptr, s_reverse_ptr, scores_ptr,
                         E: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """SonicMoE's routing metadata from a sort with EMPTY_TO_FIRST, for the sorted rows and slots BLOCK * pid ..:
    x_gather[r] (the token of sorted row r), s_scatter[r] (its slot), s_reverse[s] (the sorted row of slot s) and
    scores[s] (the slot's routing weight in float32, zero for an empty slot)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < S
    slot = tl.load(order_ptr + offs, mask=live, other=0)
    tl.store(x_gather_ptr + offs, slot // TOP_K, mask=live)
    tl.store(s_scatter_ptr + offs, slot, mask=live)
    tl.store(s_reverse_ptr + slot, offs, mask=live)
    ids = tl.load(ids_ptr + offs, mask=live, other=-1)
    w = tl.load(w_ptr + offs, mask=live, other=0.0).to(tl.float32)
    tl.store(scores_ptr + offs, tl.where(_routed(ids, E), w, 0.0), mask=live)


@triton.jit
def _locate_block(counts_ptr, starts_ptr, b, E: tl.constexpr, EB: tl.constexpr, BM: tl.constexpr):
    """Row block b of the expert-aligned layout (each expert's rows cut into blocks of BM): its expert (E past the
    last block), its first row within the expert, the expert's row count and first sorted row."""
    bins = tl.arange(0, EB)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    blocks = (counts + BM - 1) // BM
    ends = tl.cumsum(blocks, 0)
    e = tl.sum((ends <= b).to(tl.int32), 0)
    first = tl.sum(tl.where(bins == e, ends - blocks, 0), 0)
    count = tl.sum(tl.where(bins == e, counts, 0), 0)
    start = tl.load(starts_ptr + tl.minimum(e, E))
    return e, (b - first) * BM, count, start


BLOCK_FIELDS = tl.constexpr(4)  # a block table's int32 fields per row block: expert, first row, row count, start


@triton.jit
def route_blocks_kernel(counts_ptr, starts_ptr, blocks_ptr,
                        E: tl.constexpr, EB: tl.constexpr, BM: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                        BB: tl.constexpr):
    """The block table of the expert-aligned layout with BM-row blocks: for row block b < ROW_BLOCKS the fields
    ``_locate_block`` computes at blocks[4b .. 4b + 3] (past the last block the expert is E or more, as there), and
    at blocks[4 ROW_BLOCKS] the number of real row blocks. A GEMM that reads it (``BLOCK_TABLE``) does no reduction
    over the experts before its K loop (triton's Hopper warp specialization fails on one). The same arithmetic as
    ``_locate_block``, for BB row blocks a program at once."""
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    bins = tl.arange(0, EB)
    counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
    blocks = (counts + BM - 1) // BM
    ends = tl.cumsum(blocks, 0)
    e = tl.sum((ends[None, :] <= b[:, None]).to(tl.int32), 1)
    first = tl.gather(ends - blocks, tl.minimum(e, EB - 1), 0)
    count = tl.gather(counts, tl.minimum(e, EB - 1), 0)
    start = tl.load(starts_ptr + tl.minimum(e, E))
    live = b < ROW_BLOCKS
    row = blocks_ptr + b * BLOCK_FIELDS
    tl.store(row, e, mask=live)
    tl.store(row + 1, (b - first) * BM, mask=live)
    tl.store(row + 2, count, mask=live)
    tl.store(row + 3, start, mask=live)
    if tl.program_id(0) == 0:
        tl.store(blocks_ptr + ROW_BLOCKS * BLOCK_FIELDS, tl.sum(blocks, 0))


@triton.jit
def _table_block(blocks_ptr, b):
    """``_locate_block``'s fields of row block b read from a block table (``route_blocks_kernel``)."""
    row = blocks_ptr + b * BLOCK_FIELDS
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)


# --- grouped GEMM over sorted rows (forward projections and the input gradients) ---------------------------------

@triton.jit
def grouped_gemm_kernel(
    a_ptr, b_ptr, counts_ptr, starts_ptr, blocks_ptr, order_ptr, scale_ptr, bias_ptr, preact_ptr, S,
    c_ptr, aux_ptr,
    E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
    stride_am: tl.constexpr, stride_be: tl.constexpr, stride_bk: tl.constexpr, stride_bn: tl.constexpr,
    stride_bias_e: tl.constexpr, stride_cm: tl.constexpr, GATE_OFFSET: tl.constexpr,
    A_BY_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
    ACTIVATION: tl.constexpr, STORE_PREACT: tl.constexpr, C_BY_SLOT: tl.constexpr, ACCUMULATE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EB: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr = False, GROUP_M: tl.constexpr = 1, ROW_BLOCKS: tl.constexpr = 1,
    B_DESC: tl.constexpr = 0, B_ROWS: tl.constexpr = 0, B_COLS: tl.constexpr = 0,
    WARP_SPECIALIZE: tl.constexpr = False, SHORT_TAILS: tl.constexpr = 0, A_DESC: tl.constexpr = False,
    PROGRAMS: tl.constexpr = 0, BLOCK_TABLE: tl.constexpr = False,
):
    """C[row] = A[row] @ B[e] for each sorted row of expert e, B[e] read as a [K, N] view through its strides.

    A rows: ``A_BY_TOKEN`` gathers token ``order[r] // TOP_K`` (no permuted copy), else sorted row r. Epilogues:
    PLAIN stores C (+ bias); GATED_FORWARD computes the gate columns n and the up columns GATE_OFFSET + n, adds the
    bias, stores act(g) * u (and g, u to ``aux`` with STORE_PREACT); GATED_BACKWARD takes C as d(act(g) * u) and
    stores [dg, du] from the saved pre-activations. C rows: sorted, the slot (``C_BY_SLOT``), or, with
    ``ACCUMULATE``, atomically added to the token's row scaled by the routing weight. ``EVEN_K`` (K a multiple of
    BK) drops the K masks. Grid: one program per (row block, N tile) over ``ROW_BLOCKS``, a static upper bound of
    row blocks (blocks past the last expert's return at once), or with ``PROGRAMS`` > 0 that many programs, each
    looping over every PROGRAMS-th tile of the real row blocks (persistent); ``GROUP_M`` row blocks at a time over
    every N tile so that they share each weight tile in L2. DOT_PRECISION is "ieee" for float32 operands (no TF32).
    ``B_DESC`` loads the weight tiles through a tensor descriptor (TMA on Hopper) over the weights as one 2-D array,
    ``B_ROWS`` rows per expert of ``B_COLS`` columns: B_K_ROWS when B[e] is stored with k contiguous (stride_bk ==
    1; a row per n), B_N_ROWS with n contiguous (stride_bn == 1; a row per k); B_POINTERS loads them through masked
    pointers. ``A_DESC`` loads the A tiles of sorted rows (not ``A_BY_TOKEN``) through a tensor descriptor over A as
    an [S, K] array. A descriptor tile may run past N, K or the expert's rows into the next rows or columns: those
    outputs are never stored; past the array it reads zeros. ``WARP_SPECIALIZE`` asks triton to split the K loop
    into loading and multiplying warps. ``SHORT_TAILS`` = L lets an expert's last block run a shorter tile, BM >> l
    rows for the smallest l <= L that holds its rows, so its padding rows cost no multiplies (an expert with 130
    rows takes a 128-row tile and a 16-row one with L = 3, not two 128-row tiles). ``BLOCK_TABLE`` reads each row
    block's expert, rows and start from the table ``blocks`` (``route_blocks_kernel`` with this BM and ROW_BLOCKS)
    instead of computing them from the expert counts; the same tiles, the same bits.
    """
    pid = tl.program_id(0)
    if PROGRAMS == 0:
        _grouped_gemm_block_tile(
            pid, ROW_BLOCKS, a_ptr, b_ptr, counts_ptr, starts_ptr, blocks_ptr, order_ptr, scale_ptr, bias_ptr,
            preact_ptr, S, c_ptr, aux_ptr, E, N, K, TOP_K, stride_am, stride_be, stride_bk, stride_bn, stride_bias_e,
            stride_cm, GATE_OFFSET, A_BY_TOKEN, HAS_BIAS, EPILOGUE, ACTIVATION, STORE_PREACT, C_BY_SLOT, ACCUMULATE,
            BM, BN, BK, EB, DOT_PRECISION, EVEN_K, GROUP_M, B_DESC, B_ROWS, B_COLS, WARP_SPECIALIZE, SHORT_TAILS,
            A_DESC, BLOCK_TABLE)
    else:
        if BLOCK_TABLE:
            blocks = tl.load(blocks_ptr + ROW_BLOCKS * BLOCK_FIELDS)
        else:
            bins = tl.arange(0, EB)
            counts = tl.load(counts_ptr + bins, mask=bins < E, other=0)
            blocks = tl.sum((counts + BM - 1) // BM, 0)
        for tile in range(pid, blocks * ((N + BN - 1) // BN), PROGRAMS):
            _grouped_gemm_block_tile(
                tile, blocks, a_ptr, b_ptr, counts_ptr, starts_ptr, blocks_ptr, order_ptr, scale_ptr, bias_ptr,
                preact_ptr, S, c_ptr, aux_ptr, E, N, K, TOP_K, stride_am, stride_be, stride_bk, stride_bn,
                stride_bias_e, stride_cm, GATE_OFFSET, A_BY_TOKEN, HAS_BIAS, EPILOGUE, ACTIVATION, STORE_PREACT,
                C_BY_SLOT, ACCUMULATE, BM, BN, BK, EB, DOT_PRECISION, EVEN_K, GROUP_M, B_DESC, B_ROWS, B_COLS,
                WARP_SPECIALIZE, SHORT_TAILS, A_DESC, BLOCK_TABLE)


@triton.jit
def _grouped_gemm_block_tile(
    tile, row_blocks, a_ptr, b_ptr, counts_ptr, starts_ptr, blocks_ptr, order_ptr, scale_ptr, bias_ptr, preact_ptr, S,
    c_ptr, aux_ptr,
    E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
    stride_am: tl.constexpr, stride_be: tl.constexpr, stride_bk: tl.constexpr, stride_bn: tl.constexpr,
    stride_bias_e: tl.constexpr, stride_cm: tl.constexpr, GATE_OFFSET: tl.constexpr,
    A_BY_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
    ACTIVATION: tl.constexpr, STORE_PREACT: tl.constexpr, C_BY_SLOT: tl.constexpr, ACCUMULATE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EB: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, B_DESC: tl.constexpr, B_ROWS: tl.constexpr, B_COLS: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, SHORT_TAILS: tl.constexpr, A_DESC: tl.constexpr, BLOCK_TABLE: tl.constexpr,
):
    """Output tile number ``tile`` of ``grouped_gemm_kernel`` over ``row_blocks`` row blocks (a bound: blocks past
    the last expert's do nothing)."""
    num_n: tl.constexpr = (N + BN - 1) // BN
    # GROUP_M consecutive row blocks take each N tile in turn, so a weight tile is read from L2 by all of them
    per_group: tl.constexpr = GROUP_M * num_n
    first_block = (tile // per_group) * GROUP_M
    group_size = tl.minimum(row_blocks - first_block, GROUP_M)
    block = first_block + (tile % per_group) % group_size
    n_tile = (tile % per_group) // group_size
    if BLOCK_TABLE:
        e, row0, count, start = _table_block(blocks_ptr, block)
    else:
        e, row0, count, start = _locate_block(counts_ptr, starts_ptr, block, E, EB, BM)
    rows_left = count - row0
    for level in tl.static_range(SHORT_TAILS + 1):
        # tile height BM >> level takes rows_left in (BM >> (level + 1), BM >> level]; the last level from 1 row,
        # level 0 any larger block
        fits_above = rows_left > ((BM >> (level + 1)) if level < SHORT_TAILS else 0)
        fits_below = (rows_left <= (BM >> level)) if level > 0 else True
        if (e < E) & fits_above & fits_below:
            _grouped_gemm_tile(
                a_ptr, b_ptr, order_ptr, scale_ptr, bias_ptr, preact_ptr, c_ptr, aux_ptr, e, row0, count, start,
                n_tile, E, N, K, TOP_K, stride_am, stride_be, stride_bk, stride_bn, stride_bias_e, stride_cm,
                GATE_OFFSET, A_BY_TOKEN, HAS_BIAS, EPILOGUE, ACTIVATION, STORE_PREACT, C_BY_SLOT, ACCUMULATE,
                BM >> level, BN, BK, DOT_PRECISION, EVEN_K, B_DESC, B_ROWS, B_COLS, WARP_SPECIALIZE, A_DESC, S)


@triton.jit
def _grouped_gemm_tile(
    a_ptr, b_ptr, order_ptr, scale_ptr, bias_ptr, preact_ptr, c_ptr, aux_ptr, e, row0, count, start, n_tile,
    E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
    stride_am: tl.constexpr, stride_be: tl.constexpr, stride_bk: tl.constexpr, stride_bn: tl.constexpr,
    stride_bias_e: tl.constexpr, stride_cm: tl.constexpr, GATE_OFFSET: tl.constexpr,
    A_BY_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
    ACTIVATION: tl.constexpr, STORE_PREACT: tl.constexpr, C_BY_SLOT: tl.constexpr, ACCUMULATE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    B_DESC: tl.constexpr, B_ROWS: tl.constexpr, B_COLS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    A_DESC: tl.constexpr, S,
):
    """One [BM, BN] output tile of ``grouped_gemm_kernel``: rows row0 .. row0 + BM of expert e, N tile n_tile."""
    rows = row0 + tl.arange(0, BM)
    live = rows < count
    srow = start + rows
    slot = tl.load(order_ptr + srow, mask=live, other=0)
    if A_BY_TOKEN:
        a_rows = (slot // TOP_K).to(tl.int64)
    else:
        a_rows = srow.to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_n = n_tile * BN + tl.arange(0, BN)
    n_live = offs_n < N
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    if ACCUMULATE:
        scale = tl.load(scale_ptr + slot, mask=live, other=0.0).to(tl.float32)
    if B_DESC == B_K_ROWS:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * B_ROWS, B_COLS], strides=[stride_bn, 1],
                                           block_shape=[BN, BK])
        b_row = e * B_ROWS + n_tile * BN
    elif B_DESC == B_N_ROWS:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E * B_ROWS, B_COLS], strides=[stride_bk, 1],
                                           block_shape=[BK, BN])
        b_row = e * B_ROWS
    if A_DESC:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[S, K], strides=[stride_am, 1], block_shape=[BM, BK])
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc_up = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=WARP_SPECIALIZE):
        if EVEN_K:
            a_mask = live[:, None]
            b_mask = n_live[None, :]
        else:
            k_live = offs_k < K - k0
            a_mask = live[:, None] & k_live[None, :]
            b_mask = k_live[:, None] & n_live[None, :]
        if A_DESC:
            a = a_desc.load([start + row0, k0])
        else:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        a = a.to(b_ptr.dtype.element_ty)
        if B_DESC == B_K_ROWS:
            b = b_desc.load([b_row, k0]).T
        elif B_DESC == B_N_ROWS:
            b = b_desc.load([b_row + k0, n_tile * BN])
        else:
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if EPILOGUE == GATED_FORWARD:
            if B_DESC == B_K_ROWS:
                b_up = b_desc.load([b_row + GATE_OFFSET, k0]).T
            elif B_DESC == B_N_ROWS:
                b_up = b_desc.load([b_row + k0, GATE_OFFSET + n_tile * BN])
            else:
                b_up = tl.load(b_ptrs + GATE_OFFSET * stride_bn, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BK
        b_ptrs += BK * stride_bk
    if HAS_BIAS:
        bias_row = bias_ptr + e.to(tl.int64) * stride_bias_e
        acc += tl.load(bias_row + offs_n, mask=n_live, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE == GATED_FORWARD:
            acc_up += tl.load(bias_row + GATE_OFFSET + offs_n, mask=n_live, other=0.0).to(tl.float32)[None, :]
    if C_BY_SLOT:
        c_rows = slot.to(tl.int64)
    else:
        c_rows = srow.to(tl.int64)
    c_live = live[:, None] & n_live[None, :]
    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :]
    if EPILOGUE == GATED_BACKWARD:
        p_ptrs = preact_ptr + srow.to(tl.int64)[:, None] * (2 * GATE_OFFSET) + offs_n[None, :]
        g = tl.load(p_ptrs, mask=c_live, other=0.0).to(tl.float32)
        up = tl.load(p_ptrs + GATE_OFFSET, mask=c_live, other=0.0).to(tl.float32)
        act, act_grad = _activate_with_grad(g, ACTIVATION)
        tl.store(c_ptrs, (acc * up * act_grad).to(c_ptr.dtype.element_ty), mask=c_live)
        tl.store(c_ptrs + GATE_OFFSET, (acc * act).to(c_ptr.dtype.element_ty), mask=c_live)
    else:
        if EPILOGUE == GATED_FORWARD:
            if STORE_PREACT:
                p_ptrs = aux_ptr + srow.to(tl.int64)[:, None] * (2 * GATE_OFFSET) + offs_n[None, :]
                tl.store(p_ptrs, acc.to(aux_ptr.dtype.element_ty), mask=c_live)
                tl.store(p_ptrs + GATE_OFFSET, acc_up.to(aux_ptr.dtype.element_ty), mask=c_live)
            acc = _activate(acc, ACTIVATION) * acc_up
        if ACCUMULATE:
            y = acc.to(b_ptr.dtype.element_ty).to(tl.float32) * scale[:, None]
            token_ptrs = c_ptr + (slot // TOP_K).to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
            tl.atomic_add(token_ptrs, y, mask=c_live)
        else:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_live)


# --- weight gradients: a K-grouped GEMM over each expert's rows --------------------------------------------------

@triton.jit
def grouped_wgrad_kernel(
    l_ptr, r_ptr, counts_ptr, starts_ptr,
    dw_ptr, dbias_ptr,
    E: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
    stride_lm: tl.constexpr, stride_rm: tl.constexpr, HAS_BIAS: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DESC: tl.constexpr = False, ROWS: tl.constexpr = 1,
):
    """dw[e] ([N, K]) = sum over expert e's sorted rows of L[row]^T R[row], and dbias[e] = the sum of L's rows.

    Grid: E * N tiles * K tiles; an idle expert's tiles are written as zeros. The loop over the expert's rows has
    run-time bounds (a ``for`` loop, so the loads are pipelined). ``DESC`` loads the expert's whole BR-row steps
    through tensor descriptors (TMA on Hopper) over L and R as [ROWS, N] and [ROWS, K] arrays, and its last partial
    step through masked pointers (the rows after it are the next expert's); the same rows in the same steps, so the
    same sums."""
    pid = tl.program_id(0)
    num_n: tl.constexpr = (N + BN - 1) // BN
    num_k: tl.constexpr = (K + BK - 1) // BK
    e = pid // (num_n * num_k)
    n_tile = (pid // num_k) % num_n
    k_tile = pid % num_k
    count = tl.load(counts_ptr + e)
    start = tl.load(starts_ptr + e)
    offs_n = n_tile * BN + tl.arange(0, BN)
    offs_k = k_tile * BK + tl.arange(0, BK)
    n_live = offs_n < N
    k_live = offs_k < K
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    bias_acc = tl.zeros([BN], dtype=tl.float32)
    rest = 0
    if DESC:
        l_desc = tl.make_tensor_descriptor(l_ptr, shape=[ROWS, N], strides=[stride_lm, 1], block_shape=[BR, BN])
        r_desc = tl.make_tensor_descriptor(r_ptr, shape=[ROWS, K], strides=[stride_rm, 1], block_shape=[BR, BK])
        rest = count - count % BR
        for r0 in range(0, rest, BR):
            lt = l_desc.load([start + r0, n_tile * BN]).T
            acc = tl.dot(lt, r_desc.load([start + r0, k_tile * BK]), acc, input_precision=DOT_PRECISION)
            if HAS_BIAS:
                bias_acc += tl.sum(lt.to(tl.float32), 1)
    for r0 in range(rest, count, BR):
        rows = r0 + tl.arange(0, BR)
        live = rows < count
        srow = (start + rows).to(tl.int64)
        lt = tl.load(l_ptr + srow[None, :] * stride_lm + offs_n[:, None], mask=n_live[:, None] & live[None, :],
                     other=0.0).to(dw_ptr.dtype.element_ty)
        r = tl.load(r_ptr + srow[:, None] * stride_rm + offs_k[None, :], mask=live[:, None] & k_live[None, :],
                    other=0.0).to(dw_ptr.dtype.element_ty)
        acc = tl.dot(lt, r, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            bias_acc += tl.sum(lt.to(tl.float32), 1)
    dw_ptrs = dw_ptr + e.to(tl.int64) * (N * K) + offs_n[:, None] * K + offs_k[None, :]
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_live[:, None] & k_live[None, :])
    if HAS_BIAS:
        if k_tile == 0:
            tl.store(dbias_ptr + e * N + offs_n, bias_acc.to(dbias_ptr.dtype.element_ty), mask=n_live)


@triton.jit
def gather_rows_kernel(src_ptr, order_ptr, scale_ptr, starts_ptr, out_ptr,
                       E: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr,
                       BR: tl.constexpr, BH: tl.constexpr):
    """out[r] = src[token of sorted row r] (times the slot's routing weight in float32 with ``SCALE``), in out's
    dtype, for the routed rows (r < starts[E]); the rest are left as they are. One program per [BR, BH] tile."""
    pid = tl.program_id(0)
    num_h: tl.constexpr = (H + BH - 1) // BH
    rows = (pid // num_h) * BR + tl.arange(0, BR)
    cols = (pid % num_h) * BH + tl.arange(0, BH)
    live = rows < tl.load(starts_ptr + E)
    mask = live[:, None] & (cols < H)[None, :]
    slot = tl.load(order_ptr + rows, mask=live, other=0)
    v = tl.load(src_ptr + (slot // TOP_K).to(tl.int64)[:, None] * H + cols[None, :], mask=mask, other=0.0)
    if SCALE:
        v = v.to(tl.float32) * tl.load(scale_ptr + slot, mask=live, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


# --- per-token combine and its routing-weight gradient -----------------------------------------------------------

@triton.jit
def combine_kernel(y_ptr, ids_ptr, w_ptr, T, out_ptr,
                   E: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr, WEIGHTED: tl.constexpr,
                   BT: tl.constexpr, BH: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[t*k + j] in float32, in a fixed order (j = 0..k-1); empty slots are not read.
    Without WEIGHTED the weights are 1 (the input gradient's sum over a token's slots). One program per
    [BT tokens, BH columns] tile."""
    pid = tl.program_id(0)
    num_h: tl.constexpr = (H + BH - 1) // BH
    tokens = (pid // num_h) * BT + tl.arange(0, BT)
    t_live = tokens < T
    offs = (pid % num_h) * BH + tl.arange(0, BH)
    h_live = offs < H
    acc = tl.zeros([BT, BH], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slots = tokens * TOP_K + j
        expert = tl.load(ids_ptr + slots, mask=t_live, other=-1)
        valid = _routed(expert, E)
        y = tl.load(y_ptr + slots.to(tl.int64)[:, None] * H + offs[None, :], mask=valid[:, None] & h_live[None, :],
                    other=0.0).to(tl.float32)
        if WEIGHTED:
            w = tl.load(w_ptr + slots, mask=valid, other=0.0).to(tl.float32)
            acc += w[:, None] * y
        else:
            acc += y
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * H + offs[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_live[:, None] & h_live[None, :])


@triton.jit
def routing_grad_kernel(dout_ptr, y_ptr, ids_ptr, T, dw_ptr,
                        E: tl.constexpr, H: tl.constexpr, TOP_K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """dw[t, j] = <dout[t], y[t*k + j]> in float32; zero for an empty slot. One program per BT tokens."""
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    t_live = tokens < T
    offs = tl.arange(0, BH)
    for j in tl.static_range(TOP_K):
        slots = tokens * TOP_K + j
        expert = tl.load(ids_ptr + slots, mask=t_live, other=-1)
        valid = _routed(expert, E)
        acc = tl.zeros([BT, BH], dtype=tl.float32)
        for h0 in range(0, H, BH):
            h_live = offs < H - h0
            d = tl.load(dout_ptr + tokens.to(tl.int64)[:, None] * H + h0 + offs[None, :],
                        mask=t_live[:, None] & h_live[None, :], other=0.0).to(tl.float32)
            y = tl.load(y_ptr + slots.to(tl.int64)[:, None] * H + h0 + offs[None, :],
                        mask=valid[:, None] & h_live[None, :], other=0.0).to(tl.float32)
            acc += d * y
        tl.store(dw_ptr + slots, tl.sum(acc, 1), mask=t_live)


# --- decode: a few slots, one GEMV per slot, no sort -------------------------------------------------------------

@triton.jit
def _gate_up_dots(x_row, w_rows, n_live, W_DTYPE: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                  stride_wn: tl.constexpr, stride_wk: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """(g, u), float32 [BN]: the gate rows at ``w_rows`` and the up rows I rows further, times the hidden row at
    ``x_row`` (rounded to the weights' dtype), BK inputs at a time."""
    offs_k = tl.arange(0, BK)
    gate = tl.zeros([BN], dtype=tl.float32)
    up = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        k_live = offs_k < H - k0
        x = tl.load(x_row + k0 + offs_k, mask=k_live, other=0.0).to(W_DTYPE).to(tl.float32)
        w_ptrs = w_rows + (k0 + offs_k)[None, :] * stride_wk
        mask = n_live[:, None] & k_live[None, :]
        gate += tl.sum(tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
        up += tl.sum(tl.load(w_ptrs + I * stride_wn, mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
    return gate, up


@triton.jit
def decode_gate_up_kernel(x_ptr, ids_ptr, w_ptr, bias_ptr, S, act_ptr,
                          E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                          stride_we: tl.constexpr, stride_wn: tl.constexpr, stride_wk: tl.constexpr,
                          stride_bias_e: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr):
    """act[s, n] = act(g) * u for slot s, [g; u] = gate_up[e] @ x[s // k] (+ bias): each program streams a
    [BN, H] slice of its expert's gate and up rows once."""
    pid = tl.program_id(0)
    num_n: tl.constexpr = (I + BN - 1) // BN
    s = pid // num_n
    expert = tl.load(ids_ptr + s)
    if (expert < 0) | (expert >= E):
        return
    offs_n = (pid % num_n) * BN + tl.arange(0, BN)
    n_live = offs_n < I
    x_row = x_ptr + (s // TOP_K).to(tl.int64) * H
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn
    gate, up = _gate_up_dots(x_row, w_rows, n_live, w_ptr.dtype.element_ty, H, I, stride_wn, stride_wk, BN, BK)
    if HAS_BIAS:
        bias_row = bias_ptr + expert.to(tl.int64) * stride_bias_e
        gate += tl.load(bias_row + offs_n, mask=n_live, other=0.0).to(tl.float32)
        up += tl.load(bias_row + I + offs_n, mask=n_live, other=0.0).to(tl.float32)
    out = _activate(gate, ACTIVATION) * up
    tl.store(act_ptr + s.to(tl.int64) * I + offs_n, out.to(act_ptr.dtype.element_ty), mask=n_live)


@triton.jit
def decode_down_combine_kernel(act_ptr, ids_ptr, w_ptr, down_ptr, bias_ptr, T, out_ptr,
                               E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                               stride_de: tl.constexpr, stride_dn: tl.constexpr, stride_dk: tl.constexpr,
                               stride_bias_e: tl.constexpr, HAS_BIAS: tl.constexpr,
                               KP: tl.constexpr, JB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[t, n] = sum_j w[t, j] * (down[e_j] @ act[t*k + j] + bias), the down projection and the combine of
    one token in one program. The slots' [BN, BK] weight tiles load JB experts at a time as one [JB, BN, BK] block
    (JB a power of two dividing KP, k rounded up to a power of two: more bytes in flight than one expert at a
    time); empty and padding slots load nothing and add zero; the sums over j run in one fixed order."""
    pid = tl.program_id(0)
    num_n: tl.constexpr = (H + BN - 1) // BN
    t = pid // num_n
    offs_n = (pid % num_n) * BN + tl.arange(0, BN)
    n_live = offs_n < H
    offs_k = tl.arange(0, BK)
    total = tl.zeros([BN], dtype=tl.float32)
    for j0 in tl.static_range(0, KP, JB):
        offs_j = j0 + tl.arange(0, JB)
        slots = t.to(tl.int64) * TOP_K + offs_j
        experts = tl.load(ids_ptr + slots, mask=offs_j < TOP_K, other=-1)
        routed = _routed(experts, E)
        rows = tl.where(routed, experts, 0).to(tl.int64)
        a_rows = act_ptr + slots * I
        d_rows = down_ptr + rows[:, None, None] * stride_de + offs_n[None, :, None] * stride_dn
        d_live = routed[:, None, None] & n_live[None, :, None]
        acc = tl.zeros([JB, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            k_live = offs_k < I - k0
            a = tl.load(a_rows[:, None] + k0 + offs_k[None, :], mask=routed[:, None] & k_live[None, :],
                        other=0.0).to(tl.float32)
            d = tl.load(d_rows + (k0 + offs_k)[None, None, :] * stride_dk, mask=d_live & k_live[None, None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(d * a[:, None, :], 2)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows[:, None] * stride_bias_e + offs_n[None, :],
                           mask=routed[:, None] & n_live[None, :], other=0.0).to(tl.float32)
        y = acc.to(down_ptr.dtype.element_ty).to(tl.float32)
        total += tl.sum(tl.load(w_ptr + slots, mask=routed, other=0.0).to(tl.float32)[:, None] * y, 0)
    tl.store(out_ptr + t.to(tl.int64) * H + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_live)
