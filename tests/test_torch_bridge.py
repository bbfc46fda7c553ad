"""moe_jax.torch_bridge: which callback calls run the work, capture a graph or replay one (a stand-in capture and
launch on the CPU; the CUDA graphs themselves are checked on the device, tests/device_sonicmoe_host.py)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from moe_jax import torch_bridge


class DeviceBuffer:
    """Stands for a jax.experimental.buffer_callback Buffer on a GPU (kDLCUDA) or on the host."""

    def __init__(self, address: int, cuda: bool = True):
        self.address, self.cuda = address, cuda

    def __dlpack_device__(self):
        return (2 if self.cuda else 1, 0)

    @property
    def __cuda_array_interface__(self):
        if not self.cuda:
            raise AttributeError("a host buffer has no __cuda_array_interface__")
        return {"data": (self.address, False), "shape": (4,), "typestr": "<f4", "version": 3}


@pytest.fixture
def log():
    """What happened, in order: 'run' (the work, directly), 'capture', ('launch', graph, stream)."""
    events = []

    def capture(work):
        events.append("capture")
        return f"graph {len(events)}"

    def launch(graph, stream):
        events.append(("launch", graph, stream))

    return events, capture, launch


def _call(replays, stream, addresses, events):
    """What a callback does: a replay from the key of its stream and buffers (``addresses`` None: host buffers),
    else the work (run or captured)."""
    buffers = [DeviceBuffer(1, cuda=False)] if addresses is None else [DeviceBuffer(a) for a in addresses]
    key = replays.key(SimpleNamespace() if addresses is None else SimpleNamespace(stream=stream), buffers)
    if not replays.replay(key):
        replays.run(key, lambda: events.append("run"))


def test_a_key_runs_then_captures_then_replays(log):
    events, capture, launch = log
    replays = torch_bridge.Replays(capture=capture, launch=launch)
    for _ in range(4):
        _call(replays, 7, [1, 2], events)
    graph = ("launch", "graph 2", 7)
    assert events == ["run", "capture", graph, graph, graph]
    assert replays.counts == {"run": 1, "capture": 1, "replay": 3}


def test_every_address_and_the_stream_are_in_the_key(log):
    events, capture, launch = log
    replays = torch_bridge.Replays(capture=capture, launch=launch)
    calls = [(7, [1, 2]), (7, [1, 3]), (8, [1, 2]), (7, [1, 2]), (7, [1, 3]), (8, [1, 2]), (7, [9, 2])]
    for stream, addresses in calls:
        _call(replays, stream, addresses, events)
    launched = [e[2] for e in events if isinstance(e, tuple)]
    assert [e if isinstance(e, str) else "launch" for e in events] == ["run"] * 3 + ["capture", "launch"] * 3 + ["run"]
    assert launched == [7, 7, 8]


def test_least_recently_used_graphs_and_keys_go_first(log):
    events, capture, launch = log
    replays = torch_bridge.Replays(limit=2, capture=capture, launch=launch)

    def call(address):
        _call(replays, 0, [address], events)

    for address in (1, 1, 2, 2, 1):  # graphs of 1 and 2; 1 used last
        call(address)
    events.clear()
    call(3), call(3)  # 3's graph pushes out 2's, the least recently used, and its first call pushes key 1 out of seen
    call(1), call(2)  # 1 replays; 2 is still seen, so it is captured again, pushing out 3's graph
    call(4), call(3), call(1)  # 4 runs, pushing key 2 out of seen; 3 is still seen: captured again, pushing out 1's
    kinds = [e if isinstance(e, str) else "launch" for e in events]
    assert kinds == ["run", "capture", "launch", "launch", "capture", "launch", "run", "capture", "launch", "run"]


def test_host_buffers_and_the_switch_off_always_run_the_work(log, monkeypatch):
    events, capture, launch = log
    replays = torch_bridge.Replays(capture=capture, launch=launch)
    for _ in range(3):
        _call(replays, 0, None, events)  # host buffers: no addresses
    _call(replays, 0, [5], events), _call(replays, 0, [5], events)
    monkeypatch.setattr(torch_bridge, "CALLBACK_GRAPHS", False)
    for _ in range(3):
        _call(replays, 0, [5], events)  # a graph is kept for [5], but graphs are off
    assert [e if isinstance(e, str) else "launch" for e in events] == ["run"] * 4 + ["capture", "launch"] + ["run"] * 3


def test_a_graphed_callback_replays_from_the_addresses_without_views_or_stream_switch(log, monkeypatch):
    events, capture, launch = log
    monkeypatch.setattr(torch_bridge, "views", lambda buffers: events.append("views") or dict(buffers))

    @contextlib.contextmanager
    def on_xla_stream(ctx, buffer):
        events.append("stream switch")
        yield

    monkeypatch.setattr(torch_bridge, "on_xla_stream", on_xla_stream)
    bodies = []
    callback = torch_bridge.graphed_callback(lambda t, m, o: bodies.append((t, m, o)) or events.append("body"),
                                             torch_bridge.Replays(capture=capture, launch=launch))
    ctx = SimpleNamespace(stream=11)
    inputs, more, out = {"x": DeviceBuffer(100)}, {"ids": DeviceBuffer(200)}, {"out": DeviceBuffer(300)}
    for _ in range(3):
        callback(ctx, out, inputs, more)
    callback(ctx, {"out": DeviceBuffer(301)}, inputs, more)  # another output address: a new key, run again
    frame = ["stream switch", "views", "views", "views"]
    assert events == (frame + ["body"] + frame + ["capture", ("launch", "graph 10", 11)] + [("launch", "graph 10", 11)]
                      + frame + ["body"])  # captured: capture(work) here does not call the body
    assert bodies[0] == (inputs, more, out)  # the body gets the views of (inputs, more, out) in that order
    events.clear()
    host = torch_bridge.graphed_callback(lambda t, m, o: events.append("body"),
                                         torch_bridge.Replays(capture=capture, launch=launch))
    for _ in range(3):
        host(SimpleNamespace(), {"out": DeviceBuffer(1, cuda=False)}, {"x": DeviceBuffer(2, cuda=False)}, {})
    assert events == (frame[:-1] + ["views", "body"]) * 3  # host buffers: never a graph, and no stream asked for


def test_a_graph_launches_on_the_given_stream_and_a_failure_names_it(monkeypatch):
    launched = []

    def cu_graph_launch(graph_exec, stream):
        launched.append((graph_exec, stream))
        return 0 if stream != 0xBAD else 400

    monkeypatch.setattr(torch_bridge, "_cu_graph_launch", lambda: cu_graph_launch)
    graph = SimpleNamespace(raw_cuda_graph_exec=lambda: 0xE1)
    torch_bridge.launch_graph(graph, 0x51)
    assert launched == [(0xE1, 0x51)]
    with pytest.raises(RuntimeError, match=r"stream 0xbad failed: CUresult 400"):
        torch_bridge.launch_graph(graph, 0xBAD)


def test_a_graph_without_its_executable_replays_on_the_stream_made_torchs(monkeypatch):
    events = []

    @contextlib.contextmanager
    def current(stream):
        events.append(("current", stream.handle))
        yield

    cuda = SimpleNamespace(stream=current, ExternalStream=lambda handle: SimpleNamespace(handle=handle))
    monkeypatch.setattr(torch_bridge, "torch_module", lambda: SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(torch_bridge, "_cu_graph_launch", lambda: pytest.fail("no executable to launch"))
    torch_bridge.launch_graph(SimpleNamespace(replay=lambda: events.append("replay")), 0x51)
    assert events == [("current", 0x51), "replay"]
