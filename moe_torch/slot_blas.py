"""Per-slot products on CUDA without gathered weights: one cuBLAS batched GEMM whose batch entries point at each
slot's expert weights where they lie.

``batched_mm``'s plain way copies T*k experts' weights (``table[ids]``) and runs ``torch.bmm`` on the copy: from a
few slots on, that copy is most of the call (on the H100, qwen3-30b-a3b at T=4: 0.19 of 0.34 ms). cuBLAS's
``cublasGemmBatchedEx`` takes arrays of pointers instead of strides, so each batch entry can read its expert's
matrix in place: out[s] = table[ids[s]] @ x[s // rows_per_x], as an [N, 1] product per slot. The pointer arrays are
made on the device from the routing ids (no host sync; a CUDA graph captures them): in eager calls a kept array
rewritten by two small ops, in graphs and compiled code an array of the call's own by one Triton kernel
(``moe_shared.kernels.slot_pointers``). From ``ORDERED_FROM_SLOTS_PER_EXPERT`` slots per expert on, the batch entries
go in expert order (the Triton kernel reads the slots through a stable sort of the ids; each entry still writes its
own slot's row): the entries of one expert then run side by side, so its matrix is read from memory about once, not
once per slot. Each entry's product is the same either way, and so are the bits. The call runs on torch's cuBLAS
handle and current stream. Used where ``applies``: CUDA, float32/bfloat16/float16, each matrix row- or
column-contiguous, every address a multiple of 16 bytes; under torch.compile as the opaque op
``moe_torch::slot_products`` (the compiler cannot trace a ctypes call). float32 runs in TF32 exactly where
``torch.backends.cuda.matmul.allow_tf32`` lets torch's own matmuls do so.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections import OrderedDict
from functools import cache
from pathlib import Path

import torch

DEVICES = ("cuda",)
# slots per expert (S / E) from which a call's batch entries go in expert order (see the module docstring); below, in
# slot order (few slots share an expert there, and the sort costs about 0.011 ms). On the H100, qwen3-30b-a3b (E=128,
# k=8), each projection's products in a CUDA graph, sort included, slot / expert order: gate/up 0.081 / 0.092 ms at
# T=4 (S/E 0.25), 0.140 / 0.149 at T=8 (0.5), 0.268 / 0.228 at T=16, 0.990 / 0.451 at T=64; compiled forward (one
# sort for both projections) 0.110 / 0.112 at T=4, 0.205 / 0.187 at T=8, 0.391 / 0.311 at T=16, 1.484 / 0.662 at T=64
# (tests/device_results/nvidia-h100-batched-slots-expert-order.json). A batch entry per slot's whole output: entries
# of 768 to 48 of its rows were no faster at T = 1 to 64 and up to 18% slower (nvidia-h100-batched-slots.json).
ORDERED_FROM_SLOTS_PER_EXPERT = 0.5
ALIGNMENT = 16  # bytes: every matrix and vector address cuBLAS is given, so its tensor-core paths apply
_CUDA_TYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}  # cudaDataType_t
_COMPUTE_32F, _COMPUTE_32F_PEDANTIC, _COMPUTE_32F_FAST_TF32 = 68, 69, 77  # cublasComputeType_t
_OP_N, _OP_T = 0, 1
_GEMM_DEFAULT = -1
_P, _INT = ctypes.c_void_p, ctypes.c_int
_ONE, _ZERO = ctypes.byref(ctypes.c_float(1.0)), ctypes.byref(ctypes.c_float(0.0))  # alpha, beta (host pointers)
_GEMM_BATCHED_ARGS = [_P, _INT, _INT, _INT, _INT, _INT, _P, _P, _INT, _INT, _P, _INT, _INT, _P, _P, _INT, _INT,
                      _INT, _INT, _INT]


def _loaded_cublas() -> str | None:
    """The path of the libcublas torch has loaded in this process, if any."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if Path(path).name.startswith("libcublas.so"):
            return path
    return None


@cache
def _gemm_batched():
    """cublasGemmBatchedEx of the libcublas torch uses (loaded by torch's first cuBLAS call)."""
    path = _loaded_cublas()
    if path is None:
        torch.cuda.current_blas_handle()
        path = _loaded_cublas()
    if path is None:
        raise RuntimeError("moe_torch.slot_blas: no libcublas is loaded in this process after torch's cuBLAS "
                           "handle was made; the per-slot products need the one torch uses")
    entry = ctypes.CDLL(path).cublasGemmBatchedEx
    entry.restype, entry.argtypes = _INT, _GEMM_BATCHED_ARGS
    return entry


def _blas_handle() -> int:
    """torch's cuBLAS handle of the current device, set to the current stream (and torch's workspace)."""
    return torch.cuda.current_blas_handle()


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    size = t.element_size()
    return t.data_ptr() % ALIGNMENT == 0 and all(s * size % ALIGNMENT == 0 for s in strides)


def _laid_out(x: torch.Tensor, table: torch.Tensor) -> bool:
    """The conditions known from shapes, dtypes and strides alone (also to torch.compile's tracing)."""
    return (x.device.type in DEVICES and x.dtype in _CUDA_TYPE and table.dtype == x.dtype and x.dim() == 2
            and table.dim() == 3 and x.stride(1) == 1 and (table.stride(2) == 1 or table.stride(1) == 1))


def _addresses_aligned(x: torch.Tensor, table: torch.Tensor) -> bool:
    return _aligned(x, x.stride(0)) and _aligned(table, table.stride(0), gemm_arguments(table)[3])


def applies(x: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether ``x`` [S', K] times ``table`` [E, N, K] runs here: CUDA, one of the three float dtypes on both, x's
    rows contiguous, each expert's matrix row- or column-contiguous, every address 16-byte aligned. Under
    torch.compile the addresses are not known yet: the op ``moe_torch::slot_products`` checks them when it runs."""
    if not _laid_out(x, table):
        return False
    return torch.compiler.is_compiling() or _addresses_aligned(x, table)


def _offsets(slots: int, rows_per_x: int, x_row_bytes: int, out_row_bytes: int, device: torch.device) -> torch.Tensor:
    """[3, slots] int64: per batch entry (slot s) the byte offsets that do not depend on the call's routing or
    addresses: none in the expert's matrix, x's row s // rows_per_x, out's row s."""
    slot = torch.arange(slots, device=device, dtype=torch.int64)
    return torch.stack((torch.zeros_like(slot), torch.div(slot, rows_per_x, rounding_mode="floor") * x_row_bytes,
                        slot * out_row_bytes))


class _PointerArray:
    """The pointer array [3, slots] of one signature and stream, with its fixed offsets (``_offsets``) and the x and
    out addresses its rows were last filled for: a later call of the signature rewrites the matrices' row (its
    routing) and only the rows whose address changed. Every write and every cuBLAS call that reads the array is on
    that one stream, in call order, so a rewrite never overtakes an earlier call's read."""

    def __init__(self, offsets: torch.Tensor):
        self.pointers = torch.empty_like(offsets)
        (self.matrix_offsets, self.x_offsets, self.out_offsets) = offsets.unbind()
        self.matrices, self.vectors, self.outputs = self.pointers.unbind()
        self.x_address = self.out_address = None

    def fill(self, table: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # int64 offsets first: the products of int32 ids and the expert size would overflow in int32
        torch.add(self.matrix_offsets, ids, alpha=table.stride(0) * table.element_size(), out=self.matrices)
        self.matrices.add_(table.data_ptr())
        if x.data_ptr() != self.x_address:
            torch.add(self.x_offsets, x.data_ptr(), out=self.vectors)
            self.x_address = x.data_ptr()
        if out.data_ptr() != self.out_address:
            torch.add(self.out_offsets, out.data_ptr(), out=self.outputs)
            self.out_address = out.data_ptr()
        return self.pointers


_KEPT: OrderedDict[tuple, _PointerArray] = OrderedDict()
MAX_KEPT = 64  # pointer arrays kept (per signature and stream; a few KB each at decode)


_OWN_ARRAYS = [0]  # depth of own_arrays() contexts


@contextlib.contextmanager
def own_arrays():
    """Calls inside make their pointer arrays afresh, by one Triton kernel: for a CUDA graph's warm-up call and its
    capture (the warm-up compiles the kernel, the capture records its launch; nothing of the graph is kept here)."""
    _OWN_ARRAYS[0] += 1
    try:
        yield
    finally:
        _OWN_ARRAYS[0] -= 1


@cache
def _pointer_kernel():
    """shared/kernels/slot_pointers' launcher, or None without triton."""
    try:
        from moe_shared.kernels import slot_pointers
    except ImportError:
        return None
    return slot_pointers.launch


def _own_pointers(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, rows_per_x: int, out: torch.Tensor,
                  order: torch.Tensor | None, kernel: bool) -> torch.Tensor:
    """A pointer array of the call's own: one Triton kernel launch where ``kernel`` and triton is there, else a few
    small ops."""
    size = x.element_size()
    expert_bytes, x_row_bytes, out_row_bytes = table.stride(0) * size, x.stride(0) * size, out.stride(0) * size
    launch = _pointer_kernel() if kernel else None
    if launch is not None:
        pointers = torch.empty(3, ids.shape[0], dtype=torch.int64, device=x.device)
        launch(ids, ids.stride(0), order, pointers, rows_per_x, table.data_ptr(), expert_bytes, x.data_ptr(),
               x_row_bytes, out.data_ptr(), out_row_bytes)
        return pointers
    if order is None:
        return _PointerArray(_offsets(ids.shape[0], rows_per_x, x_row_bytes, out_row_bytes, x.device)).fill(
            table, ids, x, out)
    slot = order.to(torch.int64)
    return torch.stack((ids.index_select(0, order).to(torch.int64) * expert_bytes + table.data_ptr(),
                        torch.div(slot, rows_per_x, rounding_mode="floor") * x_row_bytes + x.data_ptr(),
                        slot * out_row_bytes + out.data_ptr()))


def _kept_array(key: tuple) -> _PointerArray:
    """The pointer array of ``key`` (``_offsets``' arguments) kept for this stream, made at its first call."""
    device = key[-1]
    full = key + ((torch.cuda.current_stream(device).cuda_stream,) if device.type == "cuda" else ())
    array = _KEPT.get(full)
    if array is None:
        array = _KEPT[full] = _PointerArray(_offsets(*key))
        if len(_KEPT) > MAX_KEPT:
            _KEPT.popitem(last=False)
    else:
        _KEPT.move_to_end(full)
    return array


def slot_pointers(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, rows_per_x: int, out: torch.Tensor,
                  keep: bool = True, order: torch.Tensor | None = None) -> torch.Tensor:
    """[3, S] int64 on the device: per batch entry b, computing slot s = ``order[b]`` (s = b without ``order``), the
    address in bytes of ``table[ids[s]]``, of ``x[s // rows_per_x]`` and of ``out[s]``. With ``keep``, without
    ``order``, outside ``own_arrays`` and outside a CUDA graph capture, the array is kept for the next call of the
    signature on this stream (which rewrites it: read it before then); a call then costs two small ops where x and
    out have the addresses of the last one. Otherwise the call gets an array of its own from one Triton kernel (from
    a few small ops without triton)."""
    size, device = x.element_size(), x.device
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if keep and order is None and not _OWN_ARRAYS[0] and not capturing:
        key = (ids.shape[0], rows_per_x, x.stride(0) * size, out.stride(0) * size, device)
        return _kept_array(key).fill(table, ids, x, out)
    # an eager call inside a capture of the caller's takes the small ops: the kernel may not be compiled yet
    foreign_capture = keep and capturing and not _OWN_ARRAYS[0]
    return _own_pointers(x, table, ids, rows_per_x, out, order, kernel=not foreign_capture)


def ordered(slots: int, experts: int) -> bool:
    """Whether a call of ``slots`` slots over ``experts`` experts runs its batch entries in expert order (from
    ``ORDERED_FROM_SLOTS_PER_EXPERT`` slots per expert; never for one slot)."""
    return slots > 1 and slots >= ORDERED_FROM_SLOTS_PER_EXPERT * experts


def expert_order(ids: torch.Tensor, experts: int) -> torch.Tensor | None:
    """The slots in expert order (a stable sort of ``ids``: the ``order`` of ``products``) where a call of
    ``ids.shape[0]`` slots over ``experts`` experts runs its batch entries so (``ordered``), else None."""
    if not ordered(ids.shape[0], experts):
        return None
    return torch.sort(ids, stable=True)[1]


def _compute_type(dtype: torch.dtype) -> int:
    if dtype != torch.float32:
        return _COMPUTE_32F
    return _COMPUTE_32F_FAST_TF32 if torch.backends.cuda.matmul.allow_tf32 else _COMPUTE_32F_PEDANTIC


def gemm_arguments(table: torch.Tensor) -> tuple[int, int, int, int]:
    """(transa, m, k, lda) of cuBLAS's column-major ``C = op(A) B`` that makes each slot's [N] = W [N, K] @ x [K]: a
    row-contiguous W is the column-major [K, N] matrix transposed, a column-contiguous one the [N, K] matrix."""
    _, N, K = table.shape
    if table.stride(2) == 1:
        return _OP_T, N, K, max(table.stride(1), K, 1)
    return _OP_N, N, K, max(table.stride(2), N, 1)


def products(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, rows_per_x: int = 1,
             order: torch.Tensor | None = None) -> torch.Tensor:
    """out[s] = table[ids[s]] @ x[s // rows_per_x] for every slot s ([S', K], [E, N, K], [S] -> [S, N], x's dtype),
    each slot's weights read in place by one cuBLAS batched GEMM (see ``applies``), a batch entry per slot, in the
    slot order ``order`` gives where given (``expert_order``; the same bits either way). Under torch.compile through
    the opaque op ``moe_torch::slot_products`` (the compiler cannot trace the cuBLAS call; a CUDA graph captures it);
    in eager mode without the op's dispatch cost (decode is host-bound)."""
    if torch.compiler.is_compiling():
        return _slot_products_op(x, table, ids, rows_per_x, order)
    return _products(x, table, ids, rows_per_x, order, keep=True)


@torch.library.custom_op("moe_torch::slot_products", mutates_args=())
def _slot_products_op(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, rows_per_x: int,
                      order: torch.Tensor | None) -> torch.Tensor:
    """``products`` for compiled graphs. The compiler decides the addresses (and may lay out x otherwise than it
    traced): where they do not suit cuBLAS, the same products from the gathered weights. Its pointer arrays are
    not kept: a graph of torch.compile's CUDA-graph modes must own every tensor made in its pool, also in the
    warm-up runs it makes there without capturing."""
    if _laid_out(x, table) and _addresses_aligned(x, table):
        return _products(x, table, ids, rows_per_x, order, keep=False)
    return gathered_products(x, table, ids, rows_per_x)


@_slot_products_op.register_fake
def _(x, table, ids, rows_per_x, order):
    return x.new_empty(ids.shape[0], table.shape[1])


def gathered_products(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, rows_per_x: int = 1) -> torch.Tensor:
    """``products`` by copying each slot's expert matrix (``table[ids]``) and one torch.bmm: the plain way."""
    x_rows = x if rows_per_x == 1 else x.repeat_interleave(rows_per_x, dim=0)
    return torch.bmm(table[ids], x_rows.unsqueeze(2)).squeeze(2)


def _products(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, rows_per_x: int, order: torch.Tensor | None,
              keep: bool) -> torch.Tensor:
    slots = ids.shape[0]
    out = x.new_empty(slots, table.shape[1])
    if slots == 0 or table.shape[1] == 0:
        return out
    if table.shape[2] == 0:
        return out.zero_()
    pointers = slot_pointers(x, table, ids, rows_per_x, out, keep, order)
    transa, m, k, lda = gemm_arguments(table)
    cuda_type = _CUDA_TYPE[x.dtype]
    matrices = pointers.data_ptr()  # the three rows of pointers: matrices, vectors, outputs
    vectors, outputs = matrices + 8 * slots, matrices + 16 * slots
    with _on(x.device):
        status = _gemm_batched()(_blas_handle(), transa, _OP_N, m, 1, k, _ONE, matrices, cuda_type, lda, vectors,
                                 cuda_type, k, _ZERO, outputs, cuda_type, m, slots, _compute_type(x.dtype),
                                 _GEMM_DEFAULT)
    if status != 0:
        raise RuntimeError(f"moe_torch.slot_blas: cublasGemmBatchedEx returned status {status} (m={m}, k={k}, "
                           f"lda={lda}, batch={slots}, dtype={x.dtype})")
    return out


def _on(device: torch.device):
    """The device's context where it is not the current one already (entering one costs host time at decode)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
