"""moe_torch.slot_blas (batched_mm's per-slot products on CUDA) on the CPU: its pointer arrays and cuBLAS arguments
through a stand-in for cublasGemmBatchedEx that reads and writes the memory those pointers name, column-major, as
cuBLAS does; the conditions under which it applies; and batched_mm running on it. On CUDA the same code calls
cuBLAS (tests/device_check.py, tests/device_batched_slots.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_torch
from moe_torch import slot_blas
from moe_torch.backends import batched_mm
from moe_shared import relative_l2
from support import CASES, DIFF_ARGS, assert_close, case_id

TYPES = {0: torch.float32, 2: torch.float16, 14: torch.bfloat16}


def _view(address: int, dtype: torch.dtype, shape, strides) -> torch.Tensor:
    """The memory at ``address`` as a tensor of ``shape`` and ``strides`` (elements), not copied."""
    count = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return torch.frombuffer(raw, dtype=dtype).as_strided(shape, strides)


class FakeGemmBatched:
    """cublasGemmBatchedEx on the host: C_b = alpha op(A_b) op(B_b) + beta C_b, each matrix column-major at the
    address its pointer array holds; records each call's arguments."""

    def __init__(self, status: int = 0):
        self.calls, self.pointers, self.status = [], [], status

    def __call__(self, handle, transa, transb, m, n, k, alpha, a_array, a_type, lda, b_array, b_type, ldb, beta,
                 c_array, c_type, ldc, batch, compute, algo):
        self.calls.append(dict(transa=transa, transb=transb, m=m, n=n, k=k, lda=lda, ldb=ldb, ldc=ldc, batch=batch,
                               compute=compute))
        if self.status:
            return self.status
        dtype = TYPES[a_type]
        assert TYPES[b_type] == TYPES[c_type] == dtype
        alpha_value = ctypes.cast(alpha, ctypes.POINTER(ctypes.c_float)).contents.value
        beta_value = ctypes.cast(beta, ctypes.POINTER(ctypes.c_float)).contents.value
        pointers = [(ctypes.c_int64 * batch).from_address(array) for array in (a_array, b_array, c_array)]
        self.pointers.append([list(row) for row in pointers])
        for b in range(batch):
            # column-major: element (i, j) at i + j * ld
            a = _view(pointers[0][b], dtype, (k, m) if transa else (m, k), (1, lda)).double()
            x = _view(pointers[1][b], dtype, (n, k) if transb else (k, n), (1, ldb)).double()
            c = _view(pointers[2][b], dtype, (m, n), (1, ldc))
            product = (a.T if transa else a) @ (x.T if transb else x)
            c.copy_(alpha_value * product + (beta_value * c.double() if beta_value else 0))
        return 0


@pytest.fixture
def fake(monkeypatch):
    """slot_blas on the CPU with the stand-in for cuBLAS; batched_mm reaching it (not its CPU in-place way)."""
    gemm = FakeGemmBatched()
    monkeypatch.setattr(slot_blas, "DEVICES", ("cpu",))
    monkeypatch.setattr(slot_blas, "_gemm_batched", lambda: gemm)
    monkeypatch.setattr(slot_blas, "_blas_handle", lambda: 0)
    monkeypatch.setattr(batched_mm, "IN_PLACE_DEVICES", ())
    return gemm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("rows_per_x", [1, 3])
def test_products_read_each_slots_expert_in_place(fake, dtype, layout, rows_per_x):
    g = torch.Generator().manual_seed(0)
    E, N, K, S = 5, 24, 40, 12
    table = torch.randn(E, N, K, generator=g).to(dtype)
    if layout == "columns":  # each expert's matrix stored transposed, as the weights' gradient views see it
        table = torch.randn(E, K, N, generator=g).to(dtype).transpose(1, 2)
    x = torch.randn(S // rows_per_x, K, generator=g).to(dtype)
    ids = torch.randint(0, E, (S,), generator=g)
    assert slot_blas.applies(x, table)
    out = slot_blas.products(x, table, ids, rows_per_x)
    expected = torch.stack([table[e].double() @ x[s // rows_per_x].double() for s, e in enumerate(ids.tolist())])
    assert out.dtype == dtype and out.shape == (S, N)
    assert_close("out", out.double().numpy(), expected.numpy(), {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                                                 torch.float16: "float16"}[dtype])
    (call,) = fake.calls
    assert call["batch"] == S and call["n"] == 1 and (call["m"], call["k"]) == (N, K)
    assert call["transa"] == (1 if layout == "rows" else 0)


@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_products_in_expert_order_are_the_same_bits(fake, layout):
    """Batch entries in expert order: each entry still reads its slot's expert and x row and writes its slot's
    row, so the output is bit for bit the slot-ordered one; the call's matrix pointers go in expert order."""
    g = torch.Generator().manual_seed(1)
    table = torch.randn(5, 24, 40, generator=g).bfloat16()
    if layout == "columns":
        table = torch.randn(5, 40, 24, generator=g).bfloat16().transpose(1, 2)
    x, ids = torch.randn(3, 40, generator=g).bfloat16(), torch.tensor([4, 0, 0, 2, 1, 4])
    plain = slot_blas.products(x, table, ids, 2)
    order = torch.sort(ids, stable=True)[1]
    ordered = slot_blas.products(x, table, ids, 2, order=order)
    assert torch.equal(ordered, plain)
    assert [call["batch"] for call in fake.calls] == [6, 6]
    matrices = fake.pointers[-1][0]
    assert matrices == [table[e].data_ptr() for e in sorted(ids.tolist())]


def test_expert_order_from_the_threshold(monkeypatch):
    monkeypatch.setattr(slot_blas, "ORDERED_FROM_SLOTS_PER_EXPERT", 0.5)
    assert slot_blas.expert_order(torch.tensor([3, 1, 2]), 8) is None  # 3 slots over 8 experts
    ids = torch.tensor([3, 1, 3, 0, 1])
    assert slot_blas.expert_order(ids, 10).tolist() == [3, 1, 4, 0, 2]  # stable: equal experts keep slot order
    assert slot_blas.expert_order(torch.tensor([0]), 1) is None  # one slot: nothing to order


def test_slot_pointers_take_strided_routing_ids():
    table, x, out = torch.zeros(4, 8, 16), torch.zeros(3, 16), torch.empty(3, 8)
    ids = torch.tensor([[2, 9], [0, 9], [3, 9]])[:, 0]  # a column: not contiguous
    assert slot_blas.slot_pointers(x, table, ids, 1, out)[0].tolist() == [table[e].data_ptr() for e in (2, 0, 3)]


def test_slot_pointers_name_each_slots_matrix_vector_and_output():
    table, x = torch.zeros(4, 8, 16), torch.zeros(3, 16)
    ids = torch.tensor([2, 0, 3, 3, 1, 2])
    out = torch.empty(6, 8)
    pointers = slot_blas.slot_pointers(x, table, ids, 2, out)
    assert pointers.dtype == torch.int64 and pointers.shape == (3, 6)
    assert pointers[0].tolist() == [table[e].data_ptr() for e in ids.tolist()]
    assert pointers[1].tolist() == [x[s // 2].data_ptr() for s in range(6)]
    assert pointers[2].tolist() == [out[s].data_ptr() for s in range(6)]
    order = torch.tensor([1, 4, 0, 5, 2, 3])  # entry b computes slot order[b]
    ordered = slot_blas.slot_pointers(x, table, ids, 2, out, order=order)
    assert ordered[0].tolist() == [table[ids[s]].data_ptr() for s in order.tolist()]
    assert ordered[1].tolist() == [x[s // 2].data_ptr() for s in order.tolist()]
    assert ordered[2].tolist() == [out[s].data_ptr() for s in order.tolist()]
    again = torch.empty(6, 8)  # the kept array, rewritten for the new call's addresses
    assert slot_blas.slot_pointers(x, table, ids, 2, again)[2].tolist() == [again[s].data_ptr() for s in range(6)]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_kept_pointer_array_rewrites_only_what_changed():
    """The next call of a signature rewrites the kept array: the matrices' row always (two ops), x's and out's rows
    only where their addresses changed; every row right after each call. Not kept: a fresh array each call."""
    slot_blas._KEPT.clear()
    g = torch.Generator().manual_seed(5)
    tables = [torch.randn(4, 8, 16, generator=g) for _ in range(2)]
    xs, outs = [torch.zeros(3, 16) for _ in range(2)], [torch.empty(6, 8) for _ in range(2)]
    for step, (table, x, out) in enumerate([(tables[0], xs[0], outs[0]), (tables[1], xs[0], outs[0]),
                                            (tables[0], xs[1], outs[0]), (tables[1], xs[0], outs[1])]):
        ids = torch.randint(0, 4, (6,), generator=g)
        with _Ops() as ops:
            pointers = slot_blas.slot_pointers(x, table, ids, 2, out)
        assert pointers[0].tolist() == [table[e].data_ptr() for e in ids.tolist()]
        assert pointers[1].tolist() == [x[s // 2].data_ptr() for s in range(6)]
        assert pointers[2].tolist() == [out[s].data_ptr() for s in range(6)]
        kernels = [name for name in ops.names if not name.startswith(("view", "unbind", "select"))]
        if step:  # the first call makes the array and its offsets
            assert len(kernels) == {1: 2, 2: 3, 3: 4}[step], (step, ops.names)
    assert len(slot_blas._KEPT) == 1
    fresh = slot_blas.slot_pointers(xs[0], tables[0], ids, 2, outs[0], keep=False)
    assert fresh.data_ptr() != pointers.data_ptr() and len(slot_blas._KEPT) == 1


def test_applies_only_where_cublas_takes_the_pointers(monkeypatch):
    table, x = torch.zeros(4, 8, 16, dtype=torch.bfloat16), torch.zeros(3, 16, dtype=torch.bfloat16)
    assert not slot_blas.applies(x, table)  # the CPU is not one of DEVICES
    monkeypatch.setattr(slot_blas, "DEVICES", ("cpu",))
    assert slot_blas.applies(x, table)
    assert slot_blas.applies(x, table.transpose(1, 2).contiguous().transpose(1, 2))
    assert not slot_blas.applies(x.float(), table)  # dtypes differ
    assert not slot_blas.applies(x.to(torch.float64), table.to(torch.float64))  # no cuBLAS type here
    assert not slot_blas.applies(torch.zeros(3, 32, dtype=torch.bfloat16)[:, ::2], table)  # x's rows strided
    assert not slot_blas.applies(torch.zeros(3, 18, dtype=torch.bfloat16)[:, :16], table)  # rows 36 bytes apart
    assert not slot_blas.applies(x, torch.zeros(4, 8, 18, dtype=torch.bfloat16)[..., :16])  # lda 36 bytes
    assert not slot_blas.applies(x, torch.zeros(4, 16, 8, 2, dtype=torch.bfloat16)[..., 0].transpose(1, 2))
    assert not slot_blas.applies(torch.zeros(49, dtype=torch.bfloat16)[1:].view(3, 16), table)  # 2 bytes off 16


def test_products_raise_the_cublas_status(fake):
    fake.status = 7
    table, x = torch.zeros(4, 8, 16), torch.zeros(3, 16)
    with pytest.raises(RuntimeError, match="status 7"):
        slot_blas.products(x, table, torch.tensor([0, 1, 2]))


def test_products_of_no_slots_call_nothing(fake):
    out = slot_blas.products(torch.zeros(0, 16), torch.zeros(4, 8, 16), torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, 8) and fake.calls == []


def test_float32_runs_tf32_where_torch_allows_it(fake):
    table, x, ids = torch.randn(4, 8, 16), torch.randn(3, 16), torch.tensor([0, 1, 2])
    matmul, before = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    try:
        for allowed, compute in ((False, slot_blas._COMPUTE_32F_PEDANTIC), (True, slot_blas._COMPUTE_32F_FAST_TF32)):
            matmul.allow_tf32 = allowed
            slot_blas.products(x, table, ids)
            assert fake.calls[-1]["compute"] == compute
    finally:
        matmul.allow_tf32 = before
    slot_blas.products(x.bfloat16(), table.bfloat16(), ids)
    assert fake.calls[-1]["compute"] == slot_blas._COMPUTE_32F


def _aligned(case) -> bool:
    return case.H % 8 == 0 and case.I % 8 == 0


@pytest.mark.parametrize("ordered_from", [0, 10**9], ids=["expert-order", "slot-order"])
@pytest.mark.parametrize("case", [c for c in CASES if _aligned(c)], ids=case_id)
def test_batched_mm_on_slot_products_passes_the_vectors(fake, monkeypatch, case, ordered_from):
    """batched_mm with its per-slot products on the stand-in: forward and gradients within the tolerance table,
    both projections' forward products made there (one batched call each), their batch entries in expert order
    where slot_blas.ordered says so (training and inference)."""
    monkeypatch.setattr(slot_blas, "ORDERED_FROM_SLOTS_PER_EXPERT", ordered_from)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    tensors = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in case.inputs.items()}
    tensors = {n: t if n == "top_k_index" else t.to(dtypes[case.dtype]).requires_grad_() for n, t in tensors.items()}
    out = moe_torch.experts_forward(**tensors, implementation="batched_mm", activation=case.activation)
    assert_close("out", out.detach().float().numpy(), case.expected["out"], case.dtype)
    assert len(fake.calls) == (2 if case.T else 0)
    E = tensors["down_proj"].shape[0]
    ids = tensors["top_k_index"].reshape(-1).clamp(0, E - 1).tolist()
    entry_experts = sorted(ids) if ordered_from == 0 and len(ids) > 1 else ids
    for (matrices, _, _), table in zip(fake.pointers, (tensors["gate_up_proj"], tensors["down_proj"])):
        assert _experts_of(matrices, table) == entry_experts
    out.backward(torch.from_numpy(case.grad_output).to(dtypes[case.dtype]))
    after_backward = len(fake.calls)
    for name in DIFF_ARGS:
        if name in tensors:
            grad = tensors[name].grad
            grad = torch.zeros_like(tensors[name]) if grad is None else grad
            assert_close(name, grad.float().numpy(), case.expected[f"grad_{name}"], case.dtype)
    with torch.no_grad():
        again = moe_torch.experts_forward(**tensors, implementation="batched_mm", activation=case.activation)
    assert torch.equal(again, out.detach())
    assert len(fake.calls) == after_backward + (2 if case.T else 0)
    inference = fake.pointers[after_backward:]
    for (matrices, _, _), table in zip(inference, (tensors["gate_up_proj"], tensors["down_proj"])):
        assert _experts_of(matrices, table) == entry_experts


def _experts_of(matrices: list[int], table: torch.Tensor) -> list[int]:
    """The expert of each matrix address of a pointer array over ``table``."""
    return [(address - table.data_ptr()) // (table.stride(0) * table.element_size()) for address in matrices]


def _compiled_batched_mm(bmm_shapes: list | None = None):
    """batched_mm compiled (fullgraph, inductor) after a dynamo reset, and the list its traced graphs go to; the
    shapes of each torch.bmm's operands go to ``bmm_shapes``."""
    traced = []

    def backend(gm, example_inputs):
        traced.append(str(gm.graph))
        if bmm_shapes is not None:
            bmm_shapes.extend(tuple(tuple(a.meta["example_value"].shape) for a in node.args[:2])
                              for node in gm.graph.nodes if node.target is torch.bmm)
        return torch._inductor.compile(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(lambda **kw: moe_torch.experts_forward(**kw, implementation="batched_mm"), fullgraph=True,
                         backend=backend), traced


def test_compiled_batched_mm_runs_the_slot_products_op(fake, monkeypatch):
    """Under torch.compile (fullgraph) both projections' products are the opaque op moe_torch::slot_products, which
    reaches cuBLAS (here the stand-in) when the compiled graph runs: forward and gradients within the tolerance
    table, and the op in the traced graph."""
    from moe_shared import reference
    from moe_torch.backends import grouped_mm as grouped_mm_backend
    from support import random_case

    monkeypatch.setattr(batched_mm, "SORTED_INPUT_GRAD", ("cpu",))
    monkeypatch.setattr(grouped_mm_backend, "K_GROUPED_DEVICES", ("cpu",))
    arrays, dy = random_case(23, T=6, H=32, I=16, E=5, k=2, bias=False)
    tensors = {n: torch.from_numpy(a) if n == "top_k_index" else torch.from_numpy(a).bfloat16().requires_grad_()
               for n, a in arrays.items()}
    fn, _ = _compiled_batched_mm()
    out = fn(**tensors)
    forward_calls = len(fake.calls)
    assert forward_calls == 2 and all(call["batch"] == 12 for call in fake.calls)
    assert_close("out", out.detach().float().numpy(), reference.experts_forward(**arrays), "bfloat16")
    out.backward(torch.from_numpy(dy).bfloat16())
    expected = reference.experts_backward(**arrays, grad_output=dy)
    for name in expected:
        assert_close(f"grad_{name}", tensors[name].grad.float(), expected[name], "bfloat16")
    with torch.no_grad():
        gm_backend, traced = _compiled_batched_mm()
        inference = gm_backend(**{n: t.detach() if n != "top_k_index" else t for n, t in tensors.items()})
    assert traced and traced[0].count("moe_torch.slot_products") == 2
    assert_close("out", inference.float().numpy(), reference.experts_forward(**arrays), "bfloat16")


@pytest.mark.parametrize("fused_up_to, ops", [(12, 0), (11, 2)])
def test_compiled_batched_mm_leaves_a_few_slots_to_the_compiler(fake, monkeypatch, fused_up_to, ops):
    """Under torch.compile, at most COMPILED_FUSED_SLOTS slots (here 12: T=6, k=2) take the gathered weights' batched
    matmul, which inductor fuses with the gather, instead of the slot_products op; one slot more and both projections
    are the op again. Either way within the tolerance table of the reference, and so is training (compiled the
    same way, its backward the sorted grouped matmuls of either)."""
    from moe_shared import reference
    from moe_torch.backends import grouped_mm as grouped_mm_backend
    from support import random_case

    monkeypatch.setattr(batched_mm, "COMPILED_FUSED_SLOTS", {"cpu": fused_up_to})
    monkeypatch.setattr(batched_mm, "SORTED_INPUT_GRAD", ("cpu",))
    monkeypatch.setattr(grouped_mm_backend, "K_GROUPED_DEVICES", ("cpu",))
    arrays, dy = random_case(23, T=6, H=32, I=16, E=5, k=2, bias=False)
    tensors = {n: torch.from_numpy(a) if n == "top_k_index" else torch.from_numpy(a).bfloat16()
               for n, a in arrays.items()}
    bmm_shapes = []
    fn, traced = _compiled_batched_mm(bmm_shapes)
    with torch.no_grad():
        out = fn(**tensors)
    assert traced[0].count("moe_torch.slot_products") == ops and len(fake.calls) == ops
    if not ops:  # one GEMV per slot on its expert's weights, both projections (transformers' form)
        assert bmm_shapes == [((12, 32, 32), (12, 32, 1)), ((12, 32, 16), (12, 16, 1))]
    assert_close("out", out.float().numpy(), reference.experts_forward(**arrays), "bfloat16")
    leaves = {n: t if n == "top_k_index" else t.clone().requires_grad_() for n, t in tensors.items()}
    train, _ = _compiled_batched_mm()
    train(**leaves).backward(torch.from_numpy(dy).bfloat16())
    for name, want in reference.experts_backward(**arrays, grad_output=dy).items():
        assert_close(f"grad_{name}", leaves[name].grad.float(), want, "bfloat16")


def test_compiled_batched_mm_takes_the_slots_in_expert_order(monkeypatch):
    """Compiled on the CPU, from one slot per expert (here 32 slots over 8 experts) both projections' GEMVs take the
    slots in expert order and write their rows back to slot order (an index_put each in the traced graph; none where
    the setting leaves the device out). Each slot's product is the same, so the inference forward gives the same
    bits either way; training's forward and gradients (whose graphs inductor fuses differently around the row
    writes, rounding intermediates at other places) within the tolerance table of the reference."""
    from moe_shared import reference
    from support import random_case

    arrays, dy = random_case(29, T=8, H=32, I=16, E=8, k=4, bias=False)
    leaves = {n: torch.from_numpy(a) if n == "top_k_index" else torch.from_numpy(a).bfloat16().requires_grad_()
              for n, a in arrays.items()}
    results = {}
    for setting, row_writes in (({"cpu": 1}, 2), ({}, 0)):
        monkeypatch.setattr(batched_mm, "COMPILED_ORDERED_FROM_SLOTS_PER_EXPERT", setting)
        for t in leaves.values():
            t.grad = None
        with torch.no_grad():
            fn, traced = _compiled_batched_mm()
            out = fn(**{n: t.detach() if t.requires_grad else t for n, t in leaves.items()})
        assert traced[0].count("aten.index_put") + traced[0].count("index_put_") == row_writes
        train, _ = _compiled_batched_mm()
        train(**leaves).backward(torch.from_numpy(dy).bfloat16())
        results[row_writes] = out, {n: t.grad.clone() for n, t in leaves.items() if t.requires_grad}
    (out, _), (other_out, _) = results.values()
    assert torch.equal(out, other_out)
    want_out = reference.experts_forward(**arrays)
    want_grads = reference.experts_backward(**arrays, grad_output=dy)
    for out, grads in results.values():
        assert_close("out", out.float().numpy(), want_out, "bfloat16")
        for name, want in want_grads.items():
            assert_close(f"grad_{name}", grads[name].float(), want, "bfloat16")


def test_slot_products_op_gathers_where_addresses_do_not_suit_cublas(fake):
    """The op the compiled graph calls checks the addresses it is given: x two bytes off 16 takes the gathered
    products (the same values, no cuBLAS call); aligned, cuBLAS, on a pointer array it does not keep."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(4, 8, 16, generator=g).bfloat16()
    x = torch.randn(49, generator=g).bfloat16()[1:].view(3, 16)
    ids = torch.tensor([2, 0, 3, 3, 1, 0])
    want = torch.stack([table[e].double() @ x[s // 2].double() for s, e in enumerate(ids.tolist())])
    slot_blas._KEPT.clear()
    unaligned = torch.ops.moe_torch.slot_products(x, table, ids, 2, None)
    assert fake.calls == []
    aligned = torch.ops.moe_torch.slot_products(x.clone(), table, ids, 2, None)
    assert len(fake.calls) == 1 and not slot_blas._KEPT  # a compiled graph owns its pointer arrays
    for out in (unaligned, aligned):
        assert relative_l2(out.double().numpy(), want.numpy()) < 1e-2


@pytest.mark.parametrize("kernel", ["triton", "without triton"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_own_pointer_arrays_name_the_same_addresses(monkeypatch, kernel, index_dtype):
    """Inside own_arrays() (a decode graph's warm-up and capture) and for the compiled op, a call gets an array of its
    own, by one Triton kernel (here under the interpreter) or, without triton, by the small ops: the same addresses
    as the kept array, for several slots per row of x and strided routing ids; in expert order, the same addresses
    taken in that order."""
    if kernel == "without triton":
        monkeypatch.setattr(slot_blas, "_pointer_kernel", lambda: None)
    table, x, out = torch.zeros(5, 8, 16), torch.zeros(6, 16), torch.empty(6, 8)
    ids = torch.tensor([[2, 9], [0, 9], [4, 9], [4, 9], [1, 9], [3, 9]], dtype=index_dtype)[:, 0]
    order = torch.sort(ids, stable=True)[1].to(index_dtype)
    for rows_per_x in (1, 2, 3):
        kept = slot_blas.slot_pointers(x, table, ids, rows_per_x, out).clone()
        with slot_blas.own_arrays():
            own = slot_blas.slot_pointers(x, table, ids, rows_per_x, out)
        fresh = slot_blas.slot_pointers(x, table, ids, rows_per_x, out, keep=False)
        ordered = slot_blas.slot_pointers(x, table, ids, rows_per_x, out, order=order)
        assert kept[0].tolist() == [table[e].data_ptr() for e in ids.tolist()]
        assert kept[1].tolist() == [x[s // rows_per_x].data_ptr() for s in range(6)]
        assert torch.equal(own, kept) and torch.equal(fresh, kept)
        assert torch.equal(ordered, kept[:, order.long()])
        assert own.data_ptr() != fresh.data_ptr() and not any(
            array.pointers.data_ptr() in (own.data_ptr(), fresh.data_ptr()) for array in slot_blas._KEPT.values())


@pytest.mark.parametrize("ordered_from", [0, 10**9], ids=["expert-order", "slot-order"])
def test_a_training_step_sorts_the_slots_once(fake, monkeypatch, ordered_from):
    """batched_mm's training step sorts the slots by expert once: in the forward where its batch entries go in
    expert order (the backward takes that order), else in the backward."""
    from moe_torch.backends import grouped_mm as grouped_mm_backend
    from support import random_case

    monkeypatch.setattr(slot_blas, "ORDERED_FROM_SLOTS_PER_EXPERT", ordered_from)
    monkeypatch.setattr(batched_mm, "SORTED_INPUT_GRAD", ("cpu",))
    monkeypatch.setattr(grouped_mm_backend, "K_GROUPED_DEVICES", ("cpu",))
    arrays, dy = random_case(29, T=6, H=32, I=16, E=5, k=2, bias=False)
    tensors = {n: torch.from_numpy(a) if n == "top_k_index" else torch.from_numpy(a).bfloat16().requires_grad_()
               for n, a in arrays.items()}
    with _Ops() as ops:
        out = moe_torch.experts_forward(**tensors, implementation="batched_mm")
        forward_sorts = sum(name.startswith("sort") for name in ops.names)
        out.backward(torch.from_numpy(dy).bfloat16())
    step_sorts = sum(name.startswith("sort") for name in ops.names)
    assert (forward_sorts, step_sorts) == ((1, 1) if ordered_from == 0 else (0, 1))
