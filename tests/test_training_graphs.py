"""Training graphs (moe_torch.graphs, MOE_TORCH_TRAINING_GRAPHS) on the CPU: batched_mm's and grouped_mm's training
steps through training_step._GraphedTrainingStep, with test_graphs' stand-in for a CUDA graph (a replay runs the
captured call again into the same output tensors) and test_slot_blas' stand-in for cuBLAS, so each step takes its CUDA
way. Against the plain training step: the same bits forward and backward, captures and replays counted, steps that
interleave, checkpointing, the spec's bound. On CUDA the same code captures real graphs
(tests/device_training_graphs.py, tests/device_training_loop.py)."""

from __future__ import annotations

import dataclasses
import warnings

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
    """The training steps on their CUDA way here: batched_mm's slot_blas on the cuBLAS stand-in, its sorted input
    gradient, the K-grouped weight gradients, grouped_mm's one-node step; training graphs on for the CPU."""
    monkeypatch.setattr(slot_blas, "DEVICES", ("cpu",))
    gemm = FakeGemmBatched()
    monkeypatch.setattr(slot_blas, "_gemm_batched", lambda: gemm)
    monkeypatch.setattr(slot_blas, "_blas_handle", lambda: 0)
    monkeypatch.setattr(batched_mm, "IN_PLACE_DEVICES", ())
    monkeypatch.setattr(batched_mm, "SORTED_INPUT_GRAD", ("cpu",))
    monkeypatch.setattr(grouped_mm_backend, "K_GROUPED_DEVICES", ("cpu",))
    monkeypatch.setattr(grouped_mm_backend, "TRAINING_STEP_DEVICES", ("cpu",))
    monkeypatch.setattr(graphs, "TRAINING_DEVICES", ("cpu",))
    monkeypatch.delenv(graphs.TRAINING_VARIABLE, raising=False)
    return fake_cuda


def _tensors(seed: int, T: int = 5, empty_fraction: float = 0.2, requires=NAMES):
    arrays, dy = random_case(seed, T=T, H=32, I=16, E=6, k=2, bias=False, empty_fraction=empty_fraction)
    tensors = {n: torch.from_numpy(a) if n == "top_k_index" else torch.from_numpy(a).bfloat16()
               for n, a in arrays.items()}
    for name in requires:
        tensors[name].requires_grad_()
    return tensors, torch.from_numpy(dy).bfloat16()


def _step(tensors, dy, backend="batched_mm"):
    out = moe_torch.experts_forward(**tensors, implementation=backend)
    leaves = [tensors[n] for n in NAMES if tensors[n].requires_grad]
    return out, torch.autograd.grad(out, leaves, dy)


def _plain(tensors, dy, monkeypatch, backend="batched_mm"):
    with monkeypatch.context() as plain:
        plain.setenv(graphs.TRAINING_VARIABLE, "off")
        return _step({n: t.detach().requires_grad_(t.requires_grad) for n, t in tensors.items()}, dy, backend)


BACKENDS = ("batched_mm", "grouped_mm")


@pytest.mark.parametrize("backend, ordered_from", [("batched_mm", 0), ("batched_mm", 10**9), ("batched_mm", None),
                                                   ("grouped_mm", None)],
                         ids=["batched_mm-expert-order", "batched_mm-slot-order", "batched_mm-gathered",
                              "grouped_mm"])
def test_graphed_step_gives_the_plain_steps_bits(cuda_way, monkeypatch, backend, ordered_from):
    """Two graphs at the first step (forward, backward), none later, each replayed at every step; every step's
    output and gradients are the plain training step's bits, also with empty slots and for new inputs of the same
    shapes; batched_mm's on the slot products in either order, and on gathered weights (where cuBLAS's way does not
    apply)."""
    if ordered_from is None:
        monkeypatch.setattr(slot_blas, "DEVICES", ())
    else:
        monkeypatch.setattr(slot_blas, "ORDERED_FROM_SLOTS_PER_EXPERT", ordered_from)
    weights = {n: t for n, t in _tensors(2)[0].items() if n in ("gate_up_proj", "down_proj")}
    for seed in (3, 4, 5):  # new per-call inputs, the same weights: one signature
        tensors, dy = _tensors(seed)
        tensors.update(weights)
        out, grads = _step(tensors, dy, backend)
        assert type(out.grad_fn).__name__ == "_GraphedTrainingStepBackward"
        want_out, want_grads = _plain(tensors, dy, monkeypatch, backend)
        assert torch.equal(out, want_out)
        for got, want in zip(grads, want_grads, strict=True):
            assert torch.equal(got, want)
    assert len(cuda_way) == 2 and [c.replays for c in cuda_way] == [3, 3]  # a replay per step


@pytest.mark.parametrize("backend", BACKENDS)
def test_interleaved_steps_keep_their_own_values(cuda_way, monkeypatch, backend):
    """Two forwards before their backwards (as with micro-batches or a recomputed layer): the backward makes the
    forward's values again from its own inputs, so each step's gradients are its own."""
    first, dy1 = _tensors(7)
    second, dy2 = _tensors(8)
    second.update({n: first[n] for n in ("gate_up_proj", "down_proj")})  # one signature: the same graphs
    out1 = moe_torch.experts_forward(**first, implementation=backend)
    out2 = moe_torch.experts_forward(**second, implementation=backend)
    grads2 = torch.autograd.grad(out2, [second[n] for n in NAMES], dy2)
    grads1 = torch.autograd.grad(out1, [first[n] for n in NAMES], dy1)
    assert len(cuda_way) == 2
    for tensors, dy, out, grads in ((first, dy1, out1, grads1), (second, dy2, out2, grads2)):
        want_out, want_grads = _plain(tensors, dy, monkeypatch, backend)
        assert torch.equal(out, want_out)
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_set_of_needed_gradients_has_its_backward_graph(cuda_way, monkeypatch, backend):
    tensors, dy = _tensors(9, requires=("hidden_states",))
    out, (grad_x,) = _step(tensors, dy, backend)
    _, (want,) = _plain(tensors, dy, monkeypatch, backend)
    assert torch.equal(grad_x, want)
    tensors, dy = _tensors(9, requires=("gate_up_proj", "down_proj"))
    _, grads = _step(tensors, dy, backend)
    _, want_grads = _plain(tensors, dy, monkeypatch, backend)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
    assert len(cuda_way) == 4  # a forward and a backward graph for each


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_weight_gradients_are_fresh_tensors(cuda_way, backend):
    """The weight gradients are made outside the graphs: each step's are new tensors (autograd keeps them without
    a copy), while the graphs' own outputs stay where they are."""
    tensors, dy = _tensors(10)
    grads = [_step(tensors, dy, backend)[1] for _ in range(2)]
    for before, after in zip(*grads):
        assert before.data_ptr() != after.data_ptr()


def test_on_by_default_off_by_setting_and_where_a_bias_or_a_gate_callable_is_given(cuda_way, monkeypatch):
    tensors, dy = _tensors(11)
    monkeypatch.setenv(graphs.TRAINING_VARIABLE, "off")
    _step(tensors, dy)
    assert cuda_way == []
    monkeypatch.delenv(graphs.TRAINING_VARIABLE)
    _step(tensors, dy)
    assert len(cuda_way) == 2
    graphs._GRAPHS.clear()
    cuda_way.clear()
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_moved_between_forward_and_backward_are_a_new_signature(cuda_way, monkeypatch, backend):
    """A weight whose memory moves between a step's forward and its backward (as a re-gathered weight's may) gets
    a backward graph of its own, never one captured on the old address; the bits stay the plain step's."""
    tensors, dy = _tensors(13)
    _step(tensors, dy, backend)
    assert len(cuda_way) == 2
    out = moe_torch.experts_forward(**tensors, implementation=backend)
    tensors["down_proj"].data = tensors["down_proj"].data.clone()
    grads = torch.autograd.grad(out, [tensors[n] for n in NAMES], dy)
    assert len(cuda_way) == 3
    want_out, want_grads = _plain(tensors, dy, monkeypatch, backend)
    assert torch.equal(out, want_out)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))


def test_dropping_graphs_for_want_of_room_warns_once(cuda_way, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 1)
    monkeypatch.setattr(graphs, "_warned_of_eviction", False)
    tensors, dy = _tensors(14)
    with pytest.warns(RuntimeWarning, match="MAX_GRAPHS=1.*MOE_TORCH_TRAINING_GRAPHS=off"):
        _step(tensors, dy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(tensors, dy)
    assert len(graphs._GRAPHS) == 1


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_plain_steps_bits(cuda_way, monkeypatch, reentrant):
    """Under torch.utils.checkpoint the forward runs again in the backward (without gradients first where the
    checkpoint is reentrant: a decode graph then, a training graph in the recomputation): the gradients are the
    plain step's."""
    tensors, dy = _tensors(15)

    def checkpointed(tensors):
        def forward(x, w, gate_up, down):
            return moe_torch.experts_forward(x, tensors["top_k_index"], w, gate_up, down,
                                             implementation="grouped_mm")
        return torch.utils.checkpoint.checkpoint(forward, *(tensors[n] for n in NAMES), use_reentrant=reentrant)
    out = checkpointed(tensors)
    out.backward(dy)  # (a reentrant checkpoint takes no autograd.grad)
    grads = [tensors[n].grad for n in NAMES]
    assert len(cuda_way) >= 2
    want_out, want_grads = _plain(tensors, dy, monkeypatch, "grouped_mm")
    assert torch.equal(out, want_out)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))


def test_past_the_training_bound_the_step_runs_plainly(cuda_way, monkeypatch):
    """The spec's training_graphs bound is the training steps' own: past it (here 0 MiB) a training call runs the
    plain one-node step, while an inference call within the decode bound still replays a graph."""
    spec = graphs.load_spec()
    backends = dict(spec.backends)
    for name in ("batched_mm", "grouped_mm"):
        frameworks = dict(backends[name].frameworks)
        frameworks["torch"] = dataclasses.replace(frameworks["torch"], training_graphs={"cpu": 0})
        backends[name] = dataclasses.replace(backends[name], frameworks=frameworks)
    monkeypatch.setattr(graphs, "load_spec", lambda: dataclasses.replace(spec, backends=backends))
    tensors, dy = _tensors(16)
    for backend in BACKENDS:
        out, _ = _step(tensors, dy, backend)
        assert type(out.grad_fn).__name__ == "_TrainingStepBackward"
    assert cuda_way == []
    with torch.no_grad():
        moe_torch.experts_forward(**tensors, implementation="grouped_mm")
    assert len(cuda_way) == 1
