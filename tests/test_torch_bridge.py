"""moe_jax.torch_bridge.Replays: which calls run the work, capture a graph or replay one (a stand-in capture on the
CPU; the CUDA graphs themselves are checked on the device, tests/device_sonicmoe_routes.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moe_jax import torch_bridge


class Buffer:
    def __init__(self, address: int, is_cuda: bool = True):
        self.address, self.is_cuda = address, is_cuda

    def data_ptr(self) -> int:
        return self.address


@pytest.fixture
def log():
    """What happened, in order: 'run' (the work, directly), 'capture', 'replay'."""
    events = []

    def capture(work):
        events.append("capture")
        return SimpleNamespace(replay=lambda: events.append("replay"))

    return events, capture


def test_a_key_runs_then_captures_then_replays(log):
    events, capture = log
    replays = torch_bridge.Replays(capture=capture)
    ctx = SimpleNamespace(stream=7)
    for _ in range(4):
        replays.run(ctx, [Buffer(1), Buffer(2)], lambda: events.append("run"))
    assert events == ["run", "capture", "replay", "replay", "replay"]
    assert replays.counts == {"run": 1, "capture": 1, "replay": 3}


def test_every_address_and_the_stream_are_in_the_key(log):
    events, capture = log
    replays = torch_bridge.Replays(capture=capture)
    calls = [(7, (1, 2)), (7, (1, 3)), (8, (1, 2)), (7, (1, 2)), (7, (1, 3)), (8, (1, 2)), (7, (9, 2))]
    for stream, addresses in calls:
        replays.run(SimpleNamespace(stream=stream), [Buffer(a) for a in addresses], lambda: events.append("run"))
    assert events == ["run"] * 3 + ["capture", "replay"] * 3 + ["run"]


def test_least_recently_used_graphs_and_keys_go_first(log):
    events, capture = log
    replays = torch_bridge.Replays(limit=2, capture=capture)
    ctx = SimpleNamespace(stream=0)

    def call(address):
        replays.run(ctx, [Buffer(address)], lambda: events.append("run"))

    for address in (1, 1, 2, 2, 1):  # graphs of 1 and 2; 1 used last
        call(address)
    events.clear()
    call(3), call(3)  # 3's graph pushes out 2's, the least recently used, and its first call pushes key 1 out of seen
    call(1), call(2)  # 1 replays; 2 is still seen, so it is captured again, pushing out 3's graph
    call(4), call(3), call(1)  # 4 runs, pushing key 2 out of seen; 3 is still seen: captured again, pushing out 1's
    assert events == ["run", "capture", "replay", "replay", "capture", "replay", "run", "capture", "replay", "run"]


def test_host_buffers_and_the_switch_off_always_run_the_work(log, monkeypatch):
    events, capture = log
    replays = torch_bridge.Replays(capture=capture)
    ctx = SimpleNamespace(stream=0)
    for _ in range(3):
        replays.run(ctx, [Buffer(1), Buffer(2, is_cuda=False)], lambda: events.append("run"))
    monkeypatch.setattr(torch_bridge, "CALLBACK_GRAPHS", False)
    for _ in range(3):
        replays.run(ctx, [Buffer(5)], lambda: events.append("run"))
    assert events == ["run"] * 6
