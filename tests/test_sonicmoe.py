"""Backend ``sonicmoe`` (torch, JAX) on CPU: every requirement error with the GPU or the packages absent or faked,
and both bindings end to end (forward and every gradient, torch.compile, jax.jit, empty and out-of-range slots,
T = 0) with SonicMoE's kernel steps replaced by the plain-torch steps of ``fake_sonicmoe``. On the GPU, with the
real kernels: tests/device_sonicmoe_check.py.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fake_sonicmoe
import moe_jax
import moe_torch
import triton_interpreter
from moe_jax.backends import sonicmoe as jax_sonic
from moe_jax.backends import triton as jax_triton_backend
from moe_shared import reference, registry, relative_l2, requirements, sonic_steps
from moe_shared.kernels import plan as kernel_plans
from moe_torch.backends import sonicmoe as torch_sonic
from support import CASES, DIFF_ARGS, SPEC, case_id, padded_arrays, random_case, unpadded_gradients

SUPPORT = SPEC.backends["sonicmoe"].support("torch")
TOL = SPEC.tolerance_for("bfloat16")


def to_torch(arrays, requires_grad=False):
    return {n: torch.from_numpy(np.ascontiguousarray(a)) if n == "top_k_index" else
            torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16).requires_grad_(requires_grad)
            for n, a in arrays.items()}


def to_jax(arrays):
    return {n: jnp.asarray(a) if n == "top_k_index" else jnp.asarray(a).astype(jnp.bfloat16)
            for n, a in arrays.items()}


@pytest.fixture
def fake(monkeypatch):
    """The fake steps in both bindings; ``calls`` lists the steps that ran, in order."""
    calls = []
    recorded = {name: (lambda f, n: lambda *a: (calls.append(n), f(*a))[1])(f, name)
                for name, f in vars(fake_sonicmoe.steps()).items()}
    steps = SimpleNamespace(**recorded)
    monkeypatch.setattr(torch_sonic, "runtime", lambda device: steps)
    monkeypatch.setattr(jax_sonic, "runtime", lambda platform: steps)
    with jax_triton_backend.use_launcher(triton_interpreter.jax_interpreter_launch):  # the shared routing kernels
        yield calls


def torch_run(arrays, grad_output):
    ts = to_torch(arrays, requires_grad=True)
    out = torch_sonic.experts_forward(**ts)
    out.backward(torch.from_numpy(grad_output).to(torch.bfloat16))
    grads = {n: ts[n].grad.float().numpy() for n in DIFF_ARGS if n in ts}
    return out.detach().float().numpy(), grads


def jax_run(arrays, grad_output):
    js = to_jax(arrays)
    names = [n for n in DIFF_ARGS if n in js]

    def f(*diff):
        return jax_sonic.experts_forward(**(js | dict(zip(names, diff))))

    out, vjp = jax.jit(lambda *d: jax.vjp(f, *d))(*(js[n] for n in names))
    grads = vjp(jnp.asarray(grad_output).astype(jnp.bfloat16))
    return (np.asarray(out.astype(jnp.float32)),
            {n: np.asarray(g.astype(jnp.float32)) for n, g in zip(names, grads)})


def test_fake_implements_every_step_the_spec_names():
    assert set(vars(fake_sonicmoe.steps())) == set(SUPPORT.details["kernels"])
    assert set(SPEC.backends["sonicmoe"].support("jax").details["kernels"]) == set(SUPPORT.details["kernels"])


@pytest.mark.parametrize("T, k, E, chunk", [(0, 2, 4, 1024), (1, 1, 3, 1024), (7, 2, 5, 1024), (40, 3, 5, 16),
                                           (9, 8, 128, 1024)])
def test_shared_routing_kernels_give_sonicmoes_routing_in_both_frameworks(T, k, E, chunk, monkeypatch, request):
    """The routing metadata of the shared Triton kernels (under the interpreter), through each binding, is what
    SonicMoE's own routing step gives with every empty or out-of-range slot routed to expert 0 at weight 0; and the
    same in torch and JAX. Sorting chunks of 16 slots, 40 * 3 slots take the sort's multi-chunk path."""
    monkeypatch.setattr(kernel_plans, "ROUTE_CHUNK", chunk)
    kernel_plans.sonic_routing_plan.cache_clear()
    request.addfinalizer(kernel_plans.sonic_routing_plan.cache_clear)  # no plan of another chunk size outlives it
    rng = np.random.default_rng(T + E)
    ids = rng.integers(0, E, size=(T, k)).astype(np.int32)
    ids[::3, 0] = -1
    ids[1::5, -1] = E + 1
    w = rng.random((T, k)).astype(np.float32)
    expected = fake_sonicmoe.routing_reference(torch.from_numpy(ids), torch.from_numpy(w), E)
    from_torch = torch_sonic._routing(torch.from_numpy(ids).long(), torch.from_numpy(w).to(torch.bfloat16), E)
    with jax_triton_backend.use_launcher(triton_interpreter.jax_interpreter_launch):
        from_jax = jax.jit(lambda i, v: jax_sonic._routing(i, v, E))(jnp.asarray(ids), jnp.asarray(w, jnp.bfloat16))
    for name in sonic_steps.ROUTING:
        want = expected[name]
        if name == "scores":
            want = want.to(torch.bfloat16).float()  # the weights were given in bfloat16
        np.testing.assert_array_equal(from_torch[name].numpy(), want.numpy(), err_msg=name)
        np.testing.assert_array_equal(np.asarray(from_jax[name]), want.numpy(), err_msg=name)


RANDOM = [dict(T=0, k=2, E=4), dict(T=1, k=2, E=8), dict(T=37, k=3, E=5), dict(T=64, k=8, E=16),
          dict(T=20, k=1, E=3)]


@pytest.mark.parametrize("shape", RANDOM, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_forward_and_gradients_match_reference_and_each_other(fake, shape):
    bias = shape["T"] % 2 == 1
    arrays, grad_output = random_case(shape["T"] * 5 + shape["E"], H=24, I=32, bias=bias, empty_fraction=0.15,
                                      **shape)
    arrays["top_k_index"][::7, 0] = shape["E"] + 2  # unchecked out-of-range ids: empty slots
    cleaned = dict(arrays, top_k_index=np.where(arrays["top_k_index"] >= shape["E"], -1, arrays["top_k_index"]))
    expected = reference.experts_forward(**cleaned)
    expected_grads = reference.experts_backward(**cleaned, grad_output=grad_output)
    out, grads = torch_run(arrays, grad_output)
    jout, jgrads = jax_run(arrays, grad_output)
    assert relative_l2(out, expected) <= TOL
    for name, g in grads.items():
        assert relative_l2(g, expected_grads[name]) <= TOL, name
    np.testing.assert_array_equal(jout, out)  # the same steps on the same buffers: the same bits
    for name in grads:
        np.testing.assert_array_equal(jgrads[name], grads[name], err_msg=name)
    if shape["T"]:
        empty = cleaned["top_k_index"] < 0
        assert np.all(grads["top_k_weights"][empty] == 0) and np.all(jgrads["top_k_weights"][empty] == 0)
        assert fake[:3] == ["up", "down", "combine"]
        assert fake[3:8] == ["down_backward", "down_backward_weight", "up_backward", "up_backward_weight",
                             "token_sum"]
    else:
        assert not fake  # nothing launched for no tokens


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "bfloat16" and c.activation == "silu"],
                         ids=case_id)
def test_shared_vectors_zero_padded_to_multiples_of_8_or_32_with_biases(fake, case):
    E, H, I = case.inputs["down_proj"].shape
    padded = padded_arrays(case.inputs, 32 if "gate_up_bias" in case.inputs else 8)
    H2 = padded["down_proj"].shape[1]
    grad_output = np.pad(case.grad_output, [(0, 0), (0, H2 - H)])
    out, grads = torch_run(padded, grad_output)
    jout, jgrads = jax_run(padded, grad_output)
    assert relative_l2(out[:, :H], case.expected["out"]) <= TOL
    np.testing.assert_array_equal(jout, out)
    for name, g in unpadded_gradients(grads, H, I).items():
        assert relative_l2(g, case.expected[f"grad_{name}"]) <= TOL, name
        np.testing.assert_array_equal(unpadded_gradients(jgrads, H, I)[name], g, err_msg=name)


def test_inference_keeps_no_residuals(fake):
    arrays, _ = random_case(3, T=9, H=16, I=8, E=4, k=2, bias=False)
    with torch.no_grad():
        out = torch_sonic.experts_forward(**to_torch(arrays))
    jout = jax.jit(lambda v: jax_sonic.experts_forward(**v))(to_jax(arrays))
    np.testing.assert_array_equal(np.asarray(jout.astype(jnp.float32)), out.float().numpy())
    assert relative_l2(out.float().numpy(), reference.experts_forward(**arrays)) <= TOL
    names = [b.name for b in sonic_steps.forward_buffers(9, 16, 8, 4, 2, training=False)]
    assert "preact" not in names and fake == ["up", "down", "combine"] * 2


def test_jax_callbacks_run_the_steps_with_autograd_off(monkeypatch):
    grad_modes = []
    recording = {name: (lambda f: lambda *a: (grad_modes.append(torch.is_grad_enabled()), f(*a))[1])(f)
                 for name, f in vars(fake_sonicmoe.steps()).items()}
    monkeypatch.setattr(jax_sonic, "runtime", lambda platform: SimpleNamespace(**recording))
    arrays, grad_output = random_case(6, T=5, H=16, I=8, E=3, k=2, bias=False)
    with jax_triton_backend.use_launcher(triton_interpreter.jax_interpreter_launch):
        jax_run(arrays, grad_output)
    assert torch.is_grad_enabled() and len(grad_modes) > 3 and not any(grad_modes)


def test_torch_compile_fullgraph_forward_and_backward(fake):
    arrays, grad_output = random_case(4, T=30, H=16, I=32, E=4, k=2, bias=True, empty_fraction=0.2)
    eager_out, eager_grads = torch_run(arrays, grad_output)
    ts = to_torch(arrays, requires_grad=True)
    compiled = torch.compile(lambda **kw: torch_sonic.experts_forward(**kw), fullgraph=True, backend="aot_eager")
    out = compiled(**ts)
    out.backward(torch.from_numpy(grad_output).to(torch.bfloat16))
    np.testing.assert_array_equal(out.detach().float().numpy(), eager_out)
    for name, g in eager_grads.items():
        np.testing.assert_array_equal(ts[name].grad.float().numpy(), g, err_msg=name)


def test_eager_training_runs_without_the_op_dispatch_and_compiled_through_the_ops(fake):
    arrays, _ = random_case(7, T=6, H=16, I=8, E=3, k=2, bias=False)
    ts = to_torch(arrays, requires_grad=True)
    eager = torch_sonic.experts_forward(**ts)
    assert type(eager.grad_fn).__name__ == "OpFreeTrainingBackward"
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda **kw: torch_sonic.experts_forward(**kw), fullgraph=True, backend=backend)
    compiled(**to_torch(arrays, requires_grad=True))
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert "moe_torch.sonicmoe_experts_train.default" in targets, targets


def test_custom_ops_schema_and_fake(fake):
    arrays = to_torch(random_case(5, T=12, H=16, I=32, E=3, k=2, bias=True, empty_fraction=0.2)[0])
    args = (arrays["hidden_states"], arrays["top_k_index"], arrays["top_k_weights"], arrays["gate_up_proj"],
            arrays["down_proj"], arrays["gate_up_bias"], arrays["down_bias"], "silu")
    for op in (torch.ops.moe_torch.sonicmoe_experts.default, torch.ops.moe_torch.sonicmoe_experts_train.default):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    residuals = torch_sonic.sonicmoe_experts_train(*args)[1:]
    dout = torch.randn(12, 16).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.moe_torch.sonicmoe_experts_backward.default,
                          (dout, *args[:2], *args[3:7], residuals, "silu"), test_utils=("test_schema",
                                                                                        "test_faketensor"))


# --- what the kernels cannot take ---------------------------------------------------------------------------------

@pytest.mark.parametrize("activation, got", [("gelu", "'gelu'"), ("relu", "'relu'"),
                                             (lambda h: h[..., :4], "the callable <lambda>")])
def test_activations_without_a_sonicmoe_form_are_refused(fake, activation, got):
    arrays, _ = random_case(6, T=8, H=16, I=8, E=3, k=2, bias=False)
    message = rf"activation: implementation 'sonicmoe' takes one of \['silu'\], got {got}"
    with pytest.raises(ValueError, match=message):
        torch_sonic.experts_forward(**to_torch(arrays), activation=activation)
    with pytest.raises(ValueError, match=message):
        jax_sonic.experts_forward(**to_jax(arrays), activation=activation)
    assert not fake


def test_shapes_and_dtypes_the_kernels_cannot_take(fake):
    for H, I, arg, dim, size in ((20, 8, "gate_up_proj", "H", 20), (16, 12, "down_proj", "I", 12)):
        bad, _ = random_case(6, T=8, H=H, I=I, E=3, k=2, bias=False)
        message = rf"{arg}: expected {dim} a multiple of 8 for implementation 'sonicmoe' .*{dim} = {size}"
        with pytest.raises(ValueError, match=message):
            torch_sonic.experts_forward(**to_torch(bad))
        with pytest.raises(ValueError, match=message):
            jax_sonic.experts_forward(**to_jax(bad))
    small, _ = random_case(6, T=8, H=16, I=24, E=3, k=2, bias=True)
    message = r"gate_up_bias: implementation 'sonicmoe' takes biases with I >= 32 .*got I = 24"
    with pytest.raises(ValueError, match=message):
        torch_sonic.experts_forward(**to_torch(small))
    with pytest.raises(ValueError, match=message):
        jax_sonic.experts_forward(**to_jax(small))
    arrays, _ = random_case(6, T=8, H=16, I=8, E=3, k=2, bias=False)
    as_float32 = {n: torch.from_numpy(a) if n == "top_k_index" else torch.from_numpy(a).float()
                  for n, a in arrays.items()}
    with pytest.raises(ValueError, match=r"gate_up_proj: implementation 'sonicmoe' supports dtypes \['bfloat16'\], "
                                         r"got dtype float32"):
        torch_sonic.experts_forward(**as_float32)
    assert not fake


# --- requirement errors -------------------------------------------------------------------------------------------

INSTALL = r"pip install 'moe-experts\[sonicmoe\]' && pip install --no-deps 'sonic-moe==0.1.2.post1'"


def test_unavailable_on_cpu_with_reasons(monkeypatch):
    assert moe_torch.available_backends("cpu")["sonicmoe"] == (
        "implementation 'sonicmoe' needs the package 'sonicmoe': pip install 'moe-experts[sonicmoe]' && "
        "pip install --no-deps 'sonic-moe==0.1.2.post1'; or put the hub build kernels-community/sonic-moe "
        "(ep-support) in the local kernel cache (pip install kernels, then once, online: python -c \"import kernels; "
        "kernels.get_kernel('kernels-community/sonic-moe', revision='ep-support')\"): it is loaded from there, never "
        "downloaded at run time")
    assert "'sonicmoe'" in moe_jax.available_backends("cpu")["sonicmoe"]
    arrays = to_torch(random_case(5, T=4, H=16, I=8, E=3, k=2, bias=False)[0])
    with pytest.raises(ImportError, match=INSTALL):
        moe_torch.experts_forward(**arrays, implementation="sonicmoe")
    monkeypatch.setitem(registry.PACKAGES_PRESENT, "sonicmoe", True)
    with pytest.raises(RuntimeError, match=r"implementation 'sonicmoe' runs on \['cuda'\], got a tensor on cpu"):
        moe_torch.experts_forward(**arrays, implementation="sonicmoe")
    with pytest.raises(RuntimeError, match=r"runs on \['cuda'\], got a tensor on cpu"):
        torch_sonic.runtime(torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"runs on \['cuda'\], got the cpu platform"):
        jax_sonic.runtime("cpu")


def test_jax_backend_needs_triton_for_the_routing_kernels(monkeypatch):
    monkeypatch.setattr(jax_sonic, "_READY", {})
    monkeypatch.setattr(jax_sonic, "device_class", lambda platform: "cuda")  # past the device check
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ImportError, match=r"implementation 'sonicmoe' needs the package 'triton': "
                                          r"pip install 'moe-experts\[gpu\]'"):
        jax_sonic.runtime("cpu")


def test_jax_backend_never_imports_torch_until_called():
    code = "import sys, moe_jax.backends.sonicmoe; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device of a chosen compute capability for the checks (no kernel runs), with fresh caches."""
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(torch_sonic, "_READY", {})
    monkeypatch.setattr(requirements, "_LOADED", {})
    return capability


def test_first_call_checks_capability_then_version_then_imports(fake_cuda, monkeypatch, tmp_path):
    device = torch.device("cuda", 0)
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))  # an empty kernel cache
    fake_cuda[0] = (8, 9)
    with pytest.raises(RuntimeError, match=r"'sonicmoe' needs CUDA compute capability >= 9.0, got 8.9 on a tensor "
                                           r"on cuda:0"):
        torch_sonic.runtime(device)
    fake_cuda[0] = (9, 0)
    with pytest.raises(ImportError, match=rf"'sonicmoe' needs the package 'sonicmoe': {INSTALL}; or put the hub "
                                          r"build kernels-community/sonic-moe \(ep-support\) in the local kernel "
                                          r"cache .* never downloaded at run time \(not found under "):
        torch_sonic.runtime(device)
    installed = {}
    monkeypatch.setattr(requirements, "installed_version", lambda dist: installed.get(dist))
    monkeypatch.setitem(sys.modules, "sonicmoe", SimpleNamespace())  # importable, no distribution installed
    with pytest.raises(ImportError, match=rf"'sonicmoe' needs sonic-moe 0.1.2.post1, got none installed: {INSTALL}"):
        torch_sonic.runtime(device)
    installed["sonic-moe"] = "0.1.3"  # its internals may differ: refused before any import
    with pytest.raises(ImportError, match=r"needs sonic-moe 0.1.2.post1, got 0.1.3"):
        torch_sonic.runtime(device)
    installed["sonic-moe"] = "0.1.2.post1"
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # not importable
    with pytest.raises(ImportError, match=rf"'sonicmoe' needs the package 'sonicmoe': {INSTALL}"):
        torch_sonic.runtime(device)


def _hub_cache(root, repo_id: str, ref: str, commit: str = "0123abcd", kind: str = "kernels"):
    """A kernel cache holding ``repo_id`` at ``ref`` (refs/<ref> -> snapshots/<commit>), as the kernels package
    lays it out."""
    folder = root / f"{kind}--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / ref).write_text(commit + "\n")
    (folder / "snapshots" / commit).mkdir(parents=True)
    return folder / "snapshots" / commit


def _hub_sonic(monkeypatch, version="0.1.2.post1", lacking=()):
    """A stand-in ``kernels`` package whose get_local_kernel returns a hub build of SonicMoE (module
    ``_sonic_moe_hub``) with the spec's steps under its own name, minus ``lacking``; returns the paths it got."""
    asked = []
    package = SimpleNamespace(__name__="_sonic_moe_hub", __version__=version)
    for where in SUPPORT.details["kernels"].values():
        module, _, function = where.partition(":")
        name = ".".join(["_sonic_moe_hub", *module.split(".")[1:]])
        fake = sys.modules.get(name) if isinstance(sys.modules.get(name), SimpleNamespace) else SimpleNamespace()
        if function not in lacking:
            setattr(fake, function, (lambda w: lambda: w)(where))
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.setitem(sys.modules, "_sonic_moe_hub", package)
    monkeypatch.setitem(sys.modules, "kernels", SimpleNamespace(
        get_local_kernel=lambda path: asked.append(path) or package))
    return asked


def test_hub_build_loads_from_the_local_cache_where_sonic_moe_is_not_installed(fake_cuda, monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    snapshot = _hub_cache(tmp_path, "kernels-community/sonic-moe", "ep-support")
    asked = _hub_sonic(monkeypatch)
    steps = torch_sonic.runtime(torch.device("cuda", 0))
    assert asked == [snapshot]  # the cached snapshot, by path: nothing to download
    assert {name: f() for name, f in vars(steps).items()} == dict(SUPPORT.details["kernels"])


def test_hub_build_without_the_steps_or_at_another_version_is_refused(fake_cuda, monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    _hub_cache(tmp_path, "kernels-community/sonic-moe", "ep-support", kind="models")  # the older cache layout
    _hub_sonic(monkeypatch, lacking=("_up_projection_forward", "_down_projection_backward_weight"))
    with pytest.raises(ImportError, match=r"_sonic_moe_hub lacks _sonic_moe_hub.functional.forward:"
                                          r"_up_projection_forward, _sonic_moe_hub.functional.backward:"
                                          r"_down_projection_backward_weight: pip install --no-deps"):
        torch_sonic.runtime(torch.device("cuda", 0))
    monkeypatch.setattr(requirements, "_LOADED", {})
    _hub_sonic(monkeypatch, version="0.2.0")
    with pytest.raises(ImportError, match=r"needs sonic-moe 0.1.2.post1, got the hub build kernels-community/"
                                          r"sonic-moe \(ep-support\) at version 0.2.0"):
        torch_sonic.runtime(torch.device("cuda", 0))


def test_hub_cache_roots_follow_the_kernels_and_huggingface_variables(tmp_path):
    assert requirements.hub_cache_roots({"KERNELS_CACHE": "/k", "HF_HUB_CACHE": "/h"}) == [requirements.Path("/k")]
    assert requirements.hub_cache_roots({"HF_HUB_CACHE": "/h", "HF_HOME": "/home"}) == [requirements.Path("/h")]
    assert requirements.hub_cache_roots({"HF_HOME": "/home"}) == [requirements.Path("/home/hub")]
    assert requirements.hub_cache_roots({"XDG_CACHE_HOME": "/x"}) == [requirements.Path("/x/huggingface/hub")]
    hub = {"repo_id": "kernels-community/deep-gemm", "version": 2}
    assert requirements.hub_snapshot(hub, {"KERNELS_CACHE": str(tmp_path)}) is None
    snapshot = _hub_cache(tmp_path, hub["repo_id"], "v2")
    assert requirements.hub_snapshot(hub, {"KERNELS_CACHE": str(tmp_path)}) == snapshot
    assert requirements.hub_snapshot(dict(hub, version=3), {"KERNELS_CACHE": str(tmp_path)}) is None


def test_steps_load_from_the_modules_the_spec_names(monkeypatch):
    for module in {where.partition(":")[0] for where in SUPPORT.details["kernels"].values()}:
        fake_module = SimpleNamespace(**{where.partition(":")[2]: (lambda w: lambda: w)(where)
                                         for where in SUPPORT.details["kernels"].values()})
        monkeypatch.setitem(sys.modules, module, fake_module)
    steps = sonic_steps.load_steps(SUPPORT.details["kernels"])
    assert {name: f() for name, f in vars(steps).items()} == dict(SUPPORT.details["kernels"])


@torch.library.custom_op("moe_tests::sonic_step_stand_in", mutates_args={"out"})
def _step_as_custom_op(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)


def test_steps_are_called_beneath_their_custom_ops(monkeypatch):
    """SonicMoE's steps are torch custom ops: the bindings call the functions they were made from (no dispatcher
    layers), and those compute what the op does."""
    where = dict(SUPPORT.details["kernels"])
    module = where["up"].partition(":")[0]
    monkeypatch.setitem(sys.modules, module, SimpleNamespace(**{
        w.partition(":")[2]: _step_as_custom_op for w in where.values() if w.startswith(module + ":")}))
    for other in {w.partition(":")[0] for w in where.values()} - {module}:
        monkeypatch.setitem(sys.modules, other, SimpleNamespace(**{w.partition(":")[2]: len for w in where.values()}))
    steps = sonic_steps.load_steps(where)
    assert steps.up is _step_as_custom_op._init_fn and steps.token_sum is len
    x, through_op, beneath = torch.arange(4.0), torch.zeros(4), torch.zeros(4)
    _step_as_custom_op(x, through_op)
    steps.up(x, beneath)
    assert torch.equal(beneath, through_op) and torch.equal(beneath, x * 2)


def test_buffer_tables():
    T, H, I, E, k = 5, 16, 8, 4, 3
    inference = {b.name: b for b in sonic_steps.forward_buffers(T, H, I, E, k, training=False)}
    training = {b.name: b for b in sonic_steps.forward_buffers(T, H, I, E, k, training=True)}
    assert list(training)[0] == "out" and training["out"].shape == (T, H)
    routed = {b.name: b for b in sonic_steps.routing_buffers(T, k, E)}
    assert set(sonic_steps.RESIDUALS) <= set(training) | set(routed) and "preact" not in inference
    plan = sonic_steps.routing_plan(T, k, E)  # the buffers the routing kernels create are the ones declared
    assert list(routed) == list(sonic_steps.ROUTING)
    for name, b in routed.items():
        made = plan.buffers["starts" if name == "offsets" else name]
        assert (made.shape, made.dtype) == (b.shape, b.dtype), name
    assert training["preact"].shape == (T * k, 2 * I) and routed["offsets"].shape == (E + 1,)
    grads = [b.name for b in sonic_steps.backward_buffers(T, H, I, E, k, True, False)]
    assert grads[:5] == ["dx", "d_scores", "d_gate_up", "d_down", "d_gate_up_bias"] and "d_down_bias" not in grads
