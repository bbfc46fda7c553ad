"""The benchmark harness: one smoke run on the tiny config, the roofline arithmetic, the decode crossover."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

import importlib.machinery
import importlib.util
import types

import numpy as np
import torch

from bench import budget, crossover, environment, peers, report, roofline, runners
from bench.__main__ import main
from bench.configs import CONFIGS, get_configs, parse_tokens
from bench.progress import progress
from bench.report import CSV_KEYS, META_KEYS, RECORD_KEYS
from bench.sweep import point_key
from moe_shared import load_spec

SPEC = load_spec()
RECORD_TYPES = {
    "framework": str, "backend": str, "library": str, "peer": bool, "config": str, "hidden": int,
    "intermediate": int, "experts": int, "top_k": int, "tokens": int, "dtype": str, "mode": str, "compiled": bool,
    "compile_mode": (str, type(None)), "ms": float, "floor_ms": float, "tflops": float,
    "peak_mem_gib": (float, type(None)), "rel_err": float, "stream_ms": float, "wall_ms": float,
    "cudagraph_skips": (int, type(None)), "graphed_ms": (float, type(None)), "cpu_steal": (float, type(None)),
}
META_TYPES = {
    "device": str, "torch": str, "jax": (str, type(None)), "triton": (str, type(None)),
    "commit": (str, type(None)), "date": str, "peak_tflops": float, "peak_tbs": float,
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--config", "tiny", "--tokens", "1,8", "--device", "cpu", "--out", str(out), "--min-reps", "1",
            "--max-reps", "2", "--min-time", "0", "--sets", "2", "--stream-rounds", "2"]
    assert main(argv) == 0
    (folder,) = out.iterdir()
    assert folder.name.startswith("cpu-") and folder.name.endswith("core")
    return folder


def _one(folder: Path, suffix: str) -> Path:
    (path,) = folder.glob(f"*-tiny{suffix}")
    return path


def test_smoke_json_schema(smoke):
    data = json.loads(_one(smoke, ".json").read_text())
    assert set(data) == {"meta", "records"}
    meta, records = data["meta"], data["records"]
    assert set(META_KEYS) <= set(meta) and set(META_KEYS) == set(META_TYPES)
    for key, kind in META_TYPES.items():
        assert isinstance(meta[key], kind), (key, meta[key])
    assert meta["peak_tflops"] > 0 and meta["peak_tbs"] > 0
    assert isinstance(meta["decode_crossover"], dict) and isinstance(meta["skipped"], list)
    # the smoke run has JAX points: moe_jax was imported before torch ran, and says what it did to glibc's allocator
    assert meta["jax_host_memory"] == __import__("moe_jax").host_memory.STATE
    assert meta["errors"] == [] and meta["complete"] is True
    assert set(RECORD_KEYS) == set(RECORD_TYPES)
    frameworks = {r["framework"] for r in records}
    assert "torch" in frameworks
    for fw, reasons in meta["unavailable"].items():
        usable = (set(SPEC.backend_names(fw)) | set(peers.peers_of(fw))) - set(reasons)
        assert {r["backend"] for r in records if r["framework"] == fw} == usable
    for r in records:
        assert set(r) == set(RECORD_KEYS)
        for key, kind in RECORD_TYPES.items():
            assert isinstance(r[key], kind) and not (kind is int and isinstance(r[key], bool)), (key, r[key])
        assert r["config"] == "tiny" and r["tokens"] in (1, 8) and r["dtype"] == "bfloat16"
        assert r["mode"] in roofline.MODES
        assert r["ms"] > 0 and r["stream_ms"] > 0 and r["floor_ms"] > 0 and r["tflops"] > 0
        assert r["rel_err"] <= SPEC.tolerance_for("bfloat16")
        assert r["peer"] == (r["backend"] in peers.PEERS)
        assert r["library"] == (peers.PEERS[r["backend"]].library if r["peer"] else f"moe_{r['framework']}")
        jitted = r["framework"] == "jax" and r["backend"] != "eager"
        assert r["compile_mode"] == (runners.JIT if jitted else None) and r["compiled"] == jitted
        # graphed_ms: JAX's jitted forward series (one jitted program of the sets' calls); torch's needs CUDA
        assert (r["graphed_ms"] is not None) == (jitted and r["mode"] == "fwd"), r


def test_smoke_meta_records_the_installed_kernel_packages(smoke):
    import importlib.metadata
    meta = json.loads(_one(smoke, ".json").read_text())["meta"]
    assert meta["environment"] == environment.timing_environment()
    packages = meta["packages"]
    assert packages["transformers"] == importlib.metadata.version("transformers")
    assert "sonic-moe" not in packages  # not installed here: left out, not recorded as None


def test_timing_environment_names_the_allocator_and_thread_settings(monkeypatch):
    """The meta's ``environment``: the set variables that change CPU timings (glibc's allocator, huge pages,
    threads), with their values; others are left out. The summary prints them."""
    for name in environment.TIMING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert environment.timing_environment() == {}
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    monkeypatch.setenv("MOE_EXPERTS_HUGE_PAGES", "0")
    monkeypatch.setenv("SOME_OTHER_SETTING", "x")
    found = environment.timing_environment()
    assert found == {"MALLOC_ARENA_MAX": "1", "MOE_EXPERTS_HUGE_PAGES": "0"}
    meta = {"device": "cpu", "peak_tflops": 1.0, "peak_tbs": 1.0, "dtype": "bfloat16", "environment": found}
    assert "environment: MALLOC_ARENA_MAX=1 MOE_EXPERTS_HUGE_PAGES=0" in report.summary(meta, {}, [], [], {})


def test_stolen_seconds_reads_the_steal_column_of_proc_stat(tmp_path):
    import os

    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 20 300 4 0 1 250 0 0\ncpu0 5 0 10 150 2 0 1 125 0 0\n")
    assert environment.stolen_seconds(stat) == pytest.approx(250 / os.sysconf("SC_CLK_TCK"))
    stat.write_text("intr 1 2 3\n")
    assert environment.stolen_seconds(stat) is None
    assert environment.stolen_seconds(tmp_path / "absent") is None
    if Path("/proc/stat").exists():
        assert environment.stolen_seconds() >= 0


def test_points_record_the_cpu_time_the_hypervisor_took_while_they_were_timed(monkeypatch):
    """cpu_steal: the steal counter's growth over the timed calls, as a share of the machine's CPU time over them;
    rounds pooled by summing; None where the kernel reports no steal; the summary names points above STEAL_NOTED."""
    import os

    import torch
    from bench import sweep
    from bench.inputs import make_sets, make_weights

    counter = iter([100.0, 100.5, 200.0, 200.25])
    monkeypatch.setattr(environment, "stolen_seconds", lambda: next(counter))
    runner = runners.TorchRunner(torch.device("cpu"))
    config = CONFIGS["tiny"]
    runner.load(make_weights(config, torch.bfloat16, torch.device("cpu"), seed=0),
                make_sets(config, 4, torch.bfloat16, torch.device("cpu"), seed=0, count=1))
    timing = runners.Timing(warmup=1, min_reps=2, max_reps=2, min_time=0.0, stream_rounds=1)
    first, second = (runner.measure("grouped_mm", "fwd", None, 1, timing) for _ in range(2))
    assert (first.stolen_s, second.stolen_s) == (0.5, 0.25) and first.timed_s > 0
    assert first.cpu_steal == pytest.approx(0.5 / (first.timed_s * os.cpu_count()))
    pooled = sweep._pooled([first, second])
    assert pooled.stolen_s == 0.75 and pooled.timed_s == pytest.approx(first.timed_s + second.timed_s)
    assert sweep._pooled([first, runners.Measurement([1.0], None, first.output, 0.1)]).cpu_steal is None
    record = {"framework": "torch", "backend": "grouped_mm", "config": "tiny", "tokens": 4, "mode": "fwd",
              "compiled": False, "compile_mode": None, "cudagraph_skips": None}
    meta = {"device": "cpu", "device_class": "cpu", "peak_tflops": 1.0, "peak_tbs": 1.0, "dtype": "bfloat16"}
    noted = report.summary(meta, {}, [], [], {}, [record | {"cpu_steal": 0.25}, record | {"tokens": 8, "cpu_steal":
                                                                                        report.STEAL_NOTED / 2}])
    assert "hypervisor steal tiny torch:grouped_mm:fwd T=4: 25.0% of the CPUs' time" in noted
    assert "T=8" not in noted


def test_smoke_has_the_transformers_peers_on_the_same_inputs(smoke):
    records = json.loads(_one(smoke, ".json").read_text())["records"]
    theirs = {(r["backend"], r["mode"], r["tokens"]) for r in records if r["library"] == "transformers"}
    assert theirs == {(f"transformers:{n}", m, t) for n in ("eager", "batched_mm", "grouped_mm")
                      for m in roofline.MODES for t in (1, 8)}
    table = report.versus(records)
    assert {(p["theirs"], p["ours"]) for p in table} == {(f"torch:transformers:{n}", f"torch:{n}")
                                                         for n in ("eager", "batched_mm", "grouped_mm")}
    assert all(p["ratio"] == pytest.approx(p["ours_ms"] / p["theirs_ms"]) for p in table)


def test_smoke_tokamax_absent_is_reported_not_run(smoke):
    if importlib.util.find_spec("tokamax") is not None:
        pytest.skip("tokamax is installed here: the absence path cannot be observed")
    meta = json.loads(_one(smoke, ".json").read_text())["meta"]
    assert "'tokamax' is not installed" in meta["unavailable"]["jax"]["tokamax:ragged_dot"]


def test_smoke_csv_matches_json(smoke):
    records = json.loads(_one(smoke, ".json").read_text())["records"]
    with _one(smoke, ".csv").open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == CSV_KEYS and not any(r["measured_in"] for r in rows)
    assert len(rows) == len(records)
    assert [float(r["ms"]) for r in rows] == pytest.approx([r["ms"] for r in records])


def _short_run(out: Path, tokens: str, *more: str) -> Path:
    """The JSON of a short CPU run of torch grouped_mm on the tiny config."""
    argv = ["--config", "tiny", "--tokens", tokens, "--device", "cpu", "--frameworks", "torch", "--backends",
            "grouped_mm", "--out", str(out), "--min-reps", "1", "--max-reps", "2", "--min-time", "0", "--sets", "2",
            "--stream-rounds", "1", "--no-plot", *more]
    assert main(argv) == 0
    (folder,) = out.iterdir()
    return _one(folder, ".json")


def _resume_run(out: Path, resume: str, tokens: str) -> Path:
    return _short_run(out, tokens, "--resume", resume)


def test_resume_keeps_earlier_records_and_runs_only_new_points(smoke, tmp_path):
    earlier_path = _one(smoke, ".json")
    earlier = json.loads(earlier_path.read_text())
    records = json.loads(_resume_run(tmp_path, str(earlier_path), "1,8,16").read_text())["records"]
    resumed = [r for r in records if "measured_in" in r]
    assert [{k: v for k, v in r.items() if k != "measured_in"} for r in resumed] == earlier["records"]
    assert {r["measured_in"]["file"] for r in resumed} == {earlier_path.name}
    assert resumed[0]["measured_in"]["date"] == earlier["meta"]["date"]
    new = [point_key(r) for r in records if "measured_in" not in r]
    assert sorted(new) == sorted(("torch", "grouped_mm", "tiny", 16, mode, None) for mode in ("fwd", "fwd+bwd"))


def test_resume_keeps_earlier_skips_and_does_not_try_them_again(smoke, tmp_path):
    data = json.loads(_one(smoke, ".json").read_text())
    oom = {"framework": "torch", "backend": "grouped_mm", "config": "tiny", "tokens": 16, "mode": "fwd",
           "compiled": False, "compile_mode": None, "reason": "out of memory: (injected)"}
    data["meta"]["skipped"] = [oom]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(data))
    written = json.loads(_resume_run(tmp_path / "out", str(earlier), "1,8,16").read_text())
    new = [point_key(r) for r in written["records"] if "measured_in" not in r]
    assert new == [("torch", "grouped_mm", "tiny", 16, "fwd+bwd", None)]
    (kept,) = [s for s in written["meta"]["skipped"] if s["tokens"] == 16]
    assert kept["reason"] == oom["reason"] and kept["skipped_in"]["file"] == "earlier.json"


def test_inputs_out_of_memory_skip_that_token_count_and_the_run_goes_on(tmp_path, monkeypatch):
    """deepseek-v3's JAX points at T=16384 once ended the whole run: torch could not make the inputs beside the
    memory XLA kept. Such a token count is now skipped, each point with the reason, and the next one runs."""
    from bench import inputs

    made = inputs.make_sets

    def short_of_memory(cfg, tokens, *args, **kwargs):
        if tokens == 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB (injected)")
        return made(cfg, tokens, *args, **kwargs)

    monkeypatch.setattr(inputs, "make_sets", short_of_memory)
    written = json.loads(_short_run(tmp_path / "out", "1,8,16").read_text())
    assert sorted(r["tokens"] for r in written["records"]) == [1, 1, 16, 16]
    skipped = written["meta"]["skipped"]
    assert sorted((s["tokens"], s["mode"]) for s in skipped) == [(8, "fwd"), (8, "fwd+bwd")]
    assert all(s["reason"].startswith("out of memory making the inputs: CUDA out of memory") for s in skipped)
    assert written["meta"]["complete"] is True and not written["meta"]["errors"]


def test_a_stopped_run_leaves_the_resumed_points_written(smoke, tmp_path, monkeypatch):
    """The results files exist from the start and are rewritten after every point, so a run stopped partway
    (SIGTERM from `timeout` ends it with SystemExit) can be resumed from them even if no point finished."""
    from bench import sweep

    def stopped(*args, **kwargs):
        raise SystemExit(143)

    monkeypatch.setattr(sweep, "_measure_point", stopped)
    earlier = _one(smoke, ".json")
    with pytest.raises(SystemExit):
        _resume_run(tmp_path, str(earlier), "1,8,16")
    (folder,) = tmp_path.iterdir()
    written = json.loads(_one(folder, ".json").read_text())
    assert written["meta"]["complete"] is False
    earlier_records = json.loads(earlier.read_text())["records"]
    assert sorted(map(point_key, written["records"])) == sorted(map(point_key, earlier_records))
    assert not list(folder.glob("*.part"))


def test_resume_refuses_another_device(smoke, tmp_path):
    data = json.loads(_one(smoke, ".json").read_text())
    data["meta"]["device_tag"] = "nvidia-h200"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="measured on nvidia-h200"):
        _resume_run(tmp_path / "out", str(other), "1")


def test_smoke_png(smoke):
    pytest.importorskip("matplotlib")
    assert _one(smoke, ".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_crossover_cli_prints_spec_lines(smoke, capsys):
    assert crossover.main([str(_one(smoke, ".json"))]) == 0
    out = capsys.readouterr().out
    assert "[decode.max_gathered_mib]" in out
    assert any(line.startswith("torch = { cpu = ") for line in out.splitlines())


# --- peers and compile modes ------------------------------------------------------------------------------------

def _small_problem(seed=0, T=12, H=16, I=8, E=5, k=2):
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    return x, index, w, torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 3


@pytest.mark.parametrize("name", ["eager", "batched_mm", "grouped_mm"])
def test_transformers_peer_runs_transformers_on_our_weights(name, monkeypatch):
    import torch
    import moe_torch
    from transformers.integrations import moe as hf_moe

    x, index, w, gate_up, down = _small_problem()
    calls = []
    if name != "eager":  # the peer must call transformers' registered function, not ours
        original = hf_moe.ALL_EXPERTS_FUNCTIONS[name]
        monkeypatch.setitem(hf_moe.ALL_EXPERTS_FUNCTIONS._global_mapping, name,
                            lambda *a: calls.append(name) or original(*a))
    forward = peers.PEERS[f"transformers:{name}"].make(5, 16, 8)
    out = forward(x, index, w, gate_up, down)
    expected = moe_torch.experts_forward(x, index, w, gate_up, down, implementation="eager")
    assert calls == ([] if name == "eager" else [name])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out2 = forward(x, index, w, gate_up * 2, down)  # the weights of the call, not ones kept from the first
    torch.testing.assert_close(out2, moe_torch.experts_forward(x, index, w, gate_up * 2, down,
                                                               implementation="eager"), rtol=1e-5, atol=1e-5)


def test_tokamax_peer_with_a_stand_in_package(monkeypatch):
    """The tokamax series' own code (sort, two grouped matmuls, combine) on a stand-in ``tokamax.ragged_dot``
    with tokamax's signature (rhs [G, K, N]), here jax.lax.ragged_dot."""
    import jax
    import jax.numpy as jnp
    import moe_torch

    fake = types.ModuleType("tokamax")
    fake.__spec__ = importlib.machinery.ModuleSpec("tokamax", None)
    fake.ragged_dot = lambda lhs, rhs, group_sizes, precision=None, preferred_element_type=None: \
        jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=preferred_element_type)
    monkeypatch.setitem(sys.modules, "tokamax", fake)
    peer = peers.PEERS["tokamax:ragged_dot"]
    assert peer.unavailable() is None
    x, index, w, gate_up, down = _small_problem(1)
    kn = peers.tokamax_weights(jnp.asarray(gate_up.numpy()), jnp.asarray(down.numpy()))
    out = jax.jit(peer.make())(jnp.asarray(x.numpy()), jnp.asarray(index.numpy(), jnp.int32),
                               jnp.asarray(w.numpy()), *kn)
    expected = moe_torch.experts_forward(x, index, w, gate_up, down, implementation="eager")
    np.testing.assert_allclose(np.asarray(out), expected.numpy(), rtol=1e-5, atol=1e-5)


def test_peer_availability_names_the_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a))
    reasons = runners.TorchRunner(__import__("torch").device("cpu")).availability()
    for name in ("eager", "batched_mm", "grouped_mm"):
        assert reasons[f"transformers:{name}"] == (f"peer transformers:{name}: the package 'transformers' is "
                                                   f"not installed")
    assert reasons["grouped_mm"] is None


def test_compile_modes_follow_the_spec_table():
    torch_runner = runners.TorchRunner(__import__("torch").device("cpu"))
    grouped = SPEC.backends["grouped_mm"].support("torch").compile.modes
    best = next(m for m in runners.COMPILE_PREFERENCE if m in grouped)
    assert torch_runner.variants("grouped_mm", "bfloat16", [False, True], "best") == {None: None, best: None}
    # a peer is compiled under its counterpart's entry
    assert torch_runner.variants("transformers:grouped_mm", "bfloat16", [True], "best") == {best: None}
    assert torch_runner.variants("batched_mm", "bfloat16", [True], "best") == {"max-autotune": None}
    every = torch_runner.variants("grouped_mm", "bfloat16", [True], "all")
    assert list(every) == [m for m in runners.COMPILE_PREFERENCE if m in grouped] and set(every.values()) == {None}
    undeclared = [m for m in runners.COMPILE_PREFERENCE if m not in grouped]
    if undeclared:
        reason = torch_runner.variants("grouped_mm", "bfloat16", [True], undeclared[0])[undeclared[0]]
        assert reason.startswith("not compiled: compile mode")
    assert torch_runner.variants("eager", "bfloat16", [True], "default")["default"].startswith(
        "not compiled: not fullgraph-compatible")
    assert [runners.TorchRunner.label(v) for v in (None, "default", "reduce-overhead")] == [
        "", "compiled", "compiled-reduce-overhead"]
    jax_runner = runners.JaxRunner(__import__("torch").device("cpu"))
    assert jax_runner.variants("eager", "bfloat16", [True], "best") == {None: None}
    assert jax_runner.variants("tokamax:ragged_dot", "bfloat16", [False], "best") == {runners.JIT: None}


def test_compile_mode_flag_is_checked(tmp_path):
    with pytest.raises(SystemExit, match="--compile-mode"):
        main(["--compile-mode", "fastest", "--out", str(tmp_path)])


def test_versus_pairs_each_peer_with_our_same_named_series():
    def rec(backend, ms, variant=None, peer=False, tokens=1, framework="torch"):
        return {"framework": framework, "backend": backend, "peer": peer, "config": "c", "mode": "fwd",
                "tokens": tokens, "compiled": variant is not None, "compile_mode": variant, "ms": ms}
    records = [rec("grouped_mm", 1.0), rec("transformers:grouped_mm", 4.0, peer=True),
               rec("grouped_mm", 2.0, "default"), rec("transformers:grouped_mm", 1.0, "default", peer=True),
               rec("transformers:batched_mm", 1.0, peer=True), rec("batched_mm", 3.0, tokens=2)]
    pairs = report.versus(records)
    assert [(p["ours"], p["theirs"], p["ratio"]) for p in pairs] == [
        ("torch:grouped_mm", "torch:transformers:grouped_mm", 0.25),
        ("torch:grouped_mm:compiled", "torch:transformers:grouped_mm:compiled", 2.0)]
    assert "0.25" in report.versus_table(records) and report.versus_table(records[:1]) == ""


def test_records_without_compile_mode_read_as_before():
    assert report.variant_of({"framework": "torch", "compiled": True}) == "default"
    assert report.variant_of({"framework": "jax", "compiled": True}) == runners.JIT
    assert report.variant_of({"framework": "jax", "compiled": False}) is None


# --- arithmetic ------------------------------------------------------------------------------------------------

def test_flops():
    # 2 * T * k * (2I*H + H*I) with T=2, H=4, I=3, k=2
    assert roofline.flops(2, 4, 3, 2, "fwd") == 2 * 2 * 2 * (24 + 12) == 288
    assert roofline.flops(2, 4, 3, 2, "fwd+bwd") == 3 * 288
    with pytest.raises(ValueError, match="mode"):
        roofline.flops(2, 4, 3, 2, "bwd")


def test_bytes():
    weights = 3 * 3 * 4 * 3 * 2  # 3 hit experts of 3*H*I bf16 values
    tokens = 2 * 4 * 2  # one [T, H] bf16 array
    assert roofline.bytes_moved(2, 4, 3, 3, 2, "fwd") == weights + 2 * tokens
    assert roofline.bytes_moved(2, 4, 3, 3, 2, "fwd+bwd") == 2 * weights + 4 * tokens


def test_floor_is_the_slower_of_compute_and_memory():
    assert roofline.floor_ms(2e12, 1e9, peak_tflops=1.0, peak_tbs=1.0) == pytest.approx(2000.0)  # compute
    assert roofline.floor_ms(1e9, 3e12, peak_tflops=1.0, peak_tbs=1.0) == pytest.approx(3000.0)  # memory
    with pytest.raises(ValueError, match="peaks"):
        roofline.floor_ms(1, 1, 0.0, 1.0)



def test_peak_runs_stop_once_they_pass_the_time_budget(monkeypatch):
    """A peak is the best of ``reps`` timed runs after a warm-up, fewer once the timed runs pass
    ``_PEAK_BUDGET_S`` (a host without bf16 matmul units takes seconds per run), never fewer than one."""
    import time

    import torch

    calls = []
    monkeypatch.setattr(roofline, "_PEAK_BUDGET_S", 0.05)
    assert roofline._best_seconds(lambda: calls.append(1), torch.device("cpu"), 10) >= 0
    assert len(calls) == 11
    calls.clear()
    best = roofline._best_seconds(lambda: (calls.append(1), time.sleep(0.03)), torch.device("cpu"), 10)
    assert len(calls) == 3 and best >= 0.03
    calls.clear()
    monkeypatch.setattr(roofline, "_PEAK_BUDGET_S", 0.0)
    roofline._best_seconds(lambda: (calls.append(1), time.sleep(0.01)), torch.device("cpu"), 10)
    assert len(calls) == 2

def test_budget_skips_batched_mm_that_duplicates_weights():
    peaks = roofline.Peaks(tflops=1000.0, tbs=5.0)
    shape = budget.Shape(CONFIGS["deepseek-v3"], 16384, "fwd", 2)
    gathered = 16384 * 8 * 3 * 7168 * 2048 * 2
    elsewhere = budget.estimate("torch", "batched_mm", "tpu", shape, peaks, n_sets=3)
    assert elsewhere.memory >= gathered * 2 / 3  # ours gathers one projection at a time where it gathers
    assert budget.skip_reason(elsewhere, 100 * budget.GIB, 10.0).startswith("too large")
    for framework, backend in (("jax", "batched_mm"), ("torch", "transformers:batched_mm")):  # both, kept
        est = budget.estimate(framework, backend, "cuda", shape, peaks, n_sets=3)
        assert est.memory >= gathered and budget.skip_reason(est, 100 * budget.GIB, 10.0).startswith("too large")
    for device_class in ("cpu", "cuda"):  # in place (CPU: compiled, chunks of a few MB), reading each slot's weights
        in_place = budget.estimate("torch", "batched_mm", device_class, shape, peaks, n_sets=3)
        assert in_place.memory < elsewhere.memory - gathered / 2 and in_place.seconds >= gathered / 5e12
    small = budget.estimate("torch", "grouped_mm", "cuda", shape, peaks, n_sets=3)
    assert budget.skip_reason(small, 100 * budget.GIB, 10.0) is None


def test_budget_jax_ragged_dot_on_cpu_is_dense_over_experts():
    peaks = roofline.Peaks(tflops=1.0, tbs=0.1)
    shape = budget.Shape(CONFIGS["qwen3-30b-a3b"], 4096, "fwd", 2)
    cpu = budget.estimate("jax", "ragged_dot", "cpu", shape, peaks, n_sets=3)
    gpu = budget.estimate("jax", "ragged_dot", "cuda", shape, peaks, n_sets=3)
    assert cpu.seconds == pytest.approx(128 * gpu.seconds, rel=0.01)
    assert budget.skip_reason(cpu, 1e15, 2.0).startswith("too slow")


def test_configs_and_tokens():
    assert parse_tokens("64, 1,4096,64") == (1, 64, 4096)
    assert CONFIGS["qwen3-30b-a3b"].tokens[-1] == 16384 and CONFIGS["tiny"].tokens == (1, 2, 4, 8, 16, 32, 64, 128,
                                                                                         256)
    assert [c.name for c in get_configs("tiny,mixtral-8x7b")] == ["tiny", "mixtral-8x7b"]
    for bad in ("0,4", "a", ""):
        with pytest.raises(ValueError, match="--tokens"):
            parse_tokens(bad)
    with pytest.raises(ValueError, match="--config"):
        get_configs("llama")


# --- decode crossover ------------------------------------------------------------------------------------------

def _rec(fw, backend, tokens, ms, compiled=False, mode="fwd", config="c", top_k=4):
    """A record of an expert of 3 MiB (H=1024, I=512, bfloat16)."""
    return {"framework": fw, "backend": backend, "tokens": tokens, "ms": ms, "compiled": compiled, "mode": mode,
            "config": config, "top_k": top_k, "hidden": 1024, "intermediate": 512, "dtype": "bfloat16"}


def test_crossover_is_the_end_of_the_leading_batched_wins():
    records = [_rec("torch", "batched_mm", t, ms) for t, ms in ((1, 1.0), (2, 1.0), (4, 2.0), (8, 9.0), (16, 1.0))]
    records += [_rec("torch", "grouped_mm", t, 3.0) for t in (1, 2, 4, 8, 16)]
    records += [_rec("torch", "batched_mm", 8, 0.1, mode="fwd+bwd"), _rec("torch", "eager", 8, 0.1)]
    assert crossover.crossover(records) == {"torch": {"tokens": 4, "slots": 16, "mib": 48.0, "loses_mib": 96.0}}


def test_crossover_takes_each_backends_best_variant():
    records = [_rec("jax", "batched_mm", t, 2.0) for t in (1, 2, 4)]
    records += [_rec("jax", "grouped_mm", t, 3.0) for t in (1, 2, 4)]
    records += [_rec("jax", "grouped_mm", 2, 1.0, compiled=True)]
    records += [_rec("torch", "batched_mm", t, 5.0) for t in (1, 2)] + [_rec("torch", "grouped_mm", t, 1.0)
                                                                       for t in (1, 2)]
    records += [_rec("other", "batched_mm", 1, 1.0)]
    assert crossover.crossover(records) == {"jax": {"tokens": 1, "slots": 4, "mib": 12.0, "loses_mib": 24.0},
                                            "torch": {"tokens": 0, "slots": 0, "mib": 0.0, "loses_mib": 12.0}}


def test_crossover_needs_one_config():
    with pytest.raises(ValueError, match="one config"):
        crossover.crossover([_rec("torch", "batched_mm", 1, 1.0), _rec("torch", "grouped_mm", 1, 1.0, config="d")])


def test_spec_lines_merge_measured_over_current():
    current = {"torch": {"cpu": 0, "cuda": 64}, "jax": {"cpu": 0, "cuda": 64, "tpu": 64}}
    lines = crossover.spec_lines({"torch": {"cuda": 32}, "jax": {"cpu": 8}}, current)
    assert lines == ["[decode.max_gathered_mib]", "torch = { cpu = 0, cuda = 32 }",
                     "jax = { cpu = 8, cuda = 64, tpu = 64 }"]


def test_from_files_takes_the_largest_crossover_below_every_loss(tmp_path):
    """Config a (top-8) wins up to T=8, 192 MiB gathered, with no loss measured; b (top-2) wins up to 12 MiB and
    loses at 24: the threshold is 12 MiB, the largest crossover under every first loss."""
    def write(name, k, tokens):
        records = [_rec("torch", "batched_mm", t, 1.0 if t <= tokens else 5.0, config=name, top_k=k)
                   for t in (1, 2, 4, 8)]
        records += [_rec("torch", "grouped_mm", t, 2.0, config=name, top_k=k) for t in (1, 2, 4, 8)]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"meta": {"device": "X", "device_class": "cuda"}, "records": records}))
        return path

    measured, notes = crossover.from_files([write("a", 8, 8), write("b", 2, 2)])
    assert measured == {"torch": {"cuda": 12}} and len(notes) == 2
    assert crossover.threshold([{"mib": 12.0, "loses_mib": 96.0}, {"mib": 48.0, "loses_mib": None}]) == 48


def test_progress_falls_back_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    bar = progress(2)
    bar.set_description("a")
    bar.update(1)
    bar.write("note")
    bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert "tqdm is not installed" in err and "[2/2] a" in err and "note" in err


def test_profile_reports_each_points_ops(tmp_path, capsys):
    from bench import profile
    from moe_torch import expert_rows

    out = tmp_path / "profile.json"
    assert profile.main(["--device", "cpu", "--config", "tiny", "--tokens", "2", "--modes", "fwd",
                         "--backends", "batched_mm,transformers:grouped_mm", "--calls", "2", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    points = written["points"]
    assert written["meta"]["torch"] and "transformers" in written["meta"]["packages"]
    assert [(p["backend"], p["tokens"], p["mode"]) for p in points] == [("batched_mm", 2, "fwd"),
                                                                      ("transformers:grouped_mm", 2, "fwd")]
    ops = {p["backend"]: {r["op"]: r for r in p["ops"]} for p in points}
    # on the CPU one row-kernel call per projection and call, on the weights in place (where the host has the
    # kernel), else one matmul per slot (2 tokens * top-4) and projection
    if expert_rows.enabled():
        assert ops["batched_mm"][expert_rows.PROFILER_NAME]["count"] == 2 and "aten::mm" not in ops["batched_mm"]
    else:
        assert ops["batched_mm"]["aten::mm"]["count"] == 2 * 2 * 4
    assert "aten::bmm" not in ops["batched_mm"]
    assert "aten::_grouped_mm" in ops["transformers:grouped_mm"] and "aten::bmm" not in ops["transformers:grouped_mm"]
    assert all(p["host_ms"] > 0 for p in points)
    # cProfile's view of the same calls: our entry point among the functions with the most own time
    assert any(f["function"].startswith("api.py:") and f["function"].endswith("(experts_forward)")
               for f in points[0]["python"])
    assert "batched_mm fwd: host" in capsys.readouterr().out


def test_profile_builds_the_compiled_series_where_the_spec_allows(capsys):
    """--compile-mode builds each point as the benchmark's compiled series does (torch.compile ran: dynamo counted a
    frame), skips a backend whose spec does not allow the mode, and names a mode it does not know."""
    from bench import profile
    from torch._dynamo.utils import counters

    counters.clear()
    assert profile.main(["--device", "cpu", "--config", "tiny", "--tokens", "2", "--modes", "fwd", "--backends",
                         "eager,grouped_mm", "--calls", "1", "--compile-mode", "default"]) == 0
    captured = capsys.readouterr()
    assert "skipped eager: not compiled: not fullgraph-compatible" in captured.err
    assert "grouped_mm fwd compiled-default: host" in captured.out and "eager fwd" not in captured.out
    assert "(dynamo's frame " in captured.out
    assert counters["stats"]["unique_graphs"] >= 1
    with pytest.raises(SystemExit, match="--compile-mode: expected off or one of"):
        profile.main(["--device", "cpu", "--config", "tiny", "--compile-mode", "fastest"])


def test_profile_counts_graph_launches_and_graphs_compiled_without_them(tmp_path, monkeypatch, capsys):
    """A profiled point says how many CUDA graphs a call replays and, in a CUDA-graph compile mode, how many of its
    compiled graphs inductor ran without them (the CPU stands in for a device where they apply, as above)."""
    from bench import profile

    monkeypatch.setattr(runners.TorchRunner, "CUDA_GRAPH_DEVICES", ("cpu", "cuda"))
    out = tmp_path / "profile.json"
    assert profile.main(["--device", "cpu", "--config", "tiny", "--tokens", "2", "--modes", "fwd", "--backends",
                         "grouped_mm", "--calls", "1", "--compile-mode", "reduce-overhead", "--out", str(out)]) == 0
    (point,) = json.loads(out.read_text())["points"]
    assert point["graphs"] == 0 and point["cudagraph_skips"] >= 1
    functions = {f["function"]: f for f in point["python"]}
    assert any("eval_frame" in name or "runtime_wrapper" in name or "compile" in name for name in functions)
    assert all(f["own_ms"] >= 0 and f["cum_ms"] >= f["own_ms"] for f in point["python"])
    assert f"{point['cudagraph_skips']} graph(s) compiled without CUDA graphs" in capsys.readouterr().out
    assert profile.graph_launches([{"op": "cudaGraphLaunch", "count": 2.0}, {"op": "aten::mm", "count": 3.0}]) == 2


def test_profile_frame_runs_the_traced_graph_once_then_replays_its_outputs():
    """``frame_ms`` times a compiled forward whose graph ran once: later calls pass dynamo's guards and get the
    first call's outputs back without running the graph."""
    import torch
    from bench import profile

    compiled = torch.compile(lambda x: x * 2, fullgraph=True, dynamic=False, backend=profile.replaying_compiler)
    first = compiled(torch.ones(3))
    again = compiled(torch.full((3,), 5.0))
    assert torch.equal(first, torch.full((3,), 2.0)) and again is first
    from bench.inputs import make_sets, make_weights

    cpu, tiny = torch.device("cpu"), get_configs("tiny")[0]
    runner = runners.TorchRunner(cpu)
    runner.load(make_weights(tiny, torch.float32, cpu, 0), make_sets(tiny, 2, torch.float32, cpu, 0, 2))
    assert profile.frame_ms(runner, "grouped_mm", 2, 3) > 0


def test_profile_guard_check_times_the_compiled_forwards_own_guards():
    """``guard_us`` checks the guards of the forward ``frame_ms`` compiled on that forward's own arguments (they
    pass), and refuses to time a check that fails (another token count fails the tensors' shape guards)."""
    import torch
    from bench import profile
    from bench.inputs import make_sets, make_weights

    cpu, tiny = torch.device("cpu"), get_configs("tiny")[0]
    runner = runners.TorchRunner(cpu)
    weights = make_weights(tiny, torch.float32, cpu, 0)
    for backend in ("grouped_mm", "transformers:batched_mm"):
        runner.load(weights, make_sets(tiny, 2, torch.float32, cpu, 0, 2))
        profile.frame_ms(runner, backend, 2, 3)
        assert 0 < profile.guard_us(runner, backend, checks=100) < 1e4
        runner.load(weights, make_sets(tiny, 3, torch.float32, cpu, 0, 2))
        with pytest.raises(RuntimeError, match="guards fail on its own arguments"):
            profile.guard_us(runner, backend, checks=100)


def test_profile_names_an_unknown_backend():
    from bench import profile

    with pytest.raises(SystemExit, match="--backends: 'nope'"):
        profile.main(["--device", "cpu", "--config", "tiny", "--tokens", "1", "--backends", "nope"])


def test_torch_cuda_clock_gives_event_time_and_host_time(monkeypatch):
    """On CUDA a torch call is timed by CUDA events (``ms``) and on the host's clock (``wall_ms``, as JAX's calls
    are): the host's span holds the events' span."""
    import time
    import torch

    class Event:  # a CUDA event stand-in that stamps the host clock when recorded
        def __init__(self, enable_timing):
            self.stamp = None

        def record(self):
            self.stamp = time.perf_counter()

        def synchronize(self):
            time.sleep(0.001)  # the wait for the device

        def elapsed_time(self, end):
            return (end.stamp - self.stamp) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    runner = runners.TorchRunner(torch.device("cuda"))
    ms, wall, result = runner.clock(lambda i: time.sleep(0.002) or i, 7)
    assert result == 7 and 2 <= ms < wall


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_compiled_series_take_the_weights_as_static_addresses(mode, monkeypatch):
    """Compiled torch series mark the weights (and their gradient leaves) as static addresses, as a model's
    parameters are: the CUDA-graph modes would otherwise copy them into the graph's buffers at every replay."""
    import torch
    from bench.inputs import make_sets, make_weights

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    runner = runners.TorchRunner(torch.device("cpu"))
    config = CONFIGS["tiny"]
    weights = make_weights(config, torch.bfloat16, torch.device("cpu"), seed=0)
    sets = make_sets(config, 4, torch.bfloat16, torch.device("cpu"), seed=0, count=2)
    runner.load(weights, sets)
    uncompiled = runner.build("grouped_mm", mode, None)
    assert not hasattr(weights.gate_up, "_dynamo_static_input_type") and not compiled
    call = runner.build("grouped_mm", mode, "reduce-overhead")
    assert compiled == [{"fullgraph": True, "mode": "reduce-overhead", "dynamic": False}]
    for weight in (weights.gate_up, weights.down, *runner._leaves[0][2:]):
        assert getattr(weight, "_dynamo_static_input_type", None) == "unguarded"
    torch.testing.assert_close(call(1), uncompiled(1))


def test_compiled_series_record_the_graphs_run_without_cuda_graphs(tmp_path, monkeypatch, capsys):
    """A compiled series in a CUDA-graph mode records how many of its graphs inductor ran without CUDA graphs, and
    the summary names it; other series record None. Here the CPU stands in for a device where CUDA graphs apply:
    inductor skips them for CPU tensors and counts each skip."""
    monkeypatch.setattr(runners.TorchRunner, "CUDA_GRAPH_DEVICES", ("cpu", "cuda"))
    argv = ["--config", "tiny", "--tokens", "4", "--device", "cpu", "--out", str(tmp_path), "--frameworks", "torch",
            "--backends", "grouped_mm", "--modes", "fwd", "--compile", "off,on", "--compile-mode",
            "reduce-overhead,default", "--no-peers", "--min-reps", "1", "--max-reps", "1", "--min-time", "0",
            "--sets", "1", "--stream-rounds", "1", "--no-plot"]
    assert main(argv) == 0
    (folder,) = tmp_path.iterdir()
    records = json.loads(_one(folder, ".json").read_text())["records"]
    skips = {r["compile_mode"]: r["cudagraph_skips"] for r in records}
    assert skips[None] is None and skips["default"] is None
    assert skips["reduce-overhead"] >= 1
    assert ("no CUDA graphs tiny torch:grouped_mm:compiled-reduce-overhead:fwd T=4: inductor ran "
            f"{skips['reduce-overhead']} compiled graph(s)") in capsys.readouterr().out


def test_jax_runner_reports_what_a_jitted_call_needs():
    """The memory an out-of-memory skip records for JAX: XLA's analysis of the last jitted call (arguments,
    outputs, temporaries), next to what the device reports holding and the arrays JAX holds."""
    import torch
    from bench.inputs import make_sets, make_weights

    runner = runners.JaxRunner(torch.device("cpu"))
    config = CONFIGS["tiny"]
    runner.load(make_weights(config, torch.bfloat16, torch.device("cpu"), seed=0),
                make_sets(config, 4, torch.bfloat16, torch.device("cpu"), seed=0, count=1))
    assert runner.memory_detail() == {} or "xla_argument_gib" not in runner.memory_detail()
    runner.build("grouped_mm", "fwd+bwd", runners.JIT)
    detail = runner.memory_detail()
    assert {"xla_argument_gib", "xla_output_gib", "xla_temp_gib", "xla_alias_gib"} <= set(detail)
    assert detail["xla_argument_gib"] > 0 and detail["xla_output_gib"] > 0
    gate_up = f"{tuple(runner.gate_up.shape)} {runner.gate_up.dtype}"
    assert detail["jax_live_arrays"] >= 6 and any(a.startswith(gate_up) for a in detail["jax_largest_live"])

def test_jax_jitted_training_call_keeps_only_the_forward_output():
    """A jitted fwd+bwd call hands back the forward output alone (its gradients, outputs of the same executable,
    are dropped at once), so back-to-back calls do not hold a weight-sized gradient each; the executable still
    computes them (XLA's memory analysis counts them as outputs)."""
    import torch
    from bench.inputs import make_sets, make_weights

    runner = runners.JaxRunner(torch.device("cpu"))
    config = CONFIGS["tiny"]
    sets = make_sets(config, 4, torch.bfloat16, torch.device("cpu"), seed=0, count=1)
    runner.load(make_weights(config, torch.bfloat16, torch.device("cpu"), seed=0), sets)
    call = runner.build("grouped_mm", "fwd+bwd", runners.JIT)
    out = call(0)
    assert out.shape == tuple(sets[0].hidden_states.shape)
    forward = runner.build("grouped_mm", "fwd", runners.JIT)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(forward(0)))
    runner.build("grouped_mm", "fwd+bwd", runners.JIT)
    assert runner.memory_detail()["xla_output_gib"] * 2**30 > runner.gate_up.nbytes


def test_rounds_interleave_the_series_and_pool_their_samples(tmp_path, monkeypatch):
    """--rounds 3: every point of a (config, tokens) is timed once per round, the series taking turns (a, b, a, b,
    ...), and its record's median is over all rounds' samples."""
    order, samples = [], {}
    real_measure = runners.Runner.measure

    def measure(self, backend, mode, variant, n_sets, timing):
        m = real_measure(self, backend, mode, variant, n_sets, timing)
        order.append((backend, m.ms[0]))
        fake = [float(len(order))]  # one sample per round: 1, 2, 3, ... in the order timed
        samples.setdefault(backend, []).extend(fake)
        return runners.Measurement(fake, m.peak_mem_gib, m.output, m.run_s, m.stream_ms, m.wall_ms)

    monkeypatch.setattr(runners.Runner, "measure", measure)
    argv = ["--config", "tiny", "--tokens", "2", "--device", "cpu", "--out", str(tmp_path), "--frameworks", "torch",
            "--backends", "eager,grouped_mm", "--modes", "fwd", "--no-peers", "--min-reps", "1", "--max-reps", "1",
            "--min-time", "0", "--sets", "1", "--stream-rounds", "1", "--no-plot"]
    assert main(argv + ["--rounds", "3"]) == 0
    assert [b for b, _ in order] == ["eager", "grouped_mm"] * 3
    (path,) = tmp_path.glob("*/*-tiny.json")
    records = {r["backend"]: r for r in json.loads(path.read_text())["records"]}
    assert {b: r["ms"] for b, r in records.items()} == {b: float(np.median(s)) for b, s in samples.items()}
    assert records["eager"]["ms"] == 3.0 and records["grouped_mm"]["ms"] == 4.0
    with pytest.raises(SystemExit, match="--rounds"):
        main(argv + ["--rounds", "0"])


def test_framework_order_interleaves_the_frameworks_at_each_token_count(tmp_path, monkeypatch):
    """--framework-order interleaved (the CPU's default): at each token count the frameworks' series take turns in
    every round, so a ratio's two points are timed under the same machine state; sequential (the GPU's): every
    point of torch, then every point of JAX. Each point is recorded either way, with its own timings."""
    import torch
    from bench import sweep

    order = []
    real_measure = runners.Runner.measure

    def measure(self, backend, mode, variant, n_sets, timing):
        order.append((self.framework, self.tokens))
        return real_measure(self, backend, mode, variant, n_sets, timing)

    monkeypatch.setattr(runners.Runner, "measure", measure)
    argv = ["--config", "tiny", "--tokens", "2,4", "--device", "cpu", "--frameworks", "torch,jax", "--backends",
            "grouped_mm", "--modes", "fwd", "--no-peers", "--min-reps", "1", "--max-reps", "1", "--min-time", "0",
            "--sets", "1", "--stream-rounds", "1", "--graphed-max-tokens", "0", "--no-plot", "--rounds", "2"]
    expected = {
        None: [("torch", 2), ("jax", 2)] * 2 + [("torch", 4), ("jax", 4)] * 2,
        "sequential": [("torch", 2)] * 2 + [("torch", 4)] * 2 + [("jax", 2)] * 2 + [("jax", 4)] * 2,
    }
    for flag, sequence in expected.items():
        order.clear()
        out = tmp_path / str(flag)
        assert main(argv + ["--out", str(out)] + ([] if flag is None else ["--framework-order", flag])) == 0
        assert order == sequence
        (path,) = out.glob("*/*-tiny.json")
        data = json.loads(path.read_text())
        assert data["meta"]["framework_order"] == (flag or "interleaved")
        assert sorted((r["framework"], r["tokens"]) for r in data["records"]) == sorted(set(sequence))
    with pytest.raises(SystemExit):
        main(argv + ["--framework-order", "random"])
    assert sweep.framework_groups(["torch", "jax"], "interleaved") == [("torch", "jax")]
    assert sweep.default_framework_order(torch.device("cuda")) == "sequential"
    with pytest.raises(ValueError, match="framework_order: expected one of .* got 'both'"):
        sweep.framework_groups(["torch"], "both")


def test_jax_points_on_cpu_run_with_torch_on_one_thread():
    """While a JAX point is built and timed on the CPU, torch is on one thread (its idle OpenMP threads would
    compete with XLA's for the cores), and its thread count is restored afterwards, also when the point fails."""
    import torch
    from bench.inputs import make_sets, make_weights

    runner = runners.JaxRunner(torch.device("cpu"))
    config = CONFIGS["tiny"]
    runner.load(make_weights(config, torch.bfloat16, torch.device("cpu"), seed=0),
                make_sets(config, 4, torch.bfloat16, torch.device("cpu"), seed=0, count=1))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []
    build = runner.build

    def recording_build(*args):
        seen.append(torch.get_num_threads())
        call = build(*args)
        return lambda i: (seen.append(torch.get_num_threads()), call(i))[1]

    runner.build = recording_build
    try:
        timing = runners.Timing(warmup=1, min_reps=2, max_reps=2, min_time=0.0, stream_rounds=1)
        runner.measure("grouped_mm", "fwd", runners.JIT, 1, timing)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
        runner.build = lambda *args: (_ for _ in ()).throw(RuntimeError("a failing point"))
        with pytest.raises(RuntimeError, match="a failing point"):
            runner.measure("grouped_mm", "fwd", runners.JIT, 1, timing)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_graphed_samples_are_the_marginal_time_of_a_call():
    """graphed_ms: (the program of every set's call - the program of set 0's call) / (sets - 1), the two timed in
    turn, one sample per round."""
    clocks = {"all": iter([10.0, 11.0, 13.0]), "one": iter([4.0, 5.0, 4.0])}
    order = []

    def clock(name):
        order.append(name)
        return next(clocks[name])

    samples = runners.marginal_samples(lambda: clock("all"), lambda: clock("one"), 4, 3)
    assert samples == [2.0, 2.0, 3.0] and order == ["all", "one"] * 3


def test_graphed_ms_is_timed_up_to_the_token_limit_for_forward_points(tmp_path):
    """JAX jitted forward points up to --graphed-max-tokens get graphed_ms; larger ones and --graphed-max-tokens 0
    none."""
    argv = ["--config", "tiny", "--tokens", "2,16", "--device", "cpu", "--frameworks", "jax", "--backends",
            "grouped_mm", "--modes", "fwd", "--no-peers", "--min-reps", "1", "--max-reps", "1", "--min-time", "0",
            "--sets", "3", "--stream-rounds", "2", "--no-plot"]
    for limit, expected in (("8", {2: True, 16: False}), ("0", {2: False, 16: False})):
        out = tmp_path / limit
        assert main(argv + ["--out", str(out), "--graphed-max-tokens", limit]) == 0
        (path,) = out.glob("*/*-tiny.json")
        records = json.loads(path.read_text())["records"]
        assert {r["tokens"]: r["graphed_ms"] is not None for r in records} == expected


def test_torch_graphed_captures_the_sets_calls_in_one_cuda_graph_and_set_0s_in_another(monkeypatch):
    """On CUDA an uncompiled series of a backend that declares decode graphs captures its calls over every input
    set in one CUDA graph and set 0's in another, each replay timed by events; a series of a backend without them,
    or compiled, gets none. A peer whose call cannot be captured gets none; ours raise."""
    import torch

    captured, replays = [], []

    class Graph:
        def replay(self):
            replays.append(self)

    class Capture:
        def __init__(self, graph, capture_error_mode):
            self.graph = graph
            assert capture_error_mode == "thread_local"

        def __enter__(self):
            captured.append((self.graph, []))

        def __exit__(self, *exc):
            return False

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):  # the graph of three calls takes 7 ms, the graph of one call 3 ms
            return 7.0 if len(captured[0][1]) == 3 and replays[-1] is captured[0][0] else 3.0

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    runner = runners.TorchRunner(torch.device("cuda"))

    def call(i):
        captured[-1][1].append(i)

    assert runner.graphed("triton", None, call, 3, 2) == [2.0, 2.0]
    assert [calls for _, calls in captured] == [[0, 1, 2], [0]]
    assert runner.graphed("eager", None, call, 3, 2) == []  # its spec entry declares no graphs
    assert runner.graphed("triton", "max-autotune", call, 3, 2) == []

    def failing(i):
        raise RuntimeError("operation not permitted when stream is capturing")

    assert runner.graphed("transformers:grouped_mm", None, failing, 3, 2) == []
    with pytest.raises(RuntimeError, match="capturing"):
        runner.graphed("grouped_mm", None, failing, 3, 2)
