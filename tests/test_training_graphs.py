"""Training graphs (moe_torch.graphs, MOE_TORCH_TRAINING_GRAPHS) on the CPU: batched_mm's training step through
_GraphedTrainingStep, with test_graphs' stand-in for a CUDA graph (a replay runs the captured call again into the
same output tensors) and test_slot_blas' stand-in for cuBLAS, so the step takes its CUDA way. Against the plain
training step: the same bits forward and backward, captures and replays counted, steps that interleave. On CUDA the
same code captures real graphs (tests/device_graphs_check.py)."""

from __future__ import annotations

import pytest
import torch

import moe_torch
from moe_torch import graphs, slot_blas
from moe_torch.backends import batched_mm
from moe_torch.backends import grouped_mm as grouped_mm_backend
from support import random_case
from test_graphs import fake_cuda  # noqa: F401  (a fixture)
from test_slot_blas import FakeGemmBatched

NAMES = ("hidden_states", "top_k_weights", "gate_up_proj", "down_proj")


@pytest.fixture
def cuda_way(monkeypatch, fake_cuda):  # noqa: F811
    """batched_mm's training step on its CUDA way here: slot_blas on the cuBLAS stand-in, the sorted input
    gradient and the K-grouped weight gradient; training graphs on for the CPU."""
    monkeypatch.setattr(slot_blas, "DEVICES", ("cpu",))
    gemm = FakeGemmBatched()
    monkeypatch.setattr(slot_blas, "_gemm_batched", lambda: gemm)
    monkeypatch.setattr(slot_blas, "_blas_handle", lambda: 0)
    monkeypatch.setattr(batched_mm, "IN_PLACE_DEVICES", ())
    monkeypatch.setattr(batched_mm, "SORTED_INPUT_GRAD", ("cpu",))
    monkeypatch.setattr(grouped_mm_backend, "K_GROUPED_DEVICES", ("cpu",))
    monkeypatch.setattr(graphs, "TRAINING_DEVICES", ("cpu",))
    monkeypatch.setenv(graphs.TRAINING_VARIABLE, "auto")
    return fake_cuda


def _tensors(seed: int, T: int = 5, empty_fraction: float = 0.2, requires=NAMES):
    arrays, dy = random_case(seed, T=T, H=32, I=16, E=6, k=2, bias=False, empty_fraction=empty_fraction)
    tensors = {n: torch.from_numpy(a) if n == "top_k_index" else torch.from_numpy(a).bfloat16()
               for n, a in arrays.items()}
    for name in requires:
        tensors[name].requires_grad_()
    return tensors, torch.from_numpy(dy).bfloat16()


def _step(tensors, dy):
    out = moe_torch.experts_forward(**tensors, implementation="batched_mm")
    leaves = [tensors[n] for n in NAMES if tensors[n].requires_grad]
    return out, torch.autograd.grad(out, leaves, dy)


def _plain(tensors, dy, monkeypatch):
    with monkeypatch.context() as plain:
        plain.setenv(graphs.TRAINING_VARIABLE, "off")
        return _step({n: t.detach().requires_grad_(t.requires_grad) for n, t in tensors.items()}, dy)


@pytest.mark.parametrize("ordered_from", [0, 10**9, None], ids=["expert-order", "slot-order", "gathered"])
def test_graphed_step_gives_the_plain_steps_bits(cuda_way, monkeypatch, ordered_from):
    """Two graphs at the first step (forward, backward), none later, each replayed at every step; every step's
    output and gradients are the plain training step's bits, also with empty slots and for new inputs of the same
    shapes; on the slot products in either order, and on gathered weights (where cuBLAS's way does not apply)."""
    if ordered_from is None:
        monkeypatch.setattr(slot_blas, "DEVICES", ())
    else:
        monkeypatch.setattr(slot_blas, "ORDERED_FROM_SLOTS_PER_EXPERT", ordered_from)
    weights = {n: t for n, t in _tensors(2)[0].items() if n in ("gate_up_proj", "down_proj")}
    for seed in (3, 4, 5):  # new per-call inputs, the same weights: one signature
        tensors, dy = _tensors(seed)
        tensors.update(weights)
        out, grads = _step(tensors, dy)
        want_out, want_grads = _plain(tensors, dy, monkeypatch)
        assert torch.equal(out, want_out)
        for got, want in zip(grads, want_grads, strict=True):
            assert torch.equal(got, want)
    assert len(cuda_way) == 2 and [c.replays for c in cuda_way] == [3, 3]  # a replay per step


def test_interleaved_steps_keep_their_own_values(cuda_way, monkeypatch):
    """Two forwards before their backwards (as with micro-batches or a recomputed layer): the backward makes the
    forward's values again from its own inputs, so each step's gradients are its own."""
    first, dy1 = _tensors(7)
    second, dy2 = _tensors(8)
    second.update({n: first[n] for n in ("gate_up_proj", "down_proj")})  # one signature: the same graphs
    out1 = moe_torch.experts_forward(**first, implementation="batched_mm")
    out2 = moe_torch.experts_forward(**second, implementation="batched_mm")
    grads2 = torch.autograd.grad(out2, [second[n] for n in NAMES], dy2)
    grads1 = torch.autograd.grad(out1, [first[n] for n in NAMES], dy1)
    assert len(cuda_way) == 2
    for tensors, dy, out, grads in ((first, dy1, out1, grads1), (second, dy2, out2, grads2)):
        want_out, want_grads = _plain(tensors, dy, monkeypatch)
        assert torch.equal(out, want_out)
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))


def test_each_set_of_needed_gradients_has_its_backward_graph(cuda_way, monkeypatch):
    tensors, dy = _tensors(9, requires=("hidden_states",))
    out, (grad_x,) = _step(tensors, dy)
    _, (want,) = _plain(tensors, dy, monkeypatch)
    assert torch.equal(grad_x, want)
    tensors, dy = _tensors(9, requires=("gate_up_proj", "down_proj"))
    _, grads = _step(tensors, dy)
    _, want_grads = _plain(tensors, dy, monkeypatch)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
    assert len(cuda_way) == 4  # a forward and a backward graph for each


def test_the_weight_gradients_are_fresh_tensors(cuda_way):
    """The weight gradients are made outside the graphs: each step's are new tensors (autograd keeps them without
    a copy), while the graphs' own outputs stay where they are."""
    tensors, dy = _tensors(10)
    grads = [_step(tensors, dy)[1] for _ in range(2)]
    for before, after in zip(*grads):
        assert before.data_ptr() != after.data_ptr()


def test_off_by_default_and_where_a_bias_or_a_gate_callable_is_given(cuda_way, monkeypatch):
    tensors, dy = _tensors(11)
    monkeypatch.delenv(graphs.TRAINING_VARIABLE)
    _step(tensors, dy)
    assert cuda_way == []
    monkeypatch.setenv(graphs.TRAINING_VARIABLE, "auto")
    with torch.no_grad():  # inference: the decode graph, not a training one
        moe_torch.experts_forward(**tensors, implementation="batched_mm")
    assert len(cuda_way) == 1
    gate = lambda h: torch.nn.functional.silu(h[:, :16]) * h[:, 16:]  # noqa: E731
    out = moe_torch.experts_forward(**tensors, implementation="batched_mm", activation=gate)
    torch.autograd.grad(out, [tensors[n] for n in NAMES], dy)
    assert len(cuda_way) == 1
    monkeypatch.setenv(graphs.TRAINING_VARIABLE, "sometimes")
    with pytest.raises(ValueError, match="MOE_TORCH_TRAINING_GRAPHS"):
        _step(tensors, dy)


def test_a_second_derivative_raises(cuda_way):
    """The graphs' replays are not differentiated: asking for a second derivative through them is an error."""
    tensors, dy = _tensors(12)
    out = moe_torch.experts_forward(**tensors, implementation="batched_mm")
    (grad_x,) = torch.autograd.grad(out, [tensors["hidden_states"]], dy, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad_x.float().sum().backward()
