"""The launch plans of the fused MoE Triton kernels, as data both framework bindings execute (no triton import).

A plan is a list of ``Step``s: which kernel of ``moe_shared.kernels.moe`` to launch, its 1-D grid, its arguments by
buffer name (or a run-time integer), the buffers it creates, and its compile-time constants, tile config and warps.
torch and JAX run the same plan with their own allocation and launch (``moe_torch.backends.triton``,
``moe_jax.backends.triton``), so the same problem launches the same kernels with the same configs in both: the
same bits.

Buffers the caller provides: ``x`` [T, H], ``ids`` [T*k] (int32/int64), ``w`` [T*k] routing weights, ``gate_up``
[E, 2I, H], ``down`` [E, H, I], ``gate_up_bias`` [E, 2I], ``down_bias`` [E, H]; for the backward also ``dout``
[T, H] and the residuals the forward plan lists.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, Mapping

ACTIVATION_CODES = {"silu": 0, "gelu": 1, "relu": 2}
PLAIN, GATED_FORWARD, GATED_BACKWARD = 0, 1, 2
ROUTE_CHUNK = 1024  # most slots per program of the routing sort
CONFIG_DIR = Path(__file__).with_name("configs")
CONFIG_DIR_VARIABLE = "MOE_EXPERTS_TRITON_CONFIGS"  # a folder of <device>.json files read instead of CONFIG_DIR

# Buffer dtypes are named by role: the weights' dtype, hidden_states' dtype, the routing weights' dtype, or fixed.
WEIGHTS, HIDDEN, ROUTING, FLOAT32, INT32 = "weights", "hidden", "routing", "float32", "int32"


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: str  # a role above


@dataclass(frozen=True)
class Step:
    kernel: str
    grid: int
    inputs: tuple[str | int, ...]  # buffer names, or run-time integer scalars
    outputs: tuple[Buffer, ...]
    constants: Mapping[str, Any]
    num_warps: int
    num_stages: int
    zeroed: tuple[int, ...] = ()  # outputs that must start as zeros (the atomic combine)


@dataclass(frozen=True)
class Problem:
    """Everything a plan depends on: shapes, options, the weights' strides (elements) and the device name."""

    T: int
    H: int
    I: int
    E: int
    k: int
    activation: str
    dtype: str  # the weights' dtype
    gate_up_strides: tuple[int, int, int]
    down_strides: tuple[int, int, int]
    gate_up_bias_stride: int | None = None  # the expert stride of gate_up_bias; None: no bias
    down_bias_stride: int | None = None
    device: str = "default"
    deterministic: bool = True
    tma: bool = False  # the binding can launch tensor descriptors (a global-scratch allocator, aligned weights)

    @property
    def S(self) -> int:
        return self.T * self.k


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    output: str  # the buffer holding the result
    residuals: tuple[str, ...] = ()  # buffers the backward plan reads (with the inputs)
    buffers: Mapping[str, Buffer] = field(default_factory=dict)  # every buffer the steps create


@dataclass(frozen=True)
class TileConfig:
    BM: int = 64
    BN: int = 64
    BK: int = 64
    num_warps: int = 4
    num_stages: int = 3
    GROUP_M: int = 1  # row blocks that take the N tiles together (row-block kernels)
    TMA: bool = False  # through tensor descriptors where the binding allows it: grouped GEMMs the weight tiles,
    # wgrad the row tiles
    WARP_SPECIALIZE: bool = False  # grouped GEMMs: loading and multiplying warps apart (triton's tl.range option)
    SHORT_TAILS: int = 0  # grouped GEMMs: an expert's last block may run a BM/2, ..., BM/2**SHORT_TAILS-row tile
    A_TMA: bool = False  # grouped GEMMs: the row tiles through tensor descriptors too (the gate/up GEMM then reads
    # x gathered into sorted order by a step before it)
    PROGRAMS: int = 0  # grouped GEMMs: persistent programs looping over the output tiles (0: one program per tile)
    BLOCK_TABLE: bool = False  # grouped GEMMs: each row block's expert and rows read from a table a step before
    # writes (no reduction over the experts ahead of the K loop, which triton's Hopper warp specialization needs)
    EXPERTS_TOGETHER: int = 0  # decode down kernel: the slots' experts whose weight tiles load as one block (0: all k)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _experts_together(config: TileConfig, k: int) -> int:
    """The decode down kernel's JB: a power of two dividing k rounded up to one."""
    return min(_pow2(config.EXPERTS_TOGETHER), _pow2(k)) if config.EXPERTS_TOGETHER > 0 else _pow2(k)


# --- tile configs: tuned entries per device and shape (data files), a documented default for the rest -----------

@cache
def _tuned(device: str) -> Mapping[str, Any]:
    path = Path(os.environ.get(CONFIG_DIR_VARIABLE, CONFIG_DIR)) / f"{device_file_name(device)}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def device_file_name(device: str) -> str:
    """The config file stem of a device name: "NVIDIA H200" -> "nvidia-h200"."""
    return "-".join(device.lower().replace("_", " ").split())


def default_config(kernel: str, N: int, K: int, rows_per_expert: float) -> TileConfig:
    """The documented default where no tuned entry exists.

    Row-block kernels (``gate_up``, ``down``, ``dgrad_down``, ``dgrad_up``): BM is the mean rows per expert rounded
    up to a power of two within [16, 128], so a decode batch pads each expert's block to 16 rows and each hit
    expert's weights are read once per N tile; BN 64 (two accumulators for gate_up) or 128 from BM 64 on, BK 64,
    8 warps from BM 128 on, GROUP_M 8 from BM 64 on (row blocks sharing weight tiles in L2: faster or equal for 10
    of 12 GEMM steps at T=4096 on the H200), SHORT_TAILS 1 from BM 32 on (an expert's last block with at most
    BM/2 rows runs a half-height tile: 3-13% faster for 14 of 16 GEMM steps of the three model shapes on the
    H200, tests/device_results/nvidia-h200-triton-steps-tails.json). ``wgrad``: 128 x 128 output tiles over 64-row
    steps (BM is the row step). ``decode``: GEMV tiles of 32 outputs x 256 inputs, the down kernel one expert's
    tiles at a time (all k at once only where measured: a [k, BN, BK] block of wide tiles does not fit in
    registers).
    """
    if kernel == "decode":
        return TileConfig(BM=1, BN=32, BK=256, num_warps=4, num_stages=2, EXPERTS_TOGETHER=1)
    if kernel == "wgrad":
        return TileConfig(BM=64, BN=min(128, max(16, _pow2(N))), BK=min(128, max(16, _pow2(K))), num_warps=8,
                          num_stages=3)
    BM = min(128, max(16, _pow2(math.ceil(rows_per_expert))))
    BN = 64 if kernel == "gate_up" or BM < 64 else 128
    return TileConfig(BM=BM, BN=min(BN, max(16, _pow2(N))), BK=min(64, max(16, _pow2(K))),
                      num_warps=8 if BM >= 128 else 4, num_stages=3 if BM < 128 else 4, GROUP_M=8 if BM >= 64 else 1,
                      SHORT_TAILS=1 if BM >= 32 else 0)


OVERRIDES: dict[tuple[str, int, int, int], TileConfig] = {}
"""(kernel, N, K, E) -> the config to use whatever the data files say: the tuner's hook (clear the plan caches,
``clear_caches()``, after changing it)."""


def clear_caches() -> None:
    for planner in (forward_plan, backward_plan, grouped_matmul_plan, grouped_matmul_wgrad_plan):
        planner.cache_clear()
    _tuned.cache_clear()


def tile_config(device: str, kernel: str, N: int, K: int, E: int, slots: int) -> TileConfig:
    """The tuned config of the nearest row count (log scale) for this kernel and shape on ``device``, or
    ``default_config`` where there is none or, if the device's table sets ``tuned_reach`` (log2 of the slot counts
    an entry stands for around its own; absent: any distance), none that near."""
    if (kernel, N, K, E) in OVERRIDES:
        return OVERRIDES[kernel, N, K, E]
    rows = slots / max(E, 1)
    table = _tuned(device)
    best, distance = None, math.inf
    for entry in table.get("configs", ()):
        if (entry["kernel"], entry["N"], entry["K"], entry["E"]) != (kernel, N, K, E):
            continue
        d = abs(math.log2(max(entry["slots"], 1)) - math.log2(max(slots, 1)))
        if d < distance:
            best, distance = entry, d
    if best is None or distance > table.get("tuned_reach", math.inf):
        return default_config(kernel, N, K, rows)
    return TileConfig(**best["config"])


def decode_max_slots(device: str, problem: Problem) -> int:
    """Largest T*k that takes the decode kernels (inference only): the tuned value, else 16."""
    table = _tuned(device).get("decode_max_slots", {})
    return int(table.get(f"{problem.H}x{problem.I}x{problem.E}", table.get("default", 16)))


# --- plans --------------------------------------------------------------------------------------------------------

_UNUSED = Buffer("unused", (1,), WEIGHTS)  # stands for an optional kernel output the step does not need


def _bias(problem: Problem, which: str) -> tuple[str, int, bool]:
    stride = problem.gate_up_bias_stride if which == "gate_up" else problem.down_bias_stride
    return (f"{which}_bias", stride, True) if stride is not None else ("x", 0, False)


def _dot_precision(problem: Problem) -> str:
    return "ieee" if problem.dtype == "float32" else "tf32"  # tf32 is the default; it only applies to float32


def _expert_bins(E: int) -> int:
    return _pow2(E + 2)  # experts, the empty bin E, and the padding bin E + 1


def _route_steps(S: int, E: int, empty_to_first: bool = False) -> list[Step]:
    EB = _expert_bins(E)
    chunk = min(ROUTE_CHUNK, max(16, _pow2(S)))
    chunks = _cdiv(S, chunk)
    single = chunks <= 1
    steps = []
    if not single:
        steps.append(Step("route_histogram_kernel", chunks, ("ids", S), (Buffer("hist", (chunks * EB,), INT32),),
                          dict(E=E, CHUNK=chunk, EB=EB, EMPTY_TO_FIRST=empty_to_first), num_warps=4,
                          num_stages=1))
    steps.append(Step("route_sort_kernel", chunks, ("ids", "ids" if single else "hist", S),
                      (Buffer("order", (max(S, 1),), INT32), Buffer("counts", (E,), INT32),
                       Buffer("starts", (E + 1,), INT32)),
                      dict(E=E, CHUNK=chunk, EB=EB, SINGLE_CHUNK=single, EMPTY_TO_FIRST=empty_to_first),
                      num_warps=4, num_stages=1))
    return steps


def _row_blocks(S: int, E: int, BM: int) -> int:
    """Static upper bound of the expert-aligned row blocks: sum_e ceil(c_e / BM) <= S / BM + min(E, S)."""
    return _cdiv(S, BM) + min(E, S)


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
B_POINTERS, B_K_ROWS, B_N_ROWS = 0, 1, 2  # moe.grouped_gemm_kernel's B_DESC codes
_TMA_ALIGN = 16  # bytes: row strides and the inner block extent


def _b_descriptor(problem: Problem, cfg: TileConfig, b_strides: tuple[int, int, int], K: int) -> dict[str, int]:
    """The weights' descriptor constants of a grouped GEMM (B_DESC, B_ROWS, B_COLS): a tensor descriptor where
    the config asks for one, the binding allows them and the layout fits one (a unit stride, 16-byte row strides,
    the experts one after another with no gap), else masked pointers."""
    pointers = dict(B_DESC=B_POINTERS, B_ROWS=0, B_COLS=0)
    if not (cfg.TMA and problem.tma):
        return pointers
    e, sk, sn = b_strides
    size = _ITEMSIZE[problem.dtype]
    if sk == 1 and cfg.BK * size >= _TMA_ALIGN:
        code, row, cols = B_K_ROWS, sn, K
    elif sn == 1 and cfg.BN * size >= _TMA_ALIGN:
        code, row, cols = B_N_ROWS, sk, sk
    else:
        return pointers
    if row < 1 or e % row or (row * size) % _TMA_ALIGN:
        return pointers
    return dict(B_DESC=code, B_ROWS=e // row, B_COLS=cols)


def _a_descriptor(problem: Problem, cfg: TileConfig, stride_am: int, a_by_token: bool) -> bool:
    """Whether a grouped GEMM loads its A tiles through a tensor descriptor: where the config asks for it, the
    binding allows descriptors, the rows are sorted rows (not gathered by token) of a 16-bit [S, K] array with
    16-byte row strides, and there are rows."""
    size = _ITEMSIZE[problem.dtype]
    return (cfg.A_TMA and problem.tma and not a_by_token and size == 2 and problem.S > 0
            and cfg.BK * size >= _TMA_ALIGN and (stride_am * size) % _TMA_ALIGN == 0)


def gathers_x(problem: Problem, *, training: bool) -> bool:
    """Whether the forward gathers x into sorted order before its gate/up GEMM: always for training (the
    backward's weight gradient reads those rows), and at inference where the gate/up config loads its A tiles
    through a tensor descriptor."""
    if training:
        return True
    cfg = tile_config(problem.device, "gate_up", problem.I, problem.H, problem.E, problem.S)
    return _a_descriptor(problem, cfg, problem.H, a_by_token=False)


def makes_tensor_descriptors(step: Step) -> bool:
    """Whether a step's kernel makes tensor descriptors on the device (it then takes a global scratch buffer)."""
    return any(step.constants.get(flag) for flag in ("B_DESC", "A_DESC", "DESC"))


_MIN_DOT_ROWS = 16  # the smallest tile height tl.dot takes


def _short_tails(cfg: TileConfig) -> int:
    """The config's SHORT_TAILS, cut so that the shortest tile keeps at least 16 rows."""
    return max(0, min(cfg.SHORT_TAILS, (cfg.BM // _MIN_DOT_ROWS).bit_length() - 1))


def _gemm(problem: Problem, kernel: str, *, a: str, b: str, N: int, K: int, b_strides: tuple[int, int, int],
          out: Buffer, stride_am: int, stride_cm: int, a_by_token=False, bias=("x", 0, False),
          epilogue=PLAIN, preact_out: Buffer | None = None, preact_in="x", c_by_slot=False,
          accumulate=False) -> Step:
    """A grouped_gemm_kernel step: out = A @ B[e] over sorted rows, B[e] a [K, N] view with strides
    (expert, k, n)."""
    E = problem.E
    cfg = tile_config(problem.device, kernel, N, K, E, problem.S)
    bias_name, bias_stride, has_bias = bias
    constants = dict(
        E=E, N=N, K=K, TOP_K=problem.k, stride_am=stride_am, stride_be=b_strides[0], stride_bk=b_strides[1],
        stride_bn=b_strides[2], stride_bias_e=bias_stride, stride_cm=stride_cm, GATE_OFFSET=problem.I,
        A_BY_TOKEN=a_by_token, HAS_BIAS=has_bias, EPILOGUE=epilogue,
        ACTIVATION=ACTIVATION_CODES[problem.activation], STORE_PREACT=preact_out is not None,
        C_BY_SLOT=c_by_slot, ACCUMULATE=accumulate, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, EB=_expert_bins(E),
        DOT_PRECISION=_dot_precision(problem), EVEN_K=K % cfg.BK == 0, GROUP_M=cfg.GROUP_M,
        ROW_BLOCKS=_row_blocks(problem.S, E, cfg.BM), WARP_SPECIALIZE=cfg.WARP_SPECIALIZE,
        SHORT_TAILS=_short_tails(cfg), A_DESC=_a_descriptor(problem, cfg, stride_am, a_by_token),
        PROGRAMS=cfg.PROGRAMS, BLOCK_TABLE=cfg.BLOCK_TABLE, **_b_descriptor(problem, cfg, b_strides, K))
    blocks = f"blocks{cfg.BM}" if cfg.BLOCK_TABLE else "counts"  # unread without a table
    return Step("grouped_gemm_kernel", cfg.PROGRAMS or _row_blocks(problem.S, E, cfg.BM) * _cdiv(N, cfg.BN),
                (a, b, "counts", "starts", blocks, "order", "w", bias_name, preact_in, problem.S),
                (out, preact_out or _UNUSED), constants, cfg.num_warps, cfg.num_stages,
                zeroed=(0,) if accumulate else ())


def _wgrad(problem: Problem, *, l: str, r: str, N: int, K: int, out: Buffer, bias_out: Buffer | None,
           stride_lm: int, stride_rm: int) -> Step:
    E = problem.E
    cfg = tile_config(problem.device, "wgrad", N, K, E, problem.S)
    size = _ITEMSIZE[problem.dtype]
    # descriptors for 16-bit rows only (the transposed L tile of a float32 dot wants k-contiguous rows)
    desc = (cfg.TMA and problem.tma and size == 2 and problem.S > 0 and min(cfg.BN, cfg.BK) * size >= _TMA_ALIGN
            and all(stride * size % _TMA_ALIGN == 0 for stride in (stride_lm, stride_rm)))
    constants = dict(E=E, N=N, K=K, stride_lm=stride_lm, stride_rm=stride_rm, HAS_BIAS=bias_out is not None,
                     BN=cfg.BN, BK=cfg.BK, BR=cfg.BM, DOT_PRECISION=_dot_precision(problem), DESC=desc,
                     ROWS=problem.S if desc else 1)
    return Step("grouped_wgrad_kernel", E * _cdiv(N, cfg.BN) * _cdiv(K, cfg.BK),
                (l, r, "counts", "starts"), (out, bias_out or _UNUSED), constants,
                cfg.num_warps, cfg.num_stages)


def _token_tile(T: int, H: int) -> tuple[int, int]:
    """(BT, BH) of the per-token kernels: up to 1024 columns, up to 4096 elements a program."""
    BH = min(1024, max(16, _pow2(H)))
    return min(max(1, 4096 // BH), max(1, _pow2(T))), BH


def _gather(problem: Problem, src: str, out: Buffer, scaled: bool) -> Step:
    """out [S, H]: the token rows of ``src`` in sorted slot order (scaled by the routing weights), so the GEMMs
    that read them take plain row tiles."""
    BR, BH = _token_tile(problem.S, problem.H)
    return Step("gather_rows_kernel", _cdiv(problem.S, BR) * _cdiv(problem.H, BH), (src, "order", "w", "starts"),
                (out,), dict(E=problem.E, H=problem.H, TOP_K=problem.k, SCALE=scaled, BR=BR, BH=BH), num_warps=4,
                num_stages=1)


def _combine(problem: Problem, y: str, out: Buffer, weighted: bool) -> Step:
    BT, BH = _token_tile(problem.T, problem.H)
    return Step("combine_kernel", _cdiv(problem.T, BT) * _cdiv(problem.H, BH), (y, "ids", "w", problem.T), (out,),
                dict(E=problem.E, H=problem.H, TOP_K=problem.k, WEIGHTED=weighted, BT=BT, BH=BH), num_warps=4,
                num_stages=1)


_TABLE_BLOCKS = 64  # row blocks per program of route_blocks_kernel
_BLOCK_FIELDS = 4  # moe.BLOCK_FIELDS: a block table's int32 fields per row block


def _block_table(gemm: Step) -> Step:
    """The route_blocks_kernel step that writes the block table a BLOCK_TABLE grouped GEMM reads."""
    c = gemm.constants
    return Step("route_blocks_kernel", max(1, _cdiv(c["ROW_BLOCKS"], _TABLE_BLOCKS)), ("counts", "starts"),
                (Buffer(gemm.inputs[4], (c["ROW_BLOCKS"] * _BLOCK_FIELDS + 1,), INT32),),
                dict(E=c["E"], EB=c["EB"], BM=c["BM"], ROW_BLOCKS=c["ROW_BLOCKS"], BB=_TABLE_BLOCKS), num_warps=4,
                num_stages=1)


def _with_block_tables(steps: list[Step]) -> list[Step]:
    """``steps`` with each block table written right before the first grouped GEMM that reads it."""
    out, made = [], set()
    for step in steps:
        if step.kernel == "grouped_gemm_kernel" and step.constants["BLOCK_TABLE"] and step.inputs[4] not in made:
            made.add(step.inputs[4])
            out.append(_block_table(step))
        out.append(step)
    return out


def _finish(steps: list[Step], output: str, residuals: tuple[str, ...] = ()) -> Plan:
    steps = _with_block_tables(steps)
    buffers = {b.name: b for s in steps for b in s.outputs}
    return Plan(tuple(steps), output, residuals, buffers)


@lru_cache(maxsize=512)
def forward_plan(problem: Problem, *, training: bool = False) -> Plan:
    """The forward: the decode kernels for a few slots at inference, else route, gate/up (activation fused),
    down, combine. ``training`` keeps what ``backward_plan`` reads (pre-activations and per-slot outputs)."""
    T, H, I, E, S = problem.T, problem.H, problem.I, problem.E, problem.S
    g_e, g_n, g_k = problem.gate_up_strides
    d_e, d_n, d_k = problem.down_strides
    if not training and S <= decode_max_slots(problem.device, problem):
        up = tile_config(problem.device, "decode", I, H, E, S)
        down = tile_config(problem.device, "decode", H, I, E, S)
        gate_bias, gate_bias_stride, gate_has_bias = _bias(problem, "gate_up")
        down_bias, down_bias_stride, down_has_bias = _bias(problem, "down")
        steps = [
            Step("decode_gate_up_kernel", S * _cdiv(I, up.BN), ("x", "ids", "gate_up", gate_bias, S),
                 (Buffer("act", (S, I), WEIGHTS),),
                 dict(E=E, H=H, I=I, TOP_K=problem.k, stride_we=g_e, stride_wn=g_n, stride_wk=g_k,
                      stride_bias_e=gate_bias_stride, HAS_BIAS=gate_has_bias,
                      ACTIVATION=ACTIVATION_CODES[problem.activation], BN=up.BN, BK=up.BK),
                 up.num_warps, up.num_stages),
            Step("decode_down_combine_kernel", T * _cdiv(H, down.BN), ("act", "ids", "w", "down", down_bias, T),
                 (Buffer("out", (T, H), HIDDEN),),
                 dict(E=E, H=H, I=I, TOP_K=problem.k, stride_de=d_e, stride_dn=d_n, stride_dk=d_k,
                      stride_bias_e=down_bias_stride, HAS_BIAS=down_has_bias, KP=_pow2(problem.k),
                      JB=_experts_together(down, problem.k), BN=down.BN, BK=down.BK),
                 down.num_warps, down.num_stages),
        ]
        return _finish(steps, "out")
    accumulate = not (problem.deterministic or training)
    steps = _route_steps(problem.S, problem.E)
    gathered = gathers_x(problem, training=training)
    if gathered:
        steps.append(_gather(problem, "x", Buffer("x_sorted", (S, H), WEIGHTS), scaled=False))
    steps.append(_gemm(problem, "gate_up", a="x_sorted" if gathered else "x", b="gate_up", N=I, K=H,
                       b_strides=(g_e, g_k, g_n), out=Buffer("act", (S, I), WEIGHTS), stride_am=H, stride_cm=I,
                       a_by_token=not gathered,
                       bias=_bias(problem, "gate_up"), epilogue=GATED_FORWARD,
                       preact_out=Buffer("preact", (S, 2 * I), WEIGHTS) if training else None))
    if accumulate:
        steps.append(_gemm(problem, "down", a="act", b="down", N=H, K=I, b_strides=(d_e, d_k, d_n),
                           out=Buffer("out_sum", (T, H), FLOAT32), stride_am=I, stride_cm=H,
                           bias=_bias(problem, "down"), accumulate=True))
        return _finish(steps, "out_sum")
    steps.append(_gemm(problem, "down", a="act", b="down", N=H, K=I, b_strides=(d_e, d_k, d_n),
                       out=Buffer("y", (S, H), WEIGHTS), stride_am=I, stride_cm=H, bias=_bias(problem, "down"),
                       c_by_slot=True))
    steps.append(_combine(problem, "y", Buffer("out", (T, H), HIDDEN), weighted=True))
    return _finish(steps, "out", TRAINING_RESIDUALS if training else ())


TRAINING_RESIDUALS = ("order", "counts", "starts", "x_sorted", "preact", "act", "y")
"""What the training forward keeps for ``backward_plan``: the routing, x in sorted order (for the gate/up weight
gradient), the pre-activations [g | u] (for d act), the activations the down GEMM read (for its weight gradient)
and the per-slot outputs (for the routing-weight gradient)."""

GRADIENTS = {"hidden_states": "dx", "top_k_weights": "dw", "gate_up_proj": "d_gate_up", "down_proj": "d_down",
             "gate_up_bias": "d_gate_up_bias", "down_bias": "d_down_bias"}


@lru_cache(maxsize=512)
def backward_plan(problem: Problem) -> Plan:
    """Gradients from ``dout`` and the training forward's residuals; ``GRADIENTS`` names the result buffers."""
    T, H, I, E, S = problem.T, problem.H, problem.I, problem.E, problem.S
    g_e, g_n, g_k = problem.gate_up_strides
    d_e, d_n, d_k = problem.down_strides
    BT, BH = _token_tile(T, H)
    has_gate_bias = problem.gate_up_bias_stride is not None
    has_down_bias = problem.down_bias_stride is not None
    steps = [
        Step("routing_grad_kernel", _cdiv(T, BT), ("dout", "y", "ids", T), (Buffer("dw", (S,), ROUTING),),
             dict(E=E, H=H, TOP_K=problem.k, BT=BT, BH=BH), num_warps=4, num_stages=1),
        # the rows w * dout in sorted order, read by the input gradient's and the down weight gradient's GEMMs as
        # plain tiles (gathering and scaling them inside those GEMMs' loops cost up to 2x in their time); the
        # forward kept x in sorted order
        _gather(problem, "dout", Buffer("dout_sorted", (S, H), WEIGHTS), scaled=True),
        # d(act(g) * u) = (w * dout) @ down[e], then [dg, du] in the epilogue
        _gemm(problem, "dgrad_down", a="dout_sorted", b="down", N=I, K=H, b_strides=(d_e, d_n, d_k),
              out=Buffer("dpreact", (S, 2 * I), WEIGHTS), stride_am=H, stride_cm=2 * I,
              epilogue=GATED_BACKWARD, preact_in="preact"),
        _gemm(problem, "dgrad_up", a="dpreact", b="gate_up", N=H, K=2 * I, b_strides=(g_e, g_n, g_k),
              out=Buffer("dx_slots", (S, H), WEIGHTS), stride_am=2 * I, stride_cm=H, c_by_slot=True),
        _combine(problem, "dx_slots", Buffer("dx", (T, H), HIDDEN), weighted=False),
        _wgrad(problem, l="dout_sorted", r="act", N=H, K=I, out=Buffer("d_down", (E, H, I), WEIGHTS),
               bias_out=Buffer("d_down_bias", (E, H), WEIGHTS) if has_down_bias else None,
               stride_lm=H, stride_rm=I),
        _wgrad(problem, l="dpreact", r="x_sorted", N=2 * I, K=H, out=Buffer("d_gate_up", (E, 2 * I, H), WEIGHTS),
               bias_out=Buffer("d_gate_up_bias", (E, 2 * I), WEIGHTS) if has_gate_bias else None,
               stride_lm=2 * I, stride_rm=H),
    ]
    return _finish(steps, "dx")


# --- SonicMoE's routing metadata (the sonicmoe backends run SonicMoE's GEMMs on it) ------------------------------

SONIC_ROUTING = ("scores", "offsets", "x_gather", "s_scatter", "s_reverse")
"""The buffers of ``sonic_routing_plan`` that SonicMoE's steps read, ``offsets`` [E + 1] being the sort's
``starts``."""


@lru_cache(maxsize=512)
def sonic_routing_plan(T: int, k: int, E: int) -> Plan:
    """SonicMoE's routing metadata from ``ids`` and ``w`` [T*k]: the stable sort by expert with every empty slot
    (an id outside [0, E)) given a row of expert 0, whose routing weight is made zero (SonicMoE's kernels fault on
    such ids and cannot skip a slot; a zero weight times that row's finite output adds exactly zero to its token
    and to every gradient). Its buffers: ``SONIC_ROUTING`` (with ``starts`` for ``offsets``), ``counts``."""
    S = T * k
    BLOCK = 1024
    steps = _route_steps(S, E, empty_to_first=True)
    steps.append(Step("sonic_routing_kernel", _cdiv(S, BLOCK), ("order", "ids", "w", S),
                      (Buffer("x_gather", (S,), INT32), Buffer("s_scatter", (S,), INT32),
                       Buffer("s_reverse", (S,), INT32), Buffer("scores", (S,), FLOAT32)),
                      dict(E=E, TOP_K=k, BLOCK=BLOCK), num_warps=4, num_stages=1))
    return _finish(steps, "scores")


# --- a plain grouped matmul (the JAX grouped_mm backend's kernel on GPU) -----------------------------------------

@lru_cache(maxsize=512)
def grouped_matmul_plan(S: int, N: int, K: int, E: int, b_strides: tuple[int, int, int], dtype: str,
                        device: str) -> Plan:
    """out [S, N] = a[rows of e] @ B[e] for rows sorted by expert (``counts``, ``starts``; ``order`` the identity),
    B[e] a [K, N] view with strides (expert, k, n). Rows past the last group are zeros."""
    problem = Problem(T=S, H=K, I=N, E=E, k=1, activation="silu", dtype=dtype, gate_up_strides=b_strides,
                      down_strides=b_strides, device=device)
    step = _gemm(problem, "grouped", a="a", b="b", N=N, K=K, b_strides=b_strides,
                 out=Buffer("out", (S, N), WEIGHTS), stride_am=K, stride_cm=N)
    return _finish([replace(step, zeroed=(0,))], "out")


@lru_cache(maxsize=512)
def grouped_matmul_wgrad_plan(S: int, N: int, K: int, E: int, dtype: str, device: str) -> Plan:
    """dw [E, N, K] = sum over the rows of e of l[row]^T r[row], for l [S, N] and r [S, K] sorted by expert."""
    problem = Problem(T=S, H=K, I=N, E=E, k=1, activation="silu", dtype=dtype, gate_up_strides=(0, 0, 0),
                      down_strides=(0, 0, 0), device=device)
    return _finish([_wgrad(problem, l="l", r="r", N=N, K=K, out=Buffer("dw", (E, N, K), WEIGHTS), bias_out=None,
                           stride_lm=N, stride_rm=K)], "dw")
