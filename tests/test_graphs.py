"""Decode graphs (moe_torch.graphs): which calls may run as CUDA graphs, and the cache's logic.

This machine has no GPU: the capture itself is replaced by a stand-in whose replay runs the captured call on the
graph's own buffers, so what is tested here is the routing of calls, the keys, the copies in and out, the eviction
and the failed-capture path. The capture and the bits on a GPU: tests/device_graphs_check.py (results in
tests/device_results/)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moe_torch
from moe_shared import ArrayInfo
from moe_shared.spec import load_spec, parse_spec
from moe_torch import api, base, graphs
from moe_torch import backends as moe_backends

E, H, I, K = 4, 16, 8, 2


def _inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    index = torch.randint(0, E, (T, K), generator=g)
    weights = torch.rand(T, K, generator=g)
    return x, index, weights


def _weights(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)


class _StandIn:
    """A captured call without a GPU: replay() runs the call again on the capture's buffers, into its output."""

    def __init__(self, call, buffers):
        self.call, self.buffers = call, buffers
        self.replays = 0

    def replay(self):
        self.replays += 1
        result = self.call(*self.buffers)
        if isinstance(self.output, torch.Tensor):
            self.output.copy_(result)
            return
        for kept, fresh in zip(self.output, result):  # a tuple of tensors and Nones
            if kept is not None:
                kept.copy_(fresh)


def _spec_with_graphs_on_cpu():
    spec = load_spec()
    backends = dict(spec.backends)
    for name, backend in spec.backends.items():
        torch_support = backend.frameworks.get("torch")
        if torch_support is not None and torch_support.graphs:
            frameworks = dict(backend.frameworks)
            frameworks["torch"] = dataclasses.replace(
                torch_support, graphs={**torch_support.graphs, "cpu": torch_support.graphs["cuda"]},
                training_graphs={**torch_support.training_graphs,
                                 **({"cpu": torch_support.training_graphs["cuda"]}
                                    if "cuda" in torch_support.training_graphs else {})})
            backends[name] = dataclasses.replace(backend, frameworks=frameworks)
    return dataclasses.replace(spec, backends=backends)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CPU calls routed as CUDA ones would be: a spec whose graph entries name "cpu" too, captures made by
    _StandIn."""
    captures = []

    def capture(call, inputs):
        buffers = tuple(t.clone() for t in inputs)
        stand_in = _StandIn(call, buffers)
        stand_in.output = call(*buffers)
        captures.append(stand_in)
        return graphs._Graph(stand_in, buffers, stand_in.output)

    monkeypatch.setattr(graphs, "load_spec", _spec_with_graphs_on_cpu)
    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    api._CHECKED.clear()
    graphs._GRAPHS.clear()
    yield captures
    api._CHECKED.clear()
    graphs._GRAPHS.clear()


def test_the_spec_declares_graphs_for_the_capturable_backends_on_cuda_only():
    spec = load_spec()
    declared = {name: dict(spec.backends[name].frameworks["torch"].graphs) for name in spec.backend_names("torch")
                if spec.backends[name].frameworks["torch"].graphs}
    # the bound keeps prefill sizes (a capture for every new T) out
    assert declared == {"batched_mm": {"cuda": 8192}, "grouped_mm": {"cuda": 8192}, "triton": {"cuda": 0}}
    for name in declared:
        assert not spec.backends[name].data_dependent  # no host sync: capturable
    assert all(not support.graphs and not support.training_graphs for backend in spec.backends.values()
               for fw, support in backend.frameworks.items() if fw != "torch")
    # training graphs: the backends with a one-node training step (moe_torch.training_step), within the decode bound
    training = {name: dict(spec.backends[name].frameworks["torch"].training_graphs)
                for name in spec.backend_names("torch") if spec.backends[name].frameworks["torch"].training_graphs}
    assert training == {"batched_mm": {"cuda": 768}, "grouped_mm": {"cuda": 768}}
    assert {module.NAME for module in moe_backends.ALL if hasattr(module, "STEP")} == set(training)
    assert all(training[name]["cuda"] <= declared[name]["cuda"] for name in training)


def test_the_spec_reads_graphs_and_their_bound():
    raw = {"contract": {"activations": ["silu"], "dtypes": ["float32"], "index_dtypes": ["int64"], "empty_slot": -1},
           "tolerance": {"float32": 1e-5},
           "backends": {"b": {"description": "d", "torch": {"devices": ["cuda"], "dtypes": ["float32"],
                                                            "graphs": {"cuda": 7}, "training_graphs": {"cuda": 3}}},
                        "c": {"description": "d", "torch": {"devices": ["cuda"], "dtypes": ["float32"]}}}}
    spec = parse_spec(raw)
    assert dict(spec.backends["b"].frameworks["torch"].graphs) == {"cuda": 7}
    assert dict(spec.backends["b"].frameworks["torch"].training_graphs) == {"cuda": 3}
    assert not {"graphs", "training_graphs"} & set(spec.backends["b"].frameworks["torch"].details)
    assert not spec.backends["c"].frameworks["torch"].graphs
    assert not spec.backends["c"].frameworks["torch"].training_graphs


@pytest.mark.parametrize("T, expected", [(1, True), (0, False), (2_000_000, True), (3_000_000, False)])
def test_graphable_within_the_weight_bound_named_activations_and_declared_backends(T, expected, monkeypatch):
    """Within its backend's bound: an expert here is 4 * (2*8*16 + 16*8) bytes = 1.5 KiB, and grouped_mm's 8192 MiB
    are 5.6 million slots (T = 2.8 million at k=2)."""
    gate_up, down = _weights()
    monkeypatch.setattr(graphs, "load_spec", _spec_with_graphs_on_cpu)
    per_token = (ArrayInfo((T, H), "float32"), ArrayInfo((T, K), "int64"), ArrayInfo((T, K), "float32"))
    dims = moe_torch.api.check_arguments(*per_token, base.info(gate_up), base.info(down), None, None,
                                         activation="silu")
    assert graphs.allowed("grouped_mm", "silu", gate_up, down, dims.slots) is expected
    assert not graphs.allowed("grouped_mm", torch.nn.functional.silu, gate_up, down, dims.slots)
    assert not graphs.allowed("eager", "silu", gate_up, down, dims.slots)  # data dependent: not declared
    assert not graphs.allowed("not-in-the-spec", "silu", gate_up, down, dims.slots)
    monkeypatch.setattr(graphs, "load_spec", load_spec)
    assert not graphs.allowed("grouped_mm", "silu", gate_up, down, dims.slots)  # cpu: not declared


def test_plain_cpu_calls_never_capture(monkeypatch):
    monkeypatch.setattr(graphs, "_capture", lambda *a: pytest.fail("a CPU call was captured"))
    graphs._GRAPHS.clear()
    gate_up, down = _weights()
    moe_torch.experts_forward(*_inputs(3), gate_up, down, implementation="grouped_mm")
    assert not graphs._GRAPHS


@pytest.mark.parametrize("backend", ["batched_mm", "grouped_mm"])
def test_a_graph_is_captured_once_per_signature_and_replayed_on_each_calls_inputs(fake_cuda, backend):
    gate_up, down = _weights()
    plain = {}
    for seed in range(3):
        x, index, w = _inputs(2, seed)
        plain[seed] = api.ExpertsInterface[backend](x, index, w, gate_up, down)
    outputs = []
    for seed in range(3):
        with torch.no_grad():
            outputs.append(moe_torch.experts_forward(*_inputs(2, seed), gate_up, down, implementation=backend))
    assert len(fake_cuda) == 1 and fake_cuda[0].replays == 3  # a capture runs nothing: the first call replays too
    for seed, out in enumerate(outputs):
        assert torch.equal(out, plain[seed])
    assert outputs[1].data_ptr() != outputs[2].data_ptr() != fake_cuda[0].output.data_ptr()  # copies out
    assert graphs.count() == 1
    moe_torch.experts_forward(*_inputs(5), gate_up, down, implementation=backend)  # another T: another graph
    moe_torch.experts_forward(*_inputs(2), gate_up.clone(), down, implementation=backend)  # other weights
    moe_torch.experts_forward(*_inputs(2), gate_up, down, implementation=backend, activation="gelu")
    assert len(fake_cuda) == 4 and graphs.count() == 4


def test_weights_updated_in_place_are_read_at_each_replay(fake_cuda):
    gate_up, down = _weights()
    x, index, w = _inputs(2)
    moe_torch.experts_forward(x, index, w, gate_up, down, implementation="grouped_mm")
    with torch.no_grad():
        down.mul_(2)
    got = moe_torch.experts_forward(x, index, w, gate_up, down, implementation="grouped_mm")
    assert len(fake_cuda) == 1
    assert torch.equal(got, api.ExpertsInterface["grouped_mm"](x, index, w, gate_up, down))


def test_differentiated_calls_and_the_setting_off_run_plainly(fake_cuda, monkeypatch):
    gate_up, down = _weights()
    x, index, w = _inputs(2)
    out = moe_torch.experts_forward(x.requires_grad_(), index, w, gate_up, down, implementation="grouped_mm")
    assert out.requires_grad and not fake_cuda
    monkeypatch.setenv(graphs.VARIABLE, "off")
    moe_torch.experts_forward(x.detach(), index, w, gate_up, down, implementation="grouped_mm")
    assert not fake_cuda
    monkeypatch.setenv(graphs.VARIABLE, "on")
    with pytest.raises(ValueError, match=r"MOE_TORCH_GRAPHS: expected one of \['auto', 'off'\], got 'on'"):
        moe_torch.experts_forward(x.detach(), index, w, gate_up, down, implementation="grouped_mm")


def test_inside_a_capture_of_the_callers_the_call_runs_plainly(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    gate_up, down = _weights()
    moe_torch.experts_forward(*_inputs(2), gate_up, down, implementation="grouped_mm")
    assert not fake_cuda


def test_a_failed_capture_runs_plainly_from_then_on(fake_cuda, monkeypatch):
    calls = []
    monkeypatch.setattr(graphs, "_capture", lambda *a: calls.append(a) or None)
    gate_up, down = _weights()
    x, index, w = _inputs(2)
    want = api.ExpertsInterface["grouped_mm"](x, index, w, gate_up, down)
    for _ in range(2):
        assert torch.equal(moe_torch.experts_forward(x, index, w, gate_up, down, implementation="grouped_mm"), want)
    assert len(calls) == 1 and graphs.count() == 0


def test_the_least_recently_used_graph_goes_first_and_release_drops_them_all(fake_cuda, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    gate_up, down = _weights()
    for T in (1, 2, 1, 3):  # T=1 used again before T=3 comes: T=2 is evicted
        moe_torch.experts_forward(*_inputs(T), gate_up, down, implementation="grouped_mm")
    assert [key[0][2][0][0][0] for key in graphs._GRAPHS] == [1, 3]  # hidden_states' T in each signature
    graphs.release()
    assert graphs.count() == 0


def test_a_capture_binds_only_its_own_thread_to_the_capture_rules(monkeypatch):
    """torch's default capture mode ("global") makes other threads' CUDA calls fail and the capture with them
    (seen on an H100 with JAX in the process); the capture asks for "thread_local"."""
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    seen = {}

    def graph(cuda_graph, pool=None, **options):
        seen.update(options, graph=cuda_graph, pool=pool)
        return contextlib.nullcontext()

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "a graph")
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(graphs, "_pool", lambda device: "the pool")
    entry = graphs._capture(lambda x: x * 2, (torch.ones(3),))
    assert seen == {"graph": "a graph", "pool": "the pool", "capture_error_mode": "thread_local"}
    assert torch.equal(entry.output, torch.full((3,), 2.0)) and entry.graph == "a graph"
