"""moe_torch.slot_blas (batched_mm's per-slot products on CUDA) on the CPU: its pointer arrays and cuBLAS arguments
through a stand-in for cublasGemmBatchedEx that reads and writes the memory those pointers name, column-major, as
cuBLAS does; the conditions under which it applies; and batched_mm running on it. On CUDA the same code calls
cuBLAS (tests/device_check.py, tests/device_batched_slots.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import moe_torch
from moe_torch import slot_blas
from moe_torch.backends import batched_mm
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
        self.calls, self.status = [], status

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


def test_slot_pointers_name_each_slots_matrix_vector_and_output():
    table, x = torch.zeros(4, 8, 16), torch.zeros(3, 16)
    ids = torch.tensor([2, 0, 3, 3, 1, 2])
    out = torch.empty(6, 8)
    pointers = slot_blas.slot_pointers(x, table, ids, 2, out)
    assert pointers.dtype == torch.int64 and pointers.shape == (3, 6)
    assert pointers[0].tolist() == [table[e].data_ptr() for e in ids.tolist()]
    assert pointers[1].tolist() == [x[s // 2].data_ptr() for s in range(6)]
    assert pointers[2].tolist() == [out[s].data_ptr() for s in range(6)]


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


@pytest.mark.parametrize("case", [c for c in CASES if _aligned(c)], ids=case_id)
def test_batched_mm_on_slot_products_passes_the_vectors(fake, case):
    """batched_mm with its per-slot products on the stand-in: forward and gradients within the tolerance table,
    and both projections' forward products made there (one batched call each)."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    tensors = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in case.inputs.items()}
    tensors = {n: t if n == "top_k_index" else t.to(dtypes[case.dtype]).requires_grad_() for n, t in tensors.items()}
    out = moe_torch.experts_forward(**tensors, implementation="batched_mm", activation=case.activation)
    assert_close("out", out.detach().float().numpy(), case.expected["out"], case.dtype)
    assert len(fake.calls) == (2 if case.T else 0)
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
