"""The shared contract: spec, reference, test vectors, switching semantics. Imports neither framework."""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from moe_shared import ArrayInfo, check_arguments, load_spec, reference, relative_l2
from moe_shared.switching import apply_request, auto_backend, expert_bytes, summarize
from moe_shared.vectors import MANIFEST, VECTORS_DIR, load_cases
from moe_shared.vectors.generate import generate

ROOT = Path(__file__).resolve().parents[1]


def test_shared_imports_neither_framework():
    import subprocess
    code = ("import sys, moe_shared, moe_shared.reference, moe_shared.switching, moe_shared.registry, "
            "moe_shared.requirements, moe_shared.contiguous_layout, moe_shared.vectors.generate; "
            "bad = [m for m in ('torch', 'jax') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_spec_tolerances_and_backends():
    spec = load_spec()
    assert spec.tolerance_for("float32") <= 1e-5
    assert spec.tolerance_for("float16") <= 5e-3
    assert spec.tolerance_for("bfloat16") <= 2e-2
    assert set(spec.activations) == {"silu", "gelu", "relu"}
    for name in ("eager", "batched_mm", "grouped_mm"):
        assert {"torch", "jax"} <= set(spec.backends[name].frameworks)
    assert spec.backends["grouped_mm"].support("torch").compile.fullgraph
    assert not spec.backends["eager"].support("torch").compile.fullgraph
    with pytest.raises(ValueError, match="ragged_dot.*torch"):
        spec.backends["ragged_dot"].support("torch")
    with pytest.raises(ValueError, match="float64"):
        spec.tolerance_for("float64")


# --- the reference itself -------------------------------------------------------------------------------------

def _small_problem(seed=0, activation="silu", bias=True):
    rng = np.random.default_rng(seed)
    T, H, I, E, k = 5, 6, 4, 3, 2
    idx = np.array([[0, 2], [1, -1], [2, 2], [-1, -1], [0, 1]])
    args = dict(hidden_states=rng.standard_normal((T, H)), top_k_index=idx,
                top_k_weights=rng.random((T, k)), gate_up_proj=rng.standard_normal((E, 2 * I, H)),
                down_proj=rng.standard_normal((E, H, I)))
    if bias:
        args |= dict(gate_up_bias=rng.standard_normal((E, 2 * I)), down_bias=rng.standard_normal((E, H)))
    return args, rng.standard_normal((T, H))


def _loss(args, dy, activation):
    return float(np.sum(reference.experts_forward(**args, activation=activation) * dy))


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_reference_gradients_match_finite_differences(activation):
    args, dy = _small_problem(activation=activation)
    grads = reference.experts_backward(**args, grad_output=dy, activation=activation)
    eps = 1e-6
    for name, g in grads.items():
        numeric = np.zeros_like(g)
        for i in np.ndindex(g.shape):
            plus = {k: v.copy() for k, v in args.items()}
            minus = {k: v.copy() for k, v in args.items()}
            plus[name][i] += eps
            minus[name][i] -= eps
            numeric[i] = (_loss(plus, dy, activation) - _loss(minus, dy, activation)) / (2 * eps)
        assert relative_l2(g, numeric) < 1e-6, name


def test_reference_forward_matches_per_token_loop():
    args, _ = _small_problem()
    out = reference.experts_forward(**args)
    x, idx, w = args["hidden_states"], args["top_k_index"], args["top_k_weights"]
    I = args["down_proj"].shape[2]
    expected = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(idx[t]):
            if e < 0:
                continue
            a = args["gate_up_proj"][e] @ x[t] + args["gate_up_bias"][e]
            h = a[:I] / (1 + np.exp(-a[:I])) * a[I:]
            expected[t] += w[t, j] * (args["down_proj"][e] @ h + args["down_bias"][e])
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_reference_rejects_out_of_range_ids():
    args, _ = _small_problem()
    args["top_k_index"] = args["top_k_index"].copy()
    args["top_k_index"][0, 0] = 3
    with pytest.raises(ValueError, match=r"top_k_index: expected expert ids in \[-1, 3\)"):
        reference.experts_forward(**args)


# --- argument checks (framework-neutral part) ------------------------------------------------------------------

def _infos(T=4, H=6, I=3, E=2, k=2, dtype="float32"):
    return dict(hidden_states=ArrayInfo((T, H), dtype), top_k_index=ArrayInfo((T, k), "int64"),
                top_k_weights=ArrayInfo((T, k), dtype), gate_up_proj=ArrayInfo((E, 2 * I, H), dtype),
                down_proj=ArrayInfo((E, H, I), dtype))


def test_check_arguments_returns_dims():
    dims = check_arguments(**_infos())
    assert (dims.T, dims.H, dims.I, dims.E, dims.k, dims.N, dims.slots) == (4, 6, 3, 2, 2, 6, 8)


@pytest.mark.parametrize("arg, bad, pattern", [
    ("hidden_states", ArrayInfo((4, 6, 1), "float32"), r"hidden_states: expected a 2-D array \[T, H\], got shape"),
    ("hidden_states", ArrayInfo((4, 6), "float64"), r"hidden_states: expected dtype in .*got dtype float64"),
    ("top_k_index", ArrayInfo((4, 2), "float32"), r"top_k_index: expected dtype in \['int32', 'int64'\]"),
    ("top_k_index", ArrayInfo((5, 2), "int64"), r"top_k_index: expected shape \[T, k\] = \(4, \?\), got shape \(5, 2\)"),
    ("top_k_weights", ArrayInfo((4, 3), "float32"), r"top_k_weights: expected shape \[T, k\] = \(4, 2\)"),
    ("gate_up_proj", ArrayInfo((2, 6, 5), "float32"), r"gate_up_proj: expected shape \[E, 2I, H\] = \(\?, \?, 6\)"),
    ("gate_up_proj", ArrayInfo((2, 7, 6), "float32"), r"gate_up_proj: expected shape \[E, 2I, H\] = \(2, 6, 6\)"),
    ("down_proj", ArrayInfo((3, 6, 3), "float32"), r"down_proj: expected shape \[E, H, I\] = \(2, 6, \?\)"),
    ("down_proj", ArrayInfo((2, 6, 3), "bfloat16"), r"down_proj: expected the dtype of gate_up_proj \(float32\)"),
    ("gate_up_bias", ArrayInfo((2, 5), "float32"), r"gate_up_bias: expected shape \[E, 2I\] = \(2, 6\)"),
    ("down_bias", ArrayInfo((2, 6), "float16"), r"down_bias: expected the dtype of the weights"),
])
def test_check_arguments_names_argument_expected_and_got(arg, bad, pattern):
    infos = _infos() | {arg: bad}
    with pytest.raises(ValueError, match=pattern):
        check_arguments(**infos)


def test_check_arguments_activation():
    with pytest.raises(ValueError, match=r"activation: expected one of \['silu', 'gelu', 'relu'\]"):
        check_arguments(**_infos(), activation="swish")
    infos = _infos() | {"gate_up_proj": ArrayInfo((2, 5, 6), "float32")}
    assert check_arguments(**infos, activation=lambda h: h).N == 5  # a custom gate takes any first width


# --- test vectors ----------------------------------------------------------------------------------------------

def test_vectors_regenerate_byte_identical(tmp_path):
    generate(tmp_path)
    for entry in json.loads(MANIFEST.read_text())["cases"]:
        assert (tmp_path / entry["file"]).read_bytes() == (VECTORS_DIR / entry["file"]).read_bytes(), entry["file"]
    assert (tmp_path / "manifest.json").read_text() == MANIFEST.read_text()


def test_vectors_manifest_hashes_and_size():
    manifest = json.loads(MANIFEST.read_text())
    total = 0
    for entry in manifest["cases"]:
        data = (VECTORS_DIR / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], entry["file"]
        total += len(data)
    assert total < 2 * 2**20
    assert sorted(p.name for p in VECTORS_DIR.glob("*.npz")) == sorted(e["file"] for e in manifest["cases"])


def test_vectors_cover_the_contract():
    cases = load_cases()
    assert {c.dtype for c in cases} == {"float32", "bfloat16", "float16"}
    for dtype in ("float32", "bfloat16", "float16"):
        mine = [c for c in cases if c.dtype == dtype]
        assert {0, 1, 7, 64} <= {c.T for c in mine}
        assert {"silu", "gelu", "relu"} == {c.activation for c in mine}
        assert {True, False} == {c.bias for c in mine}
        assert any(c.k == 1 for c in mine) and any(c.k == c.E for c in mine)
        assert any((c.inputs["top_k_index"] == -1).any() for c in mine)
        assert any(c.T and (c.inputs["top_k_index"] == 0).any(axis=1).all() for c in mine)  # one expert, every token
        assert any(c.T and len(set(range(c.E)) - set(c.inputs["top_k_index"].ravel())) for c in mine)  # idle experts
        assert any(c.H % 8 and c.I % 8 for c in mine)


def test_vectors_expected_values_are_the_reference():
    for case in load_cases()[::5]:
        args = case.inputs
        out = reference.experts_forward(**args, activation=case.activation)
        np.testing.assert_array_equal(out.astype(np.float32), case.expected["out"])


# --- switching semantics -------------------------------------------------------------------------------------

def test_apply_request_semantics():
    current = {"text.0": "grouped_mm", "text.1": "grouped_mm", "vision": "eager"}
    assert apply_request(current, "batched_mm") == dict.fromkeys(current, "batched_mm")
    assert apply_request(current, {"vision": "batched_mm"}) == current | {"vision": "batched_mm"}
    assert apply_request(current, {"": "eager", "text.1": "batched_mm"}) == {
        "text.0": "eager", "text.1": "batched_mm", "vision": "eager"}
    assert apply_request(current, {"text": "batched_mm", "": None}) == current | {
        "text.0": "batched_mm", "text.1": "batched_mm"}
    with pytest.raises(ValueError, match="key 'audio' names no experts module"):
        apply_request(current, {"audio": "eager"})
    with pytest.raises(ValueError, match="key 'tex' names no experts module"):
        apply_request(current, {"tex": "eager"})  # a key is a whole dotted name, not a string prefix
    with pytest.raises(ValueError, match="name_or_dict: expected a backend name or a dict"):
        apply_request(current, 3)


def test_summarize_round_trips():
    current = {"text.0": "grouped_mm", "vision": "eager"}
    snapshot = summarize(current)
    assert snapshot == {"": None, "text.0": "grouped_mm", "vision": "eager"}
    assert apply_request(dict.fromkeys(current, "batched_mm"), snapshot) == current
    assert summarize({"a": "eager", "b": "eager"})[""] == "eager"
    assert summarize({"": "batched_mm"}) == {"": "batched_mm"}


def test_auto_backend_reads_the_spec_threshold():
    """batched_mm while T*k times one expert's weights is at most the threshold (MiB), whatever the expert size."""
    spec = load_spec()
    assert auto_backend("jax", "cpu", 1, 1) == ("batched_mm" if spec.decode_threshold("jax", "cpu") else "grouped_mm")
    limit = spec.decode_threshold("jax", "cuda") * 2**20
    assert limit > 0
    qwen3 = expert_bytes((128, 1536, 2048), (128, 2048, 768), 2)  # 9 MiB
    mixtral = expert_bytes((8, 28672, 4096), (8, 4096, 14336), 2)  # 336 MiB
    assert (qwen3, mixtral) == (9 * 2**20, 336 * 2**20)
    for one in (qwen3, mixtral, 1000):
        slots = limit // one
        assert auto_backend("jax", "cuda", slots, one) == "batched_mm"
        assert auto_backend("jax", "cuda", slots + 1, one) == "grouped_mm"


def test_readme_tables_are_rendered_from_the_spec():
    from moe_shared.tables import TABLES, render_into
    readme = (ROOT / "README.md").read_text()
    assert render_into(readme) == readme, "run: python -m moe_shared.tables --write README.md"
    for name in TABLES:
        assert f"<!-- spec:{name} -->" in readme
    import dataclasses
    changed = dataclasses.replace(load_spec(), tolerance={"float32": 3e-6})
    assert render_into(readme, changed) != readme  # a stale table would be caught


def test_registry_checks_requirements_as_declared():
    from moe_shared.registry import BackendRegistry
    from moe_shared.spec import FrameworkSupport, Requirements
    registry = BackendRegistry("torch")
    hopper = FrameworkSupport("torch", ("cuda",), ("bfloat16",), (), Requirements(compute_capability=(9, 0)))
    registry.register("hopper_only", lambda *a, **k: None, capability=hopper)
    registry.register("undeclared", lambda *a, **k: None)
    kw = dict(device_class="cuda", where="cuda:0", dtype="bfloat16")
    registry.check("hopper_only", **kw, compute_capability=(9, 0))
    with pytest.raises(RuntimeError, match=r"needs CUDA compute capability >= 9.0, got 8.0 on cuda:0"):
        registry.check("hopper_only", **kw, compute_capability=(8, 0))
    with pytest.raises(RuntimeError, match=r"runs on \['cuda'\], got a cpu tensor"):
        registry.check("hopper_only", device_class="cpu", where="a cpu tensor", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"supports dtypes \['bfloat16'\], got dtype float32"):
        registry.check("hopper_only", **kw | {"dtype": "float32"}, compute_capability=(9, 0))
    registry.check("undeclared", device_class="tpu", where="tpu", dtype="float64")  # nothing declared to check
    reasons = registry.availability(lambda name, dtype: registry.check(name, **kw, compute_capability=(8, 6)))
    assert reasons["undeclared"] is None and "compute capability" in reasons["hopper_only"]
    registry.unregister("undeclared")
    assert "undeclared" not in registry
    with pytest.raises(ValueError, match="expected one of the registered torch backends"):
        registry["undeclared"]


def test_spec_backend_level_defaults_and_distributions():
    """Keys at the backend level are defaults of each framework entry (tables merged); requires.abi names a
    distribution of [distributions]; training and multiples parse; other requires keys are kept as described."""
    from moe_shared.spec import parse_spec
    raw = {"contract": {"activations": ["silu"], "dtypes": ["bfloat16"], "index_dtypes": ["int32"], "empty_slot": -1},
           "tolerance": {"bfloat16": 0.02},
           "distributions": {"wheel": {"package": "wheel_mod", "framework": "torch", "builds": {"1.0": ["2.11"]}}},
           "backends": {"b": {"description": "d", "devices": ["cuda"], "dtypes": ["bfloat16"], "training": False,
                              "multiples": {"H": 64}, "layout": {"group_alignment": 128},
                              "requires": {"packages": {"wheel_mod": "x"}, "nvcc": {"9.0": [12, 3]}, "abi": "wheel",
                                           "group": "a process group"},
                              "torch": {"requires": {"packages": {"torch": "y"}}},
                              "jax": {"dtypes": ["float32"], "jit": True}}}}
    b = parse_spec(raw).backends["b"]
    torch_support, jax_support = b.support("torch"), b.support("jax")
    assert dict(torch_support.requires.packages) == {"wheel_mod": "x", "torch": "y"}
    assert dict(jax_support.requires.packages) == {"wheel_mod": "x"} and jax_support.dtypes == ("float32",)
    assert torch_support.requires.nvcc == {(9, 0): (12, 3)} and not torch_support.training
    assert torch_support.requires.abi == {"distribution": "wheel", "package": "wheel_mod", "framework": "torch",
                                          "builds": {"1.0": ["2.11"]}}
    assert dict(torch_support.requires.other) == {"group": "a process group"}
    assert dict(torch_support.multiples) == {"H": 64} and torch_support.details["layout"] == {"group_alignment": 128}
    assert parse_spec(raw).trainers("torch") == ()
