"""moe_torch: every backend against every shared vector, the registry, bad inputs, switching, compile."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_torch
from moe_shared.registry import UnknownBackendError
from moe_shared.spec import FrameworkSupport, Requirements
from moe_torch import Experts, ExpertsInterface, decode_mode, experts_forward
from moe_torch import get_experts_implementation, set_experts_implementation
from moe_torch.backends import grouped_mm as grouped_mm_backend
from moe_shared import relative_l2
from support import (BAD_INPUT_IDS, BAD_INPUTS, CASES, DIFF_ARGS, SPEC, assert_close, case_id, cpu_backends,
                     good_arrays, random_case)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = cpu_backends("torch")


def to_torch(arrays: dict, dtype: str, requires_grad=False) -> dict[str, torch.Tensor]:
    out = {}
    for name, a in arrays.items():
        t = torch.from_numpy(np.ascontiguousarray(a))
        if name != "top_k_index":
            t = t.to(DTYPES[dtype]).requires_grad_(requires_grad)
        out[name] = t
    return out


def run(tensors, backend, activation="silu", grad_output=None, **kw):
    out = experts_forward(**tensors, implementation=backend, activation=activation, **kw)
    grads = {}
    if grad_output is not None:
        out.backward(grad_output)
        grads = {n: (t.grad if t.grad is not None else torch.zeros_like(t)) for n, t in tensors.items()
                 if n in DIFF_ARGS}
    return out, grads


def test_registry_holds_the_spec_backends():
    assert set(SPEC.backend_names("torch")) <= set(ExpertsInterface)
    assert all(ExpertsInterface.capability(n) is SPEC.backends[n].support("torch") for n in SPEC.backend_names("torch"))
    assert isinstance(ExpertsInterface["grouped_mm"], type(lambda: 0))


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_vectors_forward_and_gradients(backend, case):
    tensors = to_torch(case.inputs, case.dtype, requires_grad=True)
    dy = to_torch({"g": case.grad_output}, case.dtype)["g"]
    out, grads = run(tensors, backend, case.activation, grad_output=dy)
    assert out.dtype == DTYPES[case.dtype] and out.shape == (case.T, case.H)
    assert_close("out", out.detach().float(), case.expected["out"], case.dtype)
    for name, g in grads.items():
        assert_close(f"grad_{name}", g.float(), case.expected[f"grad_{name}"], case.dtype)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_vectors_through_grouped_mm_training_step(case, monkeypatch):
    """Every shared vector through grouped_mm's one-node training step (CUDA's way, here on the CPU): T=0, empty
    slots and idle experts included; biases and gate callables keep the composed path."""
    monkeypatch.setattr(grouped_mm_backend, "TRAINING_STEP_DEVICES", ("cpu",))
    tensors = to_torch(case.inputs, case.dtype, requires_grad=True)
    dy = to_torch({"g": case.grad_output}, case.dtype)["g"]
    out, grads = run(tensors, "grouped_mm", case.activation, grad_output=dy)
    one_node = isinstance(case.activation, str) and "gate_up_bias" not in case.inputs
    assert (type(out.grad_fn).__name__ == "_TrainingStepBackward") == one_node
    assert_close("out", out.detach().float(), case.expected["out"], case.dtype)
    for name, g in grads.items():
        assert_close(f"grad_{name}", g.float(), case.expected[f"grad_{name}"], case.dtype)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """Same values, other strides: a view into a larger buffer with a step of 2 on every axis and transposed
    storage order."""
    big = torch.zeros(tuple(2 * s + 1 for s in t.shape), dtype=t.dtype)
    view = big[tuple(slice(1, None, 2) for _ in t.shape)]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_strided_inputs_match_contiguous(backend, dtype):
    arrays, dy = random_case(1, T=9, H=16, I=8, E=4, k=2, bias=True, empty_fraction=0.2)
    plain = to_torch(arrays, dtype)
    strided = {n: _strided(t) for n, t in plain.items()}
    transposed = {n: (t.mT.contiguous().mT if t.dim() >= 2 else t) for n, t in plain.items()}
    expected = experts_forward(**plain, implementation=backend)
    per_token = ("hidden_states", "top_k_index", "top_k_weights")
    for variant in (strided, transposed):
        only_tokens = plain | {n: variant[n] for n in per_token}
        torch.testing.assert_close(experts_forward(**only_tokens, implementation=backend), expected, rtol=0, atol=0)
        err = relative_l2(experts_forward(**variant, implementation=backend).float(), expected.float())
        assert err <= (1e-6 if dtype == "float32" else SPEC.tolerance_for(dtype) / 4), err


# --- bad inputs ------------------------------------------------------------------------------------------------

def _good(dtype="float32"):
    return to_torch(good_arrays(), dtype)


@pytest.mark.parametrize("arg, reshape, dtype, pattern", BAD_INPUTS, ids=BAD_INPUT_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_name_the_argument(backend, arg, reshape, dtype, pattern):
    arrays = good_arrays()
    tensors = to_torch(arrays | {arg: reshape(arrays[arg])}, "float32")
    if dtype:
        tensors[arg] = tensors[arg].to(getattr(torch, dtype))
    with pytest.raises(ValueError, match=pattern):
        experts_forward(**tensors, implementation=backend)


@pytest.mark.parametrize("arg, make_bad, pattern", [
    ("hidden_states", lambda t: t.double(), r"hidden_states: expected dtype in .* got dtype float64"),
    ("hidden_states", lambda t: t.numpy(), r"hidden_states: expected a torch.Tensor, got ndarray"),
    ("top_k_weights", lambda t: t.to("meta"), r"top_k_weights: expected a tensor on cpu .*got one on meta"),
])
def test_bad_tensors(arg, make_bad, pattern):
    tensors = _good()
    tensors[arg] = make_bad(tensors[arg])
    with pytest.raises(ValueError, match=pattern):
        experts_forward(**tensors)


@pytest.mark.parametrize("bad_id", [3, 7, -2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_ids(backend, bad_id):
    tensors = _good()
    tensors["top_k_index"][1, 0] = bad_id
    with pytest.raises(ValueError, match=r"top_k_index: expected expert ids in \[-1, 3\)"):
        experts_forward(**tensors, implementation=backend)
    # unchecked (as on accelerators): the slot is empty, and nothing reads out of bounds
    out = experts_forward(**tensors, implementation=backend, validate=False)
    tensors["top_k_index"][1, 0] = -1
    torch.testing.assert_close(out, experts_forward(**tensors, implementation=backend), rtol=0, atol=0)


def test_unknown_backend_lists_registered_names():
    with pytest.raises(ValueError, match=r"implementation: expected one of the registered torch backends "
                                         r"\['batched_mm', 'deepgemm', 'deepgemm_megamoe', 'eager', 'grouped_mm'"
                                         r".*got 'fast'"):
        experts_forward(**_good(), implementation="fast")
    with pytest.raises(UnknownBackendError):
        Experts(2, 4, 2, experts_implementation="fast")
    assert "fast" not in ExpertsInterface


def test_unknown_activation():
    with pytest.raises(ValueError, match=r"activation: expected one of \['silu', 'gelu', 'relu'\]"):
        experts_forward(**_good(), activation="tanh")


def test_requirements_are_errors_not_fallbacks():
    calls = []
    fn = lambda *a, **kw: calls.append(1)
    missing_pkg = FrameworkSupport("torch", ("cpu",), ("float32",), (),
                                   Requirements(packages={"surely_not_installed_pkg": "gpu-kernels"}))
    gpu_only = dataclasses.replace(missing_pkg, devices=("cuda",), requires=Requirements())
    fp32_only = dataclasses.replace(missing_pkg, requires=Requirements())
    try:
        ExpertsInterface.register("needs_pkg", fn, capability=missing_pkg)
        ExpertsInterface.register("needs_gpu", fn, capability=gpu_only)
        ExpertsInterface.register("fp32_only", fn, capability=fp32_only)
        with pytest.raises(ImportError, match=r"pip install 'moe-experts\[gpu-kernels\]'"):
            experts_forward(**_good(), implementation="needs_pkg")
        with pytest.raises(RuntimeError, match=r"implementation 'needs_gpu' runs on \['cuda'\], got a tensor on cpu"):
            experts_forward(**_good(), implementation="needs_gpu")
        with pytest.raises(ValueError, match=r"gate_up_proj: implementation 'fp32_only' supports dtypes "
                                             r"\['float32'\], got dtype bfloat16"):
            experts_forward(**_good("bfloat16"), implementation="fp32_only")
        assert not calls
        reasons = moe_torch.available_backends("cpu")
        assert reasons["grouped_mm"] is None and "surely_not_installed_pkg" in reasons["needs_pkg"]
    finally:
        for name in ("needs_pkg", "needs_gpu", "fp32_only"):
            ExpertsInterface.unregister(name)


def test_registered_backend_is_dispatched():
    seen = []

    def mine(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *, activation, gate_up_bias,
             down_bias):
        seen.append(activation)
        return torch.full_like(hidden_states, 3.0)

    ExpertsInterface.register("mine", mine)
    try:
        out = experts_forward(**_good(), implementation="mine", activation="relu")
        assert seen == ["relu"] and torch.all(out == 3.0)
        model = Experts(3, 8, 4, experts_implementation="mine")
        assert torch.all(model(*(_good()[n] for n in ("hidden_states", "top_k_index", "top_k_weights"))) == 3.0)
    finally:
        ExpertsInterface.unregister("mine")
    with pytest.raises(ValueError, match="fn: expected a callable"):
        ExpertsInterface.register("x", 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_gate_callable(backend):
    arrays, _ = random_case(3, T=6, H=8, I=4, E=3, k=2, bias=True)
    tensors = to_torch(arrays, "float32")
    tensors["gate_up_proj"] = tensors["gate_up_proj"][:, :4]  # no gate: an up projection only, N = I
    tensors["gate_up_bias"] = tensors["gate_up_bias"][:, :4]
    out = experts_forward(**tensors, implementation=backend, activation=torch.tanh)
    x, idx, w = tensors["hidden_states"], tensors["top_k_index"], tensors["top_k_weights"]
    expected = torch.zeros_like(x)
    for t in range(6):
        for j in range(2):
            e = idx[t, j]
            u = torch.tanh(tensors["gate_up_proj"][e] @ x[t] + tensors["gate_up_bias"][e])
            expected[t] += w[t, j] * (tensors["down_proj"][e] @ u + tensors["down_bias"][e])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# --- which kernel ran -----------------------------------------------------------------------------------------

def _ops_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_grouped_mm_uses_the_native_kernel_when_aligned(dtype, monkeypatch):
    monkeypatch.setenv("MOE_TORCH_ROW_KERNEL", "off")  # bfloat16 at few rows per expert takes the row kernel
    tensors = to_torch(random_case(4, T=16, H=32, I=16, E=4, k=2, bias=False)[0], dtype)
    ops = _ops_run(lambda: experts_forward(**tensors, implementation="grouped_mm"))
    assert "aten::_grouped_mm" in ops and "moe_torch::grouped_mm_loop" not in ops


def test_grouped_mm_falls_back_to_the_loop_op_when_unaligned(monkeypatch):
    monkeypatch.setenv("MOE_TORCH_ROW_KERNEL", "off")
    tensors = to_torch(random_case(4, T=16, H=18, I=10, E=4, k=2, bias=False)[0], "bfloat16")
    ops = _ops_run(lambda: experts_forward(**tensors, implementation="grouped_mm"))
    assert "moe_torch::grouped_mm_loop" in ops and "aten::_grouped_mm" not in ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K, N", [(16, 8), (18, 10), (32, 24), (8, 12), (20, 12)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_native_predicate_agrees_with_the_op(dtype, K, N, layout):
    a = torch.randn(10, K, dtype=dtype)
    w = torch.randn(3, N, K, dtype=dtype) if layout == "contiguous" else torch.randn(3, K, N, dtype=dtype).mT
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    loop = grouped_mm_backend.grouped_mm_loop(a, w, offs)
    if grouped_mm_backend.native_supported(a, w):
        native = torch.nn.functional.grouped_mm(a, w.transpose(1, 2), offs=offs)
        torch.testing.assert_close(native.float(), loop.float(), rtol=1e-2, atol=1e-2)
    else:
        with pytest.raises(RuntimeError):
            torch.nn.functional.grouped_mm(a, w.transpose(1, 2), offs=offs)


# --- the module and switching -----------------------------------------------------------------------------------

def test_experts_module_parameters_and_forward():
    m = Experts(4, 8, 6, activation="gelu", bias=True, dtype=torch.bfloat16)
    assert dict((n, tuple(p.shape)) for n, p in m.named_parameters()) == {
        "gate_up_proj": (4, 12, 8), "down_proj": (4, 8, 6), "gate_up_bias": (4, 12), "down_bias": (4, 8)}
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert m.gate_up_proj.abs().max() <= 8 ** -0.5 and m.down_proj.abs().max() <= 6 ** -0.5
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    idx = torch.randint(0, 4, (5, 2))
    w = torch.rand(5, 2, dtype=torch.bfloat16)
    for backend in BACKENDS:
        m.experts_implementation = backend
        torch.testing.assert_close(m(x, idx, w), experts_forward(
            x, idx, w, m.gate_up_proj, m.down_proj, activation="gelu", gate_up_bias=m.gate_up_bias,
            down_bias=m.down_bias, implementation=backend), rtol=0, atol=0)
    assert set(Experts(2, 4, 2).state_dict()) == {"gate_up_proj", "down_proj"}
    with pytest.raises(ValueError, match="hidden_size: expected a positive int, got 0"):
        Experts(2, 0, 2)
    with pytest.raises(ValueError, match="activation: expected one of"):
        Experts(2, 4, 2, activation="swish")


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.text = torch.nn.ModuleList([Experts(2, 4, 2), Experts(2, 4, 2)])
        self.vision = Experts(2, 4, 2, experts_implementation="eager")


def test_set_and_get_experts_implementation():
    model = _Model()
    assert get_experts_implementation(model) == {"": None, "text.0": "grouped_mm", "text.1": "grouped_mm",
                                                 "vision": "eager"}
    snapshot = get_experts_implementation(model)
    set_experts_implementation(model, "batched_mm")
    assert get_experts_implementation(model) == {"": "batched_mm", "text.0": "batched_mm",
                                                 "text.1": "batched_mm", "vision": "batched_mm"}
    set_experts_implementation(model, {"vision": "eager"})
    assert model.vision.experts_implementation == "eager" and model.text[0].experts_implementation == "batched_mm"
    set_experts_implementation(model, {"": "grouped_mm", "text.1": "eager"})
    assert [m.experts_implementation for m in (model.text[0], model.text[1], model.vision)] == [
        "grouped_mm", "eager", "grouped_mm"]
    set_experts_implementation(model, snapshot)
    assert get_experts_implementation(model) == snapshot
    with pytest.raises(ValueError, match="implementation: expected one of the registered"):
        set_experts_implementation(model, {"text": "nope"})
    assert get_experts_implementation(model) == snapshot  # nothing applied
    with pytest.raises(ValueError, match="key 'audio' names no experts module"):
        set_experts_implementation(model, {"audio": "eager"})
    with pytest.raises(ValueError, match="model: expected a module holding moe_torch.Experts"):
        set_experts_implementation(torch.nn.Linear(2, 2), "eager")
    single = Experts(2, 4, 2)
    set_experts_implementation(single, {"": "eager"})
    assert get_experts_implementation(single) == {"": "eager"}


def test_decode_mode_keeps_grouped_on_cpu():
    model = _Model()
    before = get_experts_implementation(model)
    with decode_mode(model) as m:
        assert m is model and get_experts_implementation(model) == before


def test_decode_mode_switches_where_the_threshold_is_positive(monkeypatch):
    import moe_torch.modules as modules
    accel = dataclasses.replace(SPEC, decode_max_gathered_mib={"torch": {"cpu": 64}})  # CPU treated as an accelerator
    monkeypatch.setattr(modules, "_SPEC", accel)
    model = _Model()
    set_experts_implementation(model, {"text.1": "batched_mm"})
    before = get_experts_implementation(model)
    with decode_mode(model):
        assert get_experts_implementation(model) == {"": None, "text.0": "batched_mm", "text.1": "batched_mm",
                                                     "vision": "eager"}
    assert get_experts_implementation(model) == before
    with pytest.raises(KeyError):
        with decode_mode(model):
            assert model.text[0].experts_implementation == "batched_mm"
            raise KeyError("boom")
    assert get_experts_implementation(model) == before


# --- torch.compile ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("dtype, H, I", [("float32", 16, 8), ("bfloat16", 16, 8), ("float32", 18, 10)])
def test_compile_fullgraph(backend, dtype, H, I):
    torch._dynamo.reset()
    arrays, dy = random_case(5, T=8, H=H, I=I, E=4, k=2, bias=True, empty_fraction=0.2)
    tensors = to_torch(arrays, dtype, requires_grad=True)
    fn = torch.compile(lambda **kw: experts_forward(**kw, implementation=backend), fullgraph=True)
    out = fn(**tensors)
    out.backward(to_torch({"g": dy}, dtype)["g"])
    compiled_grads = {n: t.grad.clone() for n, t in tensors.items() if n in DIFF_ARGS}
    fresh = to_torch(arrays, dtype, requires_grad=True)
    expected, grads = run(fresh, backend, grad_output=to_torch({"g": dy}, dtype)["g"])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, expected, **tol)
    for n, g in grads.items():
        torch.testing.assert_close(compiled_grads[n], g, **tol)


def _compiled_guards(fn, *args, dynamic=False) -> str:
    """The guards dynamo keeps for ``fn`` compiled (eager backend) on ``args``, as dynamo prints them."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="eager")(*args)
    return str(_debug_get_cache_entry_list(fn.__code__)[0].guard_manager)


@pytest.mark.parametrize("backend", ["batched_mm", "grouped_mm"])
def test_compiled_argument_checks_leave_no_guards(backend, monkeypatch):
    """Compiled with static shapes, the argument checks run once as a constant: none of the contract's or the spec's
    objects is guarded at every call; traced as plain code (the control), they are."""
    import moe_torch.api as api

    arrays, _ = random_case(2, T=4, H=16, I=8, E=4, k=2, bias=False)
    t = to_torch(arrays, "float32")
    args = (t["hidden_states"], t["top_k_index"], t["top_k_weights"])

    def forward(x, index, weights):
        return experts_forward(x, index, weights, t["gate_up_proj"], t["down_proj"], implementation=backend)

    with torch.no_grad():
        assert "moe_shared_dot_contract" not in _compiled_guards(forward, *args)
        assert "moe_shared_dot_contract" in _compiled_guards(forward, *args, dynamic=True)  # symbolic shapes
        monkeypatch.setattr(api, "_check_as_constant", lambda *a: None)
        assert "moe_shared_dot_contract" in _compiled_guards(forward, *args)


@pytest.mark.parametrize("fullgraph, raised", [(False, ValueError), (True, torch._dynamo.exc.Unsupported)])
def test_compiled_bad_arguments_raise_as_in_eager(fullgraph, raised):
    """A bad argument under torch.compile raises the eager error (dynamo falls back to eager code), or, with
    fullgraph, dynamo's error for an exception in the traced code: the checks' constant form changes neither."""
    arrays, _ = random_case(2, T=3, H=16, I=8, E=4, k=2, bias=False)
    t = to_torch(arrays, "float32")
    down = torch.randn(4, 16, 9)  # I = 9 against gate_up_proj's 2I = 16
    fn = torch.compile(lambda x, i, w: experts_forward(x, i, w, t["gate_up_proj"], down, implementation="batched_mm"),
                       fullgraph=fullgraph, dynamic=False)
    torch._dynamo.reset()
    with pytest.raises(raised) as caught:
        fn(t["hidden_states"], t["top_k_index"], t["top_k_weights"])
    if raised is ValueError:
        assert str(caught.value).startswith("gate_up_proj: expected shape [E, 2I, H]")


@pytest.mark.parametrize("backend", ["batched_mm", "grouped_mm"])
def test_compile_fullgraph_dynamic_shapes(backend):
    """With symbolic sizes (dynamic=True) the checks are traced as plain code: new token counts run without a
    recompile-time error and match eager."""
    torch._dynamo.reset()
    arrays, _ = random_case(3, T=5, H=16, I=8, E=4, k=2, bias=False)
    t = to_torch(arrays, "float32")
    fn = torch.compile(lambda x, i, w: experts_forward(x, i, w, t["gate_up_proj"], t["down_proj"],
                                                       implementation=backend), fullgraph=True, dynamic=True)
    for T in (5, 3, 7):
        x, index, weights = (t[n][:T] if T <= 5 else torch.cat([t[n], t[n][:T - 5]])
                             for n in ("hidden_states", "top_k_index", "top_k_weights"))
        with torch.no_grad():
            expected = experts_forward(x, index, weights, t["gate_up_proj"], t["down_proj"], implementation=backend)
            torch.testing.assert_close(fn(x, index, weights), expected, rtol=1e-5, atol=1e-5)


# --- against transformers' own experts module --------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_transformers_qwen3_moe_experts(backend, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    hf = Qwen3MoeExperts(config).to(DTYPES[dtype])
    with torch.no_grad():
        hf.gate_up_proj.normal_(0, 0.2), hf.down_proj.normal_(0, 0.2)
    x = torch.randn(11, 32, dtype=DTYPES[dtype])
    logits = torch.randn(11, 6)
    w, idx = torch.topk(logits.softmax(-1), 2)
    expected = hf(x, idx, w.to(DTYPES[dtype]))
    ours = Experts(6, 32, 16, experts_implementation=backend, dtype=DTYPES[dtype])
    ours.load_state_dict(hf.state_dict())
    out = ours(x, idx, w.to(DTYPES[dtype]))
    err = (out.double() - expected.double()).norm() / expected.double().norm()
    assert err <= SPEC.tolerance_for(dtype), f"{err:.2e}"


class _PoisonedGroupedLinear(torch.autograd.Function):
    """The grouped matmul with NaN in every row past offs[-1], forward and input gradient: what a native kernel may
    leave there (uninitialized memory)."""

    @staticmethod
    def forward(ctx, a, w, offs):
        ctx.save_for_backward(a, w, offs)
        y = grouped_mm_backend.grouped_mm_loop(a, w, offs)
        return y.masked_fill((torch.arange(a.shape[0]) >= offs[-1])[:, None], float("nan"))

    @staticmethod
    def backward(ctx, grad):
        a, w, offs = ctx.saved_tensors
        grad_a, grad_w = grouped_mm_backend.grouped_mm_loop_backward(grad.contiguous(), a, w, offs)
        return grad_a.masked_fill((torch.arange(a.shape[0]) >= offs[-1])[:, None], float("nan")), grad_w, None


@pytest.mark.parametrize("case", [c for c in CASES if (c.inputs["top_k_index"] == -1).any()], ids=case_id)
def test_grouped_mm_is_exact_whatever_the_rows_past_the_offsets_hold(case, monkeypatch):
    monkeypatch.setattr(grouped_mm_backend, "grouped_linear", _PoisonedGroupedLinear.apply)
    tensors = to_torch(case.inputs, case.dtype, requires_grad=True)
    out, grads = run(tensors, "grouped_mm", case.activation,
                     grad_output=to_torch({"g": case.grad_output}, case.dtype)["g"])
    assert_close("out", out.detach().float(), case.expected["out"], case.dtype)
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        assert_close(f"grad_{name}", g.float(), case.expected[f"grad_{name}"], case.dtype)


# --- deterministic backward -------------------------------------------------------------------------------------

def _grouped_mm_fwd_bwd(arrays, dy, dtype):
    tensors = to_torch(arrays, dtype, requires_grad=True)
    return run(tensors, "grouped_mm", grad_output=to_torch({"g": dy}, dtype)["g"])


@pytest.mark.parametrize("rows_zero", [False, True], ids=["any-rows", "rows-zero"])
@pytest.mark.parametrize("empty", [False, True])
@pytest.mark.parametrize("large", [False, True], ids=["one-sum", "k-steps"])
def test_combine_has_the_bits_of_masking_first(empty, large, rows_zero):
    """Both combines give the bits of masking the empty slots' rows and weights first, then one float32 product and
    one sum over k: large inputs through k multiply-adds into float32 token rows (no [T*k, H] temporary), small ones
    through one product whose empty rows are zeroed in place (no copy of the rows or the weights to mask them);
    rows of empty slots count as zero whatever they hold, and with ``empty_rows_zero`` (the caller zeroed them)
    only the weights, whatever they hold, are masked."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_torch.base import Slots, combine

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    T, k, H, E = (160, 4, 256, 8) if large else (9, 4, 32, 8)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, E, (T, k), generator=g)
    if empty:
        ids[::3, 1] = -1
    y = torch.randn(T * k, H, generator=g).bfloat16()
    y[ids.reshape(-1) < 0] = 0 if rows_zero else float("nan")
    w = torch.rand(T, k, generator=g).bfloat16()
    w[ids < 0] = float("inf")
    valid = (ids >= 0).reshape(-1, 1)
    expected = (torch.where(valid, y.float(), 0).view(T, k, H) * torch.where(valid.view(T, k), w, 0).float()[..., None])
    expected = expected.sum(1).bfloat16()
    slots = Slots(ids, E)
    with torch.no_grad(), Ops() as ops:
        got = combine(y, slots, w, torch.bfloat16, empty_rows_zero=rows_zero)
    assert (T * k * H > 2**17) == large  # which path
    assert torch.equal(got, expected)
    if not large and not rows_zero:
        assert not any(n.startswith(("aten.clone", "aten.masked_fill.")) for n in ops.names), ops.names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_mm_backward_gives_the_same_bits_every_run(dtype):
    arrays, dy = random_case(12, T=33, H=16, I=8, E=5, k=3, bias=True, empty_fraction=0.2)
    out, grads = _grouped_mm_fwd_bwd(arrays, dy, dtype)
    again, grads_again = _grouped_mm_fwd_bwd(arrays, dy, dtype)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(grads_again[name], g, rtol=0, atol=0, msg=name)


class _AccumulatingOps(TorchDispatchMode):
    """Records the name of every aten op run, and apart from them the ones that add into a tensor at indices
    (atomics on CUDA)."""

    ALWAYS = {"index_add", "scatter_add", "scatter_reduce", "embedding_dense_backward", "_embedding_bag_backward"}
    WITH_ACCUMULATE = {"index_put", "_index_put_impl", "_unsafe_index_put", "put"}  # argument 3: accumulate

    def __init__(self):
        super().__init__()
        self.ops, self.accumulating = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__.rstrip("_")
        self.ops.append(name)
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if name in self.ALWAYS or (name in self.WITH_ACCUMULATE and accumulate):
            self.accumulating.append(str(func))
        return func(*args, **kwargs)


@pytest.fixture
def deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("H, I", [(16, 8), (18, 10)])  # the native grouped_mm and the loop op
def test_grouped_mm_backward_runs_no_accumulating_scatter(dtype, H, I, deterministic_algorithms):
    arrays, dy = random_case(13, T=17, H=H, I=I, E=4, k=2, bias=True, empty_fraction=0.2)
    tensors = to_torch(arrays, dtype, requires_grad=True)
    out = experts_forward(**tensors, implementation="grouped_mm")
    with _AccumulatingOps() as recorder:
        out.backward(to_torch({"g": dy}, dtype)["g"])
    assert "_grouped_mm" in recorder.ops or "grouped_mm_loop_backward" in recorder.ops  # the mode saw the backward
    assert recorder.accumulating == []
    assert all(torch.isfinite(t.grad).all() for n, t in tensors.items() if n in DIFF_ARGS)  # empty memory is NaN


def test_compiled_grouped_mm_backward_has_no_atomics():
    from torch._inductor.utils import run_and_get_code

    arrays, dy = random_case(14, T=9, H=16, I=8, E=4, k=2, bias=True, empty_fraction=0.2)
    tensors = to_torch(arrays, "bfloat16", requires_grad=True)
    fn = torch.compile(lambda **kw: experts_forward(**kw, implementation="grouped_mm"), fullgraph=True)
    _, (forward_code, backward_code) = run_and_get_code(
        lambda: fn(**tensors).backward(to_torch({"g": dy}, "bfloat16")["g"]))
    assert "atomic_add" not in forward_code and "atomic_add" not in backward_code


# --- batched_mm's weight gradient -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_mm_k_grouped_weight_grad_matches_the_reference(dtype, monkeypatch):
    """The CUDA weight gradient (one K-grouped F.grouped_mm over the slots sorted by expert), run on the CPU: an idle
    expert, empty slots and biases against the float64 reference, with no accumulating scatter for the weights and,
    in eager mode, no custom-op dispatch around it."""
    from moe_shared import reference

    monkeypatch.setattr(grouped_mm_backend, "K_GROUPED_DEVICES", ("cpu",))
    idle = 4
    for bias in (False, True):
        arrays, dy = random_case(15, T=21, H=16, I=8, E=9, k=2, bias=bias, empty_fraction=0.2)
        arrays["top_k_index"] = np.where(arrays["top_k_index"] == idle, -1, arrays["top_k_index"])
        tensors = to_torch(arrays, dtype, requires_grad=True)
        out = experts_forward(**tensors, implementation="batched_mm")
        with _AccumulatingOps() as recorder:
            out.backward(to_torch({"g": dy}, dtype)["g"])
        assert recorder.ops.count("_grouped_mm") == 2  # one K-grouped matmul per weight (the loop runs none)
        assert "grouped_weight_grad" not in recorder.ops  # eager: the function, not the custom op's dispatch
        assert bias or recorder.accumulating == []  # (the biases' row gathers add their gradients at indices)
    expected = reference.experts_backward(**arrays, grad_output=dy)
    for name in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias", "hidden_states", "top_k_weights"):
        assert_close(f"grad_{name}", tensors[name].grad.float(), expected[name], dtype)
    assert not tensors["gate_up_proj"].grad[idle].any() and not tensors["down_proj"].grad[idle].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, K", [(16, 8), (10, 18), (24, 32)])
def test_k_grouped_predicate_agrees_with_the_op(dtype, N, K):
    grad, a = torch.randn(10, N, dtype=dtype), torch.randn(10, K, dtype=dtype)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    loop = grouped_mm_backend.grouped_weight_grad(grad, a, offs, 3)
    if grouped_mm_backend.k_grouped_supported(grad, a):
        native = torch.nn.functional.grouped_mm(grad.t(), a, offs=offs)
        torch.testing.assert_close(native.float(), loop.float(), rtol=1e-2, atol=1e-2)
    else:
        with pytest.raises(RuntimeError):
            torch.nn.functional.grouped_mm(grad.t(), a, offs=offs)


def test_batched_mm_k_grouped_weight_grad_compiles(monkeypatch):
    """The CUDA backward compiles: the K-grouped weight gradient stays inside its opaque op (inductor once laid the
    transposed rows out with a 20-byte stride there, T*k = 10, which F.grouped_mm refuses), and the input gradient's
    grouped matmul lowers."""
    from moe_torch.backends import batched_mm

    monkeypatch.setattr(grouped_mm_backend, "K_GROUPED_DEVICES", ("cpu",))
    monkeypatch.setattr(batched_mm, "SORTED_INPUT_GRAD", ("cpu",))
    arrays, dy = random_case(16, T=5, H=16, I=8, E=4, k=2, bias=False)
    eager = to_torch(arrays, "bfloat16", requires_grad=True)
    compiled = to_torch(arrays, "bfloat16", requires_grad=True)
    g = to_torch({"g": dy}, "bfloat16")["g"]
    torch._dynamo.reset()
    fn = torch.compile(lambda **kw: experts_forward(**kw, implementation="batched_mm"), fullgraph=True)
    fn(**compiled).backward(g)
    experts_forward(**eager, implementation="batched_mm").backward(g)
    for name in ("gate_up_proj", "down_proj", "hidden_states"):
        assert relative_l2(compiled[name].grad.float().numpy(), eager[name].grad.float().numpy()) < 1e-2, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_mm_sorted_backward_matches_the_reference(dtype, monkeypatch):
    """The CUDA backward (input and weight gradients as grouped matmuls over the slots sorted by expert, no
    gathered weights), run on the CPU: every gradient against the float64 reference, and no gather of weights."""
    from moe_shared import reference
    from moe_torch.backends import batched_mm

    monkeypatch.setattr(batched_mm, "SORTED_INPUT_GRAD", ("cpu",))
    monkeypatch.setattr(grouped_mm_backend, "K_GROUPED_DEVICES", ("cpu",))
    arrays, dy = random_case(17, T=19, H=16, I=8, E=7, k=3, bias=True, empty_fraction=0.2)
    arrays["top_k_index"] = np.where(arrays["top_k_index"] == 2, -1, arrays["top_k_index"])  # an idle expert
    tensors = to_torch(arrays, dtype, requires_grad=True)
    out = experts_forward(**tensors, implementation="batched_mm")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out.backward(to_torch({"g": dy}, dtype)["g"])
    counts = {e.key: e.count for e in prof.key_averages()}
    assert "aten::index" not in counts and counts.get("aten::_grouped_mm") == 4  # no weight gather; 2 per projection
    expected = reference.experts_backward(**arrays, grad_output=dy)
    for name in expected:
        assert_close(f"grad_{name}", tensors[name].grad.float(), expected[name], dtype)


@pytest.mark.parametrize("trained", [("hidden_states",), ("gate_up_bias",), ("down_proj",), ("top_k_weights",),
                                     ("hidden_states", "gate_up_proj", "down_proj", "top_k_weights")],
                         ids=lambda t: "+".join(t))
def test_batched_mm_sorts_once_for_both_projections(trained, monkeypatch):
    """The CUDA backward path (run on the CPU) sorts the slots once per call when a projection's
    backward needs them (not for the routing weights' gradient alone), and the gradients match the reference."""
    from moe_shared import reference
    from moe_torch.backends import batched_mm

    monkeypatch.setattr(batched_mm, "SORTED_INPUT_GRAD", ("cpu",))
    monkeypatch.setattr(grouped_mm_backend, "K_GROUPED_DEVICES", ("cpu",))
    arrays, dy = random_case(18, T=13, H=16, I=8, E=5, k=3, bias=True, empty_fraction=0.2)
    tensors = to_torch(arrays, "float32")
    for name in trained:
        tensors[name].requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        experts_forward(**tensors, implementation="batched_mm").backward(to_torch({"g": dy}, "float32")["g"])
    sorts = 0 if trained == ("top_k_weights",) else 1
    assert {e.key: e.count for e in prof.key_averages()}.get("aten::sort", 0) == sorts
    expected = reference.experts_backward(**arrays, grad_output=dy)
    for name in trained:
        assert_close(f"grad_{name}", tensors[name].grad, expected[name], "float32")


_TRAINED_SETS = [("hidden_states",), ("top_k_weights",), ("down_proj",), ("gate_up_proj", "top_k_weights"),
                 ("hidden_states", "gate_up_proj", "down_proj", "top_k_weights")]


@pytest.mark.parametrize("trained", _TRAINED_SETS, ids=lambda t: "+".join(t))
@pytest.mark.parametrize("path", ["in-place", "gathered", "cuda-sorted"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_mm_training_step_is_one_node_with_the_composed_bits(trained, path, dtype, monkeypatch):
    """Training with a named activation runs as one autograd node whose inputs' gradients go straight to them, and
    gives the bits of the composed path (each step recorded by autograd) in the forward and every gradient: on the
    CPU's path (one matmul per slot on the weights in place, nothing gathered), with the weights gathered (the
    path inductor fuses on the CPU), and on the CUDA one (gathered; sorted input gradients, K-grouped weight
    gradients); empty slots and an idle expert included."""
    from moe_torch import base
    from moe_torch.backends import batched_mm

    if path != "in-place":
        monkeypatch.setattr(batched_mm, "IN_PLACE_DEVICES", ())
    if path == "cuda-sorted":
        monkeypatch.setattr(batched_mm, "SORTED_INPUT_GRAD", ("cpu",))
        monkeypatch.setattr(grouped_mm_backend, "K_GROUPED_DEVICES", ("cpu",))
    def forward(tensors, fused):
        if fused:
            return experts_forward(**tensors, implementation="batched_mm")
        slots = base.Slots(tensors.pop("top_k_index"), tensors["down_proj"].shape[0])
        return batched_mm._composed_forward(tensors["hidden_states"], slots, tensors["top_k_weights"],
                                            tensors["gate_up_proj"], tensors["down_proj"], "silu", None, None)
    _one_node_has_the_composed_bits(19, dtype, trained, forward)


def _one_node_has_the_composed_bits(seed, dtype, trained, forward):
    """``forward(tensors, fused)`` with ``fused`` (one node, whose inputs' gradients go straight to them) and without:
    the same output and gradients bit for bit, empty slots and an idle expert included; the fused run's results."""
    arrays, dy = random_case(seed, T=11, H=16, I=12, E=6, k=3, bias=False, empty_fraction=0.2)
    arrays["top_k_index"] = np.where(arrays["top_k_index"] == 4, -1, arrays["top_k_index"])
    results = []
    for fused in (True, False):
        tensors = to_torch(arrays, dtype)
        for name in trained:
            tensors[name].requires_grad_()
        out = forward(dict(tensors), fused)
        assert (type(out.grad_fn).__name__ == "_TrainingStepBackward") == fused
        if fused:
            leaves = {type(fn).__name__ for fn, _ in out.grad_fn.next_functions if fn is not None}
            assert leaves == {"AccumulateGrad"}, leaves
        out.backward(to_torch({"g": dy}, dtype)["g"])
        results.append([out.detach()] + [tensors[name].grad for name in trained])
    for fused, composed in zip(*results):
        np.testing.assert_array_equal(fused.float().numpy(), composed.float().numpy())
    return arrays, dy, results[0]


@pytest.mark.parametrize("trained", _TRAINED_SETS, ids=lambda t: "+".join(t))
@pytest.mark.parametrize("k_grouped", [False, True], ids=["loop-weight-grad", "k-grouped-weight-grad"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_mm_training_step_is_one_node_with_the_composed_bits(trained, k_grouped, dtype, monkeypatch):
    """On the devices of TRAINING_STEP_DEVICES (CUDA; here the CPU), grouped_mm's training with a named activation
    runs as one autograd node whose inputs' gradients go straight to them, with the bits of the composed path in
    the forward and every gradient: the weight gradients by the per-expert loop and as one K-grouped matmul; empty
    slots and an idle expert included. With the CPU row kernel off: on, the step runs its matmuls on the kernel
    (the composed path's are differentiated by autograd, so they cannot), whose sums may differ in the last bit."""
    from moe_shared import reference
    from moe_torch.backends import grouped_mm

    monkeypatch.setenv("MOE_TORCH_ROW_KERNEL", "off")
    monkeypatch.setattr(grouped_mm, "K_GROUPED_DEVICES", ("cpu",) if k_grouped else ())

    def forward(tensors, fused):
        with monkeypatch.context() as devices:
            devices.setattr(grouped_mm, "TRAINING_STEP_DEVICES", ("cpu",) if fused else ())
            return experts_forward(**tensors, implementation="grouped_mm")
    arrays, dy, fused = _one_node_has_the_composed_bits(23, dtype, trained, forward)
    expected = reference.experts_backward(**arrays, grad_output=dy)
    for name in trained:
        assert_close(f"grad_{name}", fused[1 + trained.index(name)].float(), expected[name], dtype)


def test_compiled_batched_mm_on_the_cpu_fuses_the_gather_into_its_products():
    """Compiled on the CPU, batched_mm's per-slot products are one gathered-weights bmm per projection whatever the
    size (here 20 MB of weights gathered, which compiled calls once split into bmms of 4 MB), which inductor fuses with
    the gather into GEMV loops reading each slot's expert weights in place: the generated code, forward and
    training, calls no bmm kernel (no gathered [T*k, N, K] buffer), and the results are within the tolerance table."""
    from torch._inductor.utils import run_and_get_code
    from moe_shared import reference

    arrays, dy = random_case(29, T=40, H=256, I=128, E=8, k=4, bias=False, empty_fraction=0.1)
    expected = reference.experts_forward(**arrays)
    grads = reference.experts_backward(**arrays, grad_output=dy)
    tensors = to_torch(arrays, "bfloat16")
    graphs = []

    def recording_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(lambda **kw: experts_forward(**kw, implementation="batched_mm"), fullgraph=True,
                      backend=recording_backend)(**tensors)
    (graph,) = graphs
    assert sum(node.target in (torch.bmm, torch.ops.aten.bmm.default) for node in graph.graph.nodes) == 2
    trained = ("hidden_states", "top_k_weights", "gate_up_proj", "down_proj")
    for name in trained:
        tensors[name].requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(lambda **kw: experts_forward(**kw, implementation="batched_mm"), fullgraph=True)

    def step():
        out = compiled(**tensors)
        out.backward(to_torch({"g": dy}, "bfloat16")["g"])
        return out

    out, codes = run_and_get_code(step)
    assert len(codes) == 2 and all("cpp_fused" in code for code in codes)  # the forward's graph and the backward's
    assert not any("bmm" in line for code in codes for line in code.splitlines() if "extern_kernels" in line)
    assert_close("out", out.detach().float(), expected, "bfloat16")
    for name in trained:
        assert_close(f"grad_{name}", tensors[name].grad.float(), grads[name], "bfloat16")


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_gate_backward_gives_autograds_bits(activation):
    """The gate's own backward ([dg, du] in one buffer) gives the bits of autograd through act(g) * u."""
    from moe_torch.base import ACTIVATIONS, gate

    h = (torch.randn(37, 2 * 24) * 3).bfloat16()
    grad = torch.randn(37, 24).bfloat16()
    ours, theirs = h.clone().requires_grad_(), h.clone().requires_grad_()
    out = gate(activation, ours, 24)
    out.backward(grad)
    reference_out = ACTIVATIONS[activation](theirs[:, :24]) * theirs[:, 24:]
    reference_out.backward(grad)
    np.testing.assert_array_equal(out.detach().float().numpy(), reference_out.detach().float().numpy())
    np.testing.assert_array_equal(ours.grad.float().numpy(), theirs.grad.float().numpy())


# --- host path: ops per call ----------------------------------------------------------------------------------------

def _top_level_ops(fn) -> list[str]:
    """The aten ops ``fn`` calls directly (not those they call in turn): what a decode step pays the dispatcher for."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    ops = []
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if event.name.startswith("aten::") and parent is None:
            ops.append(event.name)
    return ops


@pytest.mark.parametrize("backend, budget", [("batched_mm", 32), ("grouped_mm", 36)])
def test_decode_forward_op_budget(backend, budget, monkeypatch):
    """An inference forward on the path every CUDA call takes (no host check for empty slots: they are masked)
    calls at most ``budget`` aten ops, masks with masked_fill (a scalar where() fills a 0-dim tensor first: a
    kernel more on CUDA) and gathers back by writing rows (no inverse permutation)."""
    from moe_torch import base
    from moe_torch.backends import batched_mm
    monkeypatch.setattr(base.Slots, "_all_valid", lambda self: False)
    monkeypatch.setattr(batched_mm, "IN_PLACE_DEVICES", ())  # CUDA's path: the gathered weights
    arrays, _ = random_case(3, T=4, H=16, I=8, E=6, k=2, bias=False, empty_fraction=0.25)
    tensors = to_torch(arrays, "bfloat16")
    with torch.no_grad():
        ops = _top_level_ops(lambda: experts_forward(**tensors, implementation=backend, validate=False))
    assert len(ops) <= budget, sorted(ops)
    assert "aten::where" not in ops and "aten::scatter_" not in ops, sorted(ops)
    if backend == "batched_mm":  # the weights' gather is the first kernel after the clamp; the empty-slot mask last
        between = ops[ops.index("aten::clamp") + 1: ops.index("aten::index")]
        assert set(between) <= {"aten::to", "aten::select", "aten::view"}, between  # no kernels: views, a no-op cast
        assert ops.index("aten::ne") > ops.index("aten::bmm"), ops


@pytest.mark.parametrize("vectorized", [True, False], ids=["one-sum", "k-steps"])
def test_combine_gives_the_same_bits_with_and_without_autograd(vectorized, monkeypatch):
    """The combine's forward under autograd is the inference one (one product and one sum, or k multiply-adds past
    VECTORIZED_COMBINE_MAX), empty slots zero whatever their rows and weights hold."""
    from moe_torch import base

    if not vectorized:
        monkeypatch.setitem(base.VECTORIZED_COMBINE_MAX, "cpu", 0)
    monkeypatch.setattr(base.Slots, "_all_valid", lambda self: False)
    T, k, H, E = 9, 8, 32, 6
    ids = torch.randint(0, E, (T, k))
    ids[::3, 2] = -1
    slots = base.Slots(ids, E)
    y = torch.randn(T * k, H).bfloat16()
    y[slots.empty] = float("nan")
    w = torch.rand(T, k)
    w[ids < 0] = float("inf")
    plain = base.combine(y, slots, w, torch.float32)  # float32 out: every bit of the sums shows
    trained = base.combine(y.clone().requires_grad_(), slots, w.clone().requires_grad_(), torch.float32)
    assert torch.isfinite(plain.float()).all()
    np.testing.assert_array_equal(trained.detach().float().numpy(), plain.float().numpy())


def test_argument_and_requirement_checks_run_once_per_signature(monkeypatch):
    """The argument checks and the backend's requirement checks depend only on the call's signature (backend,
    activation, shapes, dtypes, devices): done at its first call, skipped on the next; a failing check is never
    remembered, so it raises at every call."""
    from moe_torch import api
    calls = []
    real = api.check_requirements
    monkeypatch.setattr(api, "check_requirements", lambda *args: calls.append(args) or real(*args))
    monkeypatch.setattr(api, "_CHECKED", {})
    arrays, _ = random_case(4, T=3, H=8, I=4, E=3, k=2, bias=False)
    tensors = to_torch(arrays, "float32")
    for _ in range(3):
        experts_forward(**tensors, implementation="eager")
    assert len(calls) == 1
    experts_forward(**tensors, implementation="grouped_mm")
    experts_forward(**(tensors | {"hidden_states": tensors["hidden_states"][:2],
                                  "top_k_index": tensors["top_k_index"][:2],
                                  "top_k_weights": tensors["top_k_weights"][:2]}), implementation="eager")
    assert len(calls) == 3

    def missing(*args):
        raise ImportError("a package is missing")

    monkeypatch.setattr(api, "check_requirements", missing)
    for _ in range(2):
        with pytest.raises(ImportError, match="missing"):
            experts_forward(**tensors, implementation="batched_mm")


@pytest.mark.parametrize("kernel", [True, False], ids=["weight-grads-kernel", "per-expert-mm"])
@pytest.mark.parametrize("pages", ["small", "fresh", "reused"])
def test_loop_weight_gradient_zeroes_every_idle_expert_and_multiplies_the_others(pages, kernel, monkeypatch):
    """The CPU weight gradient (one moe_weight_grads call where the library takes it, which zeroes the idle experts
    itself, else a per-expert loop) leaves every idle expert zero (runs at the start, between active ones and at the
    end) and gives each active expert grad[rows].T @ a[rows]: the K-grouped F.grouped_mm's bits. On a small buffer
    (written zeros), on fresh pages of its own, and on pages reused from a freed buffer that held NaN."""
    import torch.nn.functional as F

    from moe_torch import base, expert_rows
    from moe_torch.backends.grouped_mm import grouped_weight_grad
    if kernel and not expert_rows.weight_grads_apply(torch.zeros(10, 8, dtype=torch.bfloat16),
                                                     torch.zeros(10, 16, dtype=torch.bfloat16), 12):
        pytest.skip("moe_weight_grads does not take these rows on this host (AMX: WEIGHT_GRADS_MEAN_ROWS 0)")
    if not kernel:
        monkeypatch.setattr(expert_rows, "weight_grads_apply", lambda *args: False)
    monkeypatch.setattr(base, "_PAGES", base._PagePool(1 << 20))
    if pages != "small":
        monkeypatch.setattr(base, "FRESH_PAGES_FROM_BYTES", 0)
    if pages == "reused":
        stale, zeros = base.cpu_buffer(torch.empty(0, dtype=torch.bfloat16), 12, 8, 16)
        assert zeros
        stale.fill_(float("nan"))
        del stale
        assert base._PAGES.bytes == 12 * 8 * 16 * 2
    counts = torch.tensor([0, 0, 3, 0, 1, 2, 0, 0, 0, 4, 0, 0], dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    grad, a = torch.randn(10, 8, generator=g).bfloat16(), torch.randn(10, 16, generator=g).bfloat16()
    got = grouped_weight_grad(grad, a, offs, 12)
    assert base._PAGES.bytes == 0  # the reused buffer is the one taken
    assert torch.equal(got[counts == 0], torch.zeros(8, 8, 16, dtype=torch.bfloat16))
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            assert torch.equal(got[e], (grad[start:end].float().T @ a[start:end].float()).bfloat16())
        start = end
    if hasattr(F, "grouped_mm"):
        assert torch.equal(got, F.grouped_mm(grad.t(), a, offs=offs))


def test_cpu_buffers_lie_on_pages_of_their_own_kept_for_reuse_once_freed(monkeypatch):
    """cpu_buffer: a large CPU buffer on fresh pages reads as zeros; its pages go back to the pool only when its last
    tensor (a view included) is freed, and the next buffer of that size gets them as they were (not zeros); the pool
    keeps no more than its bytes; small buffers and other sizes never come from it."""
    from moe_torch import base
    shape = (8, 1024, 256)  # 4 MB in bfloat16: the smallest size on pages of its own
    nbytes = math.prod(shape) * 2
    assert nbytes == base.FRESH_PAGES_FROM_BYTES
    monkeypatch.setattr(base, "_PAGES", base._PagePool(nbytes))
    like = torch.empty(0, dtype=torch.bfloat16)
    first, zeros = base.cpu_buffer(like, *shape)
    assert zeros and first.shape == shape and first.dtype == torch.bfloat16 and first.is_contiguous()
    assert not first.any()
    first.fill_(3)
    address, view = first.data_ptr(), first[2:]
    del first
    second, zeros = base.cpu_buffer(like, *shape)  # the view keeps the first one's pages
    assert zeros and second.data_ptr() != address and not second.any()
    del view
    assert base._PAGES.bytes == nbytes
    other, zeros = base.cpu_buffer(like, 8, 1024, 512)  # another size: fresh pages
    assert zeros and not other.any() and _mapped(other.data_ptr())
    other_address = other.data_ptr()
    again, zeros = base.cpu_buffer(like, *shape)
    assert not zeros and again.data_ptr() == address and (again == 3).all()
    del second, other  # the pool keeps one 4 MB buffer, the second one's; the larger one is unmapped
    assert base._PAGES.bytes == nbytes and list(base._PAGES.free) == [nbytes]
    assert not _mapped(other_address)
    small, zeros = base.cpu_buffer(like, 4, 5)
    assert not zeros and small.shape == (4, 5) and base._PAGES.bytes == nbytes


def test_cpu_grouped_linear_keeps_torchs_backward_bits_with_its_own_weight_gradient():
    """Differentiated on the CPU, grouped_mm's native grouped matmul takes its weight gradient from the per-expert
    loop (on huge pages): the input and weight gradients are F.grouped_mm's own autograd's bits."""
    import torch.nn.functional as F

    counts = torch.tensor([0, 3, 0, 0, 5, 1, 0], dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    g = torch.Generator().manual_seed(6)
    a = torch.randn(9, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(7, 24, 32, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(9, 24, generator=g).bfloat16()
    out = grouped_mm_backend.grouped_linear(a, w, offs)
    assert type(out.grad_fn).__name__ == "_NativeGroupedLinearBackward"
    ours = torch.autograd.grad(out, (a, w), dy)
    theirs = torch.autograd.grad(F.grouped_mm(a, w.transpose(1, 2), offs=offs), (a, w), dy)
    assert all(torch.equal(x, y) for x, y in zip(ours, theirs))
    assert not ours[1][counts == 0].any()


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(part, 16) for part in line.split()[0].split("-"))
        if low <= address < high:
            return True
    return False


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` (/proc/self/smaps)."""
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(v, 16) for v in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_large_cpu_buffers_are_marked_for_huge_pages(monkeypatch):
    """With MOE_EXPERTS_HUGE_PAGES=1, cpu_buffer asks for transparent huge pages on the whole 2 MB pages inside a
    large fresh buffer (and on nothing under HUGE_PAGES_FROM_BYTES); where the OS has them, the touched buffer then
    lies in huge pages. With 0, and by default, it asks for nothing."""
    import mmap

    from moe_torch import base

    like = torch.empty(0, dtype=torch.bfloat16)
    real = base._madvise()
    calls = []

    def recorded(*args):
        calls.append(args)
        return real(*args) if real is not None else 0

    monkeypatch.setattr(base, "_madvise", lambda: recorded)
    monkeypatch.setattr(base, "_PAGES", base._PagePool(0))  # fresh pages every time
    monkeypatch.setenv("MOE_EXPERTS_HUGE_PAGES", "1")
    small, _ = base.cpu_buffer(like, 4, 1024, 2047)  # under native.HUGE_PAGES_FROM_BYTES
    big, _ = base.cpu_buffer(like, 8, 1024, 2048)
    assert small.shape == (4, 1024, 2047) and big.shape == (8, 1024, 2048) and big.dtype == torch.bfloat16
    assert len(calls) == 1
    start, length, advice = calls[0]
    huge = 2 << 20
    assert advice == mmap.MADV_HUGEPAGE and start % huge == 0 and length % huge == 0
    assert big.data_ptr() <= start and start + length <= big.data_ptr() + big.nbytes
    assert length >= big.nbytes - 2 * huge
    big.fill_(1)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert _anon_huge_kib(big.data_ptr() + big.nbytes // 2) > 0
    for setting in ("0", None):  # the advice off, and by default: the same buffer, nothing asked
        if setting is None:
            monkeypatch.delenv("MOE_EXPERTS_HUGE_PAGES")
        else:
            monkeypatch.setenv("MOE_EXPERTS_HUGE_PAGES", setting)
        off, _ = base.cpu_buffer(like, 8, 1024, 2048)
        assert off.shape == big.shape and len(calls) == 1
    monkeypatch.setenv("MOE_EXPERTS_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match=r"MOE_EXPERTS_HUGE_PAGES: expected '0' or '1', got 'yes'"):
        base.cpu_buffer(like, 8, 1024, 2048)
