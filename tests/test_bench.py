"""The benchmark harness: one smoke run on the tiny config, the roofline arithmetic, the decode crossover."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from bench import budget, crossover, roofline
from bench.__main__ import main
from bench.configs import CONFIGS, get_configs, parse_tokens
from bench.progress import progress
from bench.report import META_KEYS, RECORD_KEYS
from moe_shared import load_spec

SPEC = load_spec()
RECORD_TYPES = {
    "framework": str, "backend": str, "config": str, "hidden": int, "intermediate": int, "experts": int,
    "top_k": int, "tokens": int, "dtype": str, "mode": str, "compiled": bool, "ms": float, "floor_ms": float,
    "tflops": float, "peak_mem_gib": (float, type(None)), "rel_err": float,
}
META_TYPES = {
    "device": str, "torch": str, "jax": (str, type(None)), "triton": (str, type(None)),
    "commit": (str, type(None)), "date": str, "peak_tflops": float, "peak_tbs": float,
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--config", "tiny", "--tokens", "1,8", "--device", "cpu", "--out", str(out), "--min-reps", "1",
            "--max-reps", "2", "--min-time", "0", "--sets", "2"]
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
    assert meta["errors"] == [] and meta["complete"] is True
    assert set(RECORD_KEYS) == set(RECORD_TYPES)
    frameworks = {r["framework"] for r in records}
    assert "torch" in frameworks
    for fw, reasons in meta["unavailable"].items():
        usable = set(SPEC.backend_names(fw)) - set(reasons)
        assert {r["backend"] for r in records if r["framework"] == fw} == usable
    for r in records:
        assert set(r) == set(RECORD_KEYS)
        for key, kind in RECORD_TYPES.items():
            assert isinstance(r[key], kind) and not (kind is int and isinstance(r[key], bool)), (key, r[key])
        assert r["config"] == "tiny" and r["tokens"] in (1, 8) and r["dtype"] == "bfloat16"
        assert r["mode"] in roofline.MODES
        assert r["ms"] > 0 and r["floor_ms"] > 0 and r["tflops"] > 0
        assert r["rel_err"] <= SPEC.tolerance_for("bfloat16")


def test_smoke_csv_matches_json(smoke):
    records = json.loads(_one(smoke, ".json").read_text())["records"]
    with _one(smoke, ".csv").open() as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == RECORD_KEYS
    assert len(rows) == len(records)
    assert [float(r["ms"]) for r in rows] == pytest.approx([r["ms"] for r in records])


def test_smoke_png(smoke):
    pytest.importorskip("matplotlib")
    assert _one(smoke, ".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_crossover_cli_prints_spec_lines(smoke, capsys):
    assert crossover.main([str(_one(smoke, ".json"))]) == 0
    out = capsys.readouterr().out
    assert "[decode.max_slots]" in out
    assert any(line.startswith("torch = { cpu = ") for line in out.splitlines())


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


def test_budget_skips_batched_mm_that_duplicates_weights():
    peaks = roofline.Peaks(tflops=1000.0, tbs=5.0)
    shape = budget.Shape(CONFIGS["deepseek-v3"], 16384, "fwd", 2)
    gathered = 16384 * 8 * 3 * 7168 * 2048 * 2
    est = budget.estimate("torch", "batched_mm", "cuda", shape, peaks, n_sets=3)
    assert est.memory >= gathered
    assert budget.skip_reason(est, 100 * budget.GIB, 10.0).startswith("too large")
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
    return {"framework": fw, "backend": backend, "tokens": tokens, "ms": ms, "compiled": compiled, "mode": mode,
            "config": config, "top_k": top_k}


def test_crossover_is_the_end_of_the_leading_batched_wins():
    records = [_rec("torch", "batched_mm", t, ms) for t, ms in ((1, 1.0), (2, 1.0), (4, 2.0), (8, 9.0), (16, 1.0))]
    records += [_rec("torch", "grouped_mm", t, 3.0) for t in (1, 2, 4, 8, 16)]
    records += [_rec("torch", "batched_mm", 8, 0.1, mode="fwd+bwd"), _rec("torch", "eager", 8, 0.1)]
    assert crossover.crossover(records) == {"torch": {"tokens": 4, "slots": 16}}


def test_crossover_takes_each_backends_best_variant():
    records = [_rec("jax", "batched_mm", t, 2.0) for t in (1, 2, 4)]
    records += [_rec("jax", "grouped_mm", t, 3.0) for t in (1, 2, 4)]
    records += [_rec("jax", "grouped_mm", 2, 1.0, compiled=True)]
    records += [_rec("torch", "batched_mm", t, 5.0) for t in (1, 2)] + [_rec("torch", "grouped_mm", t, 1.0)
                                                                       for t in (1, 2)]
    records += [_rec("other", "batched_mm", 1, 1.0)]
    assert crossover.crossover(records) == {"jax": {"tokens": 1, "slots": 4}, "torch": {"tokens": 0, "slots": 0}}


def test_crossover_needs_one_config():
    with pytest.raises(ValueError, match="one config"):
        crossover.crossover([_rec("torch", "batched_mm", 1, 1.0), _rec("torch", "grouped_mm", 1, 1.0, config="d")])


def test_spec_lines_merge_measured_over_current():
    current = {"torch": {"cpu": 0, "cuda": 64}, "jax": {"cpu": 0, "cuda": 64, "tpu": 64}}
    lines = crossover.spec_lines({"torch": {"cuda": 32}, "jax": {"cpu": 8}}, current)
    assert lines == ["[decode.max_slots]", "torch = { cpu = 0, cuda = 32 }", "jax = { cpu = 8, cuda = 64, tpu = 64 }"]


def test_from_files_takes_the_smallest_threshold(tmp_path):
    def write(name, k, tokens):
        records = [_rec("torch", "batched_mm", t, 1.0 if t <= tokens else 5.0, config=name, top_k=k)
                   for t in (1, 2, 4, 8)]
        records += [_rec("torch", "grouped_mm", t, 2.0, config=name, top_k=k) for t in (1, 2, 4, 8)]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"meta": {"device": "X", "device_class": "cuda"}, "records": records}))
        return path

    measured, notes = crossover.from_files([write("a", 8, 8), write("b", 2, 2)])
    assert measured == {"torch": {"cuda": 4}} and len(notes) == 2


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
