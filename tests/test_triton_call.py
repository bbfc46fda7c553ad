"""moe_jax.triton_call: Triton kernels as custom calls (this package's launcher, and jaxlib's), with their global
scratch.

The launch itself needs a GPU (tests/device_triton_check.py runs it there). Here: the signature and specialisation
the kernels are compiled with, a real compile for the H200's compute capability (triton's ptxas, no GPU needed:
which steps need scratch, the cubin this package's launcher registers), the launcher library built and its
registrations, and each custom call's attributes and buffers, lowered for CUDA from the CPU (jaxlib's launcher
module replaced by a stand-in that records what its call would carry).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from moe_jax import triton_call
from moe_shared.kernels import moe, plan as plans

QWEN3_T4096 = plans.Problem(T=4096, H=2048, I=768, E=128, k=8, activation="silu", dtype="bfloat16",
                            gate_up_strides=(1536 * 2048, 2048, 1), down_strides=(2048 * 768, 768, 1),
                            device="NVIDIA H200", tma=True)


def test_argument_types_follow_triton_s_launch():
    assert triton_call.argument_type(jnp.zeros(3, jnp.bfloat16)) == "*bf16"
    assert triton_call.argument_type(jax.ShapeDtypeStruct((2,), jnp.int32)) == "*i32"
    assert triton_call.argument_type(7) == "i32"
    assert triton_call.argument_type(2**40) == "i64"
    assert triton_call.argument_type(1) == 1  # specialised as a constant, as triton's launch does
    with pytest.raises(TypeError, match=r"expected an array of one of .*, got complex64"):
        triton_call.argument_type(jnp.zeros(2, jnp.complex64))
    with pytest.raises(TypeError, match=r"expected an array or an integer, got a bool"):
        triton_call.argument_type(True)


def test_entry_parameters_counts_the_kernel_s_declared_parameters():
    ptx = """.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u32 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2
)
{ .param .b32 retval; }"""
    assert triton_call.entry_parameters(ptx) == 3


def test_a_changed_calling_convention_is_refused(monkeypatch):
    """Where triton would append other hidden parameters, the scratch would land in the wrong one: refused."""
    import triton
    compiled = type("Compiled", (), {"metadata": type("Meta", (), dict(name="k", shared=0, global_scratch_size=0,
                                                                      global_scratch_align=1)),
                                     "asm": {"ptx": ".entry k(.param .u64 a, .param .u64 b)"}})
    monkeypatch.setattr(triton, "compile", lambda *a, **k: compiled)

    @triton.jit
    def one_pointer(p):
        pass

    with pytest.raises(RuntimeError, match=r"compiled 2 parameters for 1 arguments; moe_jax.triton_call passes the "
                                           r"global scratch as parameter 1 of 3"):
        triton_call.compile_kernel.__wrapped__(one_pointer, ("*bf16",), (), 4, 1, 90)


def test_signature_takes_defaults_specialises_pointers_and_ones():
    step = plans.forward_plan(QWEN3_T4096).steps[0]  # the routing histogram: (ids, S) -> hist
    types = ("*i32", "i32", "*i32")
    signature, constexprs, attrs = triton_call.triton_signature(moe.route_histogram_kernel, types,
                                                                dict(step.constants))
    assert list(signature)[:3] == ["ids_ptr", "S", "hist_ptr"]
    assert [signature[n] for n in ("ids_ptr", "S", "hist_ptr")] == list(types)
    assert attrs == {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    assert all(signature[n] == "constexpr" for n in constexprs)
    assert set(constexprs) == set(moe.route_histogram_kernel.arg_names[3:])  # the given ones and the defaults
    assert {n: constexprs[n] for n in step.constants} == dict(step.constants)
    signature, constexprs, _ = triton_call.triton_signature(moe.route_histogram_kernel, ("*i32", 1, "*i32"),
                                                            dict(step.constants))
    assert signature["S"] == "constexpr" and constexprs["S"] == 1
    with pytest.raises(TypeError, match=r"no value for its parameter 'CHUNK'"):
        triton_call.triton_signature(moe.route_histogram_kernel, types, {"E": 4, "EB": 8})


def _outside_the_interpreter(tmp_path, script: str, *args: str):
    """What ``script`` prints last (JSON), run in a subprocess without TRITON_INTERPRET (real compiles, cached in
    ``tmp_path``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_COMPILE_SCRIPT = """
import json, sys
from moe_jax import triton_call
from moe_shared.kernels import moe, plan as plans
fields = json.loads(sys.argv[1])
QWEN3_T4096 = plans.Problem(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
types = {"x": "*bf16", "gate_up": "*bf16", "down": "*bf16", "w": "*bf16", "y": "*bf16", "act": "*bf16",
         "unused": "*bf16", "out": "*bf16", "ids": "*i32", "hist": "*i32", "order": "*i32", "counts": "*i32",
         "starts": "*i32"}
found = []
for tma in (True, False):
    problem = plans.Problem(**{**QWEN3_T4096.__dict__, "tma": tma})
    for step in plans.forward_plan(problem).steps:
        args = [a if isinstance(a, int) else types[a] for a in step.inputs] + [types[b.name] for b in step.outputs]
        args = [triton_call.argument_type(a) if isinstance(a, int) else a for a in args]
        c = triton_call.compile_kernel(getattr(moe, step.kernel), tuple(args), tuple(sorted(step.constants.items())),
                                       step.num_warps, step.num_stages, 90)
        pairs = triton_call.launch_parameters(list(step.inputs), tuple(args[:len(step.inputs)]), len(step.outputs),
                                              step.zeroed, bool(c.scratch_bytes))
        found.append(dict(kernel=step.kernel, b_desc=step.constants.get("B_DESC"), name=c.name, shared=c.shared,
                          scratch=c.scratch_bytes, align=c.scratch_align, ptx_target=".target sm_90" in c.ptx,
                          elf=c.cubin[:4] == b"\x7fELF", declared=triton_call.entry_parameters(c.ptx),
                          pairs=len(pairs) // 2))
print(json.dumps(found))
"""


def test_compiled_for_the_h200_the_descriptor_steps_need_scratch_and_no_other(tmp_path):
    """Compiled for compute capability 9.0 with triton's own ptxas, outside the interpreter (a subprocess)."""
    found = _outside_the_interpreter(tmp_path, _COMPILE_SCRIPT, json.dumps(QWEN3_T4096.__dict__))
    gemms = [f for f in found if f["kernel"] == "grouped_gemm_kernel"]
    assert [f["b_desc"] for f in gemms] == [plans.B_K_ROWS] * 2 + [plans.B_POINTERS] * 2
    assert all(f["scratch"] > 0 and f["scratch"] % 128 == 0 and f["align"] >= 64 for f in gemms[:2])
    assert all(f["scratch"] == 0 for f in found if f not in gemms[:2])
    assert all(f["ptx_target"] and f["shared"] > 0 for f in gemms)
    # this package's launcher gets triton's cubin and one parameter for each the kernel declares
    assert all(f["elf"] and f["pairs"] == f["declared"] for f in found)


_WARP_SPECIALIZE_SCRIPT = """
import json, sys
from dataclasses import replace
from moe_jax import triton_call
from moe_shared.kernels import moe, plan as plans
fields = json.loads(sys.argv[1])
problem = plans.Problem(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
ws = plans.TileConfig(BM=128, BN=64, BK=64, num_warps=4, num_stages=3, GROUP_M=8, TMA=True, A_TMA=True,
                      WARP_SPECIALIZE=True, BLOCK_TABLE=True)
found = []
for table in (True, False):
    plans.OVERRIDES.clear()
    for key in (("gate_up", problem.I, problem.H, problem.E), ("down", problem.H, problem.I, problem.E)):
        plans.OVERRIDES[key] = replace(ws, BLOCK_TABLE=table)
    plans.clear_caches()
    for step in plans.forward_plan(problem).steps:
        if step.kernel != "grouped_gemm_kernel":
            continue
        types = tuple(triton_call.argument_type(a) if isinstance(a, int) else
                      "*i32" if a in ("counts", "starts", "order") or a.startswith("blocks") else "*bf16"
                      for a in step.inputs) + ("*bf16",) * len(step.outputs)
        try:
            c = triton_call.compile_kernel(moe.grouped_gemm_kernel, types, tuple(sorted(step.constants.items())),
                                           step.num_warps, step.num_stages, 90)
            found.append(dict(table=table, a_desc=step.constants["A_DESC"], specialized="setmaxnreg" in c.ptx))
        except Exception as err:
            found.append(dict(table=table, a_desc=step.constants["A_DESC"], error=str(err)[:80]))
print(json.dumps(found))
"""


def test_compiled_for_the_h200_block_tables_let_triton_warp_specialize_the_gemms(tmp_path):
    """Compiled for compute capability 9.0: with a block table and both operands through descriptors, triton's
    Hopper pass splits both forward GEMMs into loading and multiplying warps (its register split, setmaxnreg, in
    the PTX); computing the blocks in the kernel instead (a reduction over the experts before the loop), it fails."""
    found = _outside_the_interpreter(tmp_path, _WARP_SPECIALIZE_SCRIPT, json.dumps(QWEN3_T4096.__dict__))
    assert [f.get("specialized") for f in found if f["table"]] == [True, True]
    assert all(f["a_desc"] for f in found)
    assert [("PassManager" in f.get("error", "")) for f in found if not f["table"]] == [True, True]


class _Recorder:
    """Stands in for jaxlib's Triton launcher module: records what the custom call would carry."""

    def __init__(self):
        self.calls = []

    def create_array_parameter(self, zero_bytes, divisibility):
        return ("array", zero_bytes, divisibility)

    def create_scalar_parameter(self, value, kind):
        return ("scalar", value, kind)

    def TritonKernel(self, *fields):
        return fields

    def TritonKernelCall(self, kernel, g0, g1, g2, params):
        recorder = self

        class Call:
            def to_proto(self, name, metadata):
                recorder.calls.append(dict(kernel=kernel, grid=(g0, g1, g2), params=params, name=name))
                return json.dumps(dict(name=name, grid=g0)).encode()

        return Call()


def test_jaxlib_launch_passes_the_scratch_as_the_last_buffer(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(triton_call, "_jaxlib_triton", lambda: recorder)
    monkeypatch.setattr(triton_call, "compute_capability", lambda device=None: 90)
    compiled = triton_call.Compiled("grouped_gemm_kernel", "// ptx", 1234, scratch_bytes=256, scratch_align=128)
    seen = []

    def fake_compile(kernel, types, constants, num_warps, num_stages, capability):
        seen.append((kernel, types, dict(constants), num_warps, num_stages, capability))
        return compiled

    monkeypatch.setattr(triton_call, "compile_kernel", fake_compile)
    x, w = jnp.zeros((6, 4), jnp.bfloat16), jnp.zeros((6,), jnp.float32)
    outs = [jax.ShapeDtypeStruct((6, 4), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32)]

    def call(x, w):
        return triton_call.launch_jaxlib(moe.grouped_gemm_kernel, 5, [x, 9, w, 1], outs, {"BM": 16}, num_warps=4,
                                         num_stages=3, zeroed=(0,))

    lowered = jax.jit(call).lower(x, w)
    text = lowered.as_text()
    assert "triton_kernel_call" in text and "api_version = 2" in text
    assert "tensor<1280xui8>" in text  # 5 programs x 256 bytes of scratch, one more result
    assert [o.shape for o in jax.eval_shape(call, x, w)] == [(6, 4), (3,)]  # the scratch is not returned
    (kernel, types, constants, warps, stages, capability), = seen
    assert types == ("*bf16", "i32", "*fp32", 1, "*fp32", "*i32") and constants == {"BM": 16}
    (record,) = recorder.calls
    assert record["kernel"] == ("grouped_gemm_kernel", 4, 1, 1234, "// ptx", "", 90) and record["grid"] == (5, 1, 1)
    assert record["params"] == [("array", 0, 16), ("scalar", 9, "i32"), ("array", 0, 16),  # x, 9, w; 1 dropped
                                ("array", 6 * 4 * 4, 16), ("array", 0, 16),  # outputs, the first zeroed
                                ("array", 0, 128)]  # the scratch, in the global-scratch slot


def test_jaxlib_launch_without_scratch_adds_no_buffer(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(triton_call, "_jaxlib_triton", lambda: recorder)
    monkeypatch.setattr(triton_call, "compute_capability", lambda device=None: 90)
    monkeypatch.setattr(triton_call, "compile_kernel",
                        lambda *a: triton_call.Compiled("combine_kernel", "// ptx", 0, 0, 1))
    x = jnp.zeros((4, 8), jnp.bfloat16)
    text = jax.jit(lambda x: triton_call.launch_jaxlib(moe.combine_kernel, 2, [x],
                                                       [jax.ShapeDtypeStruct((4, 8), x.dtype)], {}, num_warps=4,
                                                       num_stages=1)).lower(x).as_text()
    assert "ui8" not in text
    assert recorder.calls[0]["params"] == [("array", 0, 16), ("array", 0, 16)]


def test_a_jaxlib_without_the_launcher_names_what_to_install(monkeypatch):
    from jax._src.lib import gpu_triton
    monkeypatch.delattr(gpu_triton, "TritonKernelCall", raising=False)
    triton_call._jaxlib_triton.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"a CUDA build of jaxlib is needed \(pip install 'jax\[cuda13\]'\)"):
            triton_call._jaxlib_triton()
    finally:
        triton_call._jaxlib_triton.cache_clear()


def test_launch_parameters_describe_every_kernel_parameter_in_order():
    x, w = jnp.zeros((2,), jnp.bfloat16), jnp.zeros((2,), jnp.float32)
    args = [x, 9, w, 1, 2**40]
    types = tuple(triton_call.argument_type(a) for a in args)
    C = triton_call
    assert triton_call.launch_parameters(args, types, 2, zeroed=(1,), scratch=True) == [
        C.ARGUMENT, 0, C.INT32, 9, C.ARGUMENT, 1, C.INT64, 2**40,  # the 1 is a constant, not a parameter
        C.RESULT, 0, C.ZEROED_RESULT, 1,
        C.RESULT, 2,  # the global scratch: the result after the outputs
        C.NULL_POINTER, 0]  # the profile scratch
    assert triton_call.launch_parameters([x], types[:1], 1, zeroed=(), scratch=False)[-4:] == [
        C.NULL_POINTER, 0, C.NULL_POINTER, 0]


def _lowered_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_launch_names_the_registered_kernel_grid_and_parameters(monkeypatch):
    """Lowered for CUDA from the CPU: one moe_triton_launch call with the id the kernel was registered under."""
    monkeypatch.setattr(triton_call, "compute_capability", lambda device=None: 90)
    compiled = triton_call.Compiled("grouped_gemm_kernel", "// ptx", 1234, scratch_bytes=256, scratch_align=128,
                                    cubin=b"\x7fELF stand-in")
    monkeypatch.setattr(triton_call, "compile_kernel", lambda *a: compiled)
    x, w = jnp.zeros((6, 4), jnp.bfloat16), jnp.zeros((6,), jnp.float32)
    outs = [jax.ShapeDtypeStruct((6, 4), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32)]

    def call(x, w):
        return triton_call.launch(moe.grouped_gemm_kernel, 5, [x, 9, w, 1], outs, {"BM": 16}, num_warps=4,
                                  num_stages=3, zeroed=(0,))

    text = _lowered_for_cuda(call, x, w)
    kernel = triton_call.kernel_id(compiled, 4)
    C = triton_call
    pairs = [C.ARGUMENT, 0, C.INT32, 9, C.ARGUMENT, 1, C.ZEROED_RESULT, 0, C.RESULT, 1, C.RESULT, 2, C.NULL_POINTER, 0]
    assert text.count("stablehlo.custom_call @moe_triton_launch") == 1 and "triton_kernel_call" not in text
    assert (f"grid = 5 : i64, kernel = {kernel} : i64, parameters = dense<{pairs}> : tensor<{len(pairs)}xi64>"
            in text)
    assert "tensor<1280xui8>" in text  # 5 programs x 256 bytes of scratch, one more result
    assert [o.shape for o in jax.eval_shape(call, x, w)] == [(6, 4), (3,)]  # the scratch is not returned
    again = triton_call.Compiled(**{**compiled.__dict__, "shared": 2048})
    assert triton_call.kernel_id(compiled, 4) == kernel != triton_call.kernel_id(again, 4)


def test_a_graphed_launch_is_the_same_call_to_the_graphed_target(monkeypatch):
    monkeypatch.setattr(triton_call, "compute_capability", lambda device=None: 90)
    compiled = triton_call.Compiled("grouped_gemm_kernel", "// ptx", 0, 0, 1, cubin=b"\x7fELF stand-in")
    monkeypatch.setattr(triton_call, "compile_kernel", lambda *a: compiled)
    x = jnp.zeros((6, 4), jnp.bfloat16)
    outs = [jax.ShapeDtypeStruct((6, 4), jnp.float32)]

    def lowered(target):
        return _lowered_for_cuda(lambda x: triton_call.launch(moe.grouped_gemm_kernel, 5, [x], outs, {}, num_warps=4,
                                                              num_stages=3, target=target), x)

    direct, graphed = lowered(triton_call.LAUNCH_TARGET), lowered(triton_call.GRAPHED_LAUNCH_TARGET)
    assert "@moe_triton_launch(" in direct and "@moe_triton_launch_graphed(" in graphed
    assert graphed.replace("@moe_triton_launch_graphed(", "@moe_triton_launch(") == direct
    with pytest.raises(ValueError, match=r"target: expected 'moe_triton_launch' or 'moe_triton_launch_graphed', "
                                         r"got 'triton_kernel_call'"):
        lowered(triton_call.TARGET)


def test_the_graphed_target_alone_is_registered_command_buffer_compatible(monkeypatch):
    from jaxlib import xla_client
    registered = {}
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, handler, platform, **options: registered.update({name: (platform, options)}))
    triton_call._launcher_library.cache_clear()
    try:
        triton_call._launcher_library()
    finally:
        triton_call._launcher_library.cache_clear()
    compatible = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
    assert registered == {triton_call.LAUNCH_TARGET: ("CUDA", {}),
                          triton_call.GRAPHED_LAUNCH_TARGET: ("CUDA", {"traits": compatible})}


def test_the_graphed_launcher_launches_through_the_graphed_target(monkeypatch):
    from moe_jax.backends import triton as backend
    from moe_shared.kernels import plan as plans
    targets = []
    monkeypatch.setattr(triton_call, "launch", lambda *a, target, **k: targets.append(target) or [])
    step = plans.Step("grouped_gemm_kernel", 3, (), (), {}, num_warps=4, num_stages=3)
    for launcher in (backend.XLA_LAUNCHER, backend.GRAPHED_LAUNCHER):
        launcher.launch(moe.grouped_gemm_kernel, step, [], [])
    assert targets == [triton_call.LAUNCH_TARGET, triton_call.GRAPHED_LAUNCH_TARGET]
    assert backend.GRAPHED_LAUNCHER.tensor_descriptors


def test_registrations_get_ids_in_order_and_bad_ones_an_error():
    import ctypes
    library = triton_call._launcher_library()
    error = ctypes.create_string_buffer(256)
    assert triton_call.captured_launches() == 0  # nothing launched on this CPU
    first = library.moe_triton_register(b"k", b"\x7fELF", 4, 4, 0, error, len(error))
    assert first >= 0
    assert library.moe_triton_register(b"k", b"\x7fELF", 4, 8, 70000, error, len(error)) == first + 1
    assert library.moe_triton_register(b"k", b"\x7fELF", 4, 0, 0, error, len(error)) == -1
    assert error.value == b"num_warps: expected 1 to 32, got 0"
    assert library.moe_triton_register(b"k", b"\x7fELF", 4, 4, -1, error, len(error)) == -1
    assert error.value == b"shared: expected a byte count >= 0, got -1"
    with pytest.raises(ValueError, match=r"grouped_gemm_kernel: no cubin to register"):
        triton_call.kernel_id.__wrapped__(triton_call.Compiled("grouped_gemm_kernel", "// ptx", 0, 0, 1), 4)


def test_without_a_cuda_driver_the_launcher_says_why():
    import ctypes.util
    if ctypes.util.find_library("cuda"):
        pytest.skip("this host has a CUDA driver")
    reason = triton_call._launcher_library().moe_triton_driver_error().decode()
    assert reason.startswith("cannot open libcuda.so.1: ")


def test_a_launcher_that_cannot_be_built_says_why(monkeypatch):
    from moe_shared import native
    monkeypatch.setattr(native, "load_library", lambda *a, **k: (None, "no C++ compiler found (set CXX)"))
    triton_call._launcher_library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"moe_jax's Triton launcher cannot be built: no C\+\+ compiler found"):
            triton_call._launcher_library()
    finally:
        triton_call._launcher_library.cache_clear()


_BACKEND_SCRIPT = """
import json
import jax, jax.numpy as jnp
from moe_jax import triton_call
from moe_jax.backends import triton as backend
from moe_shared.kernels import plan as plans
triton_call.compute_capability = lambda device=None: 90
backend._device_name = lambda: "NVIDIA H200"
T, H, I, E, k = 64, 256, 128, 8, 2
x, w = jnp.ones((T, H), jnp.bfloat16), jnp.ones((T, k), jnp.bfloat16)
ids = jnp.zeros((T, k), jnp.int32)
gate_up, down = jnp.ones((E, 2 * I, H), jnp.bfloat16), jnp.ones((E, H, I), jnp.bfloat16)
def loss(x, w, gate_up, down):
    return backend.experts_forward(x, ids, w, gate_up, down).astype(jnp.float32).sum()
text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).trace(x, w, gate_up, down).lower(
    lowering_platforms=("cuda",)).as_text()
problem = backend.problem_of(x, ids, gate_up, down, None, None, "silu")
steps = [s for p in (plans.forward_plan(problem, training=True), plans.backward_plan(problem)) for s in p.steps if s.grid]
print(json.dumps(dict(ours=text.count("custom_call @moe_triton_launch"), jaxlib=text.count("triton_kernel_call"),
                      steps=len(steps), kernels=triton_call.kernel_id.cache_info().currsize)))
"""


def test_the_backend_launches_every_step_through_this_package_s_launcher(tmp_path):
    """The JAX triton backend's forward and backward lowered for CUDA (real compiles, outside the interpreter): one
    moe_triton_launch call per plan step, none into jaxlib's launcher."""
    found = _outside_the_interpreter(tmp_path, _BACKEND_SCRIPT)
    assert found["ours"] == found["steps"] > 0 and found["jaxlib"] == 0
    assert 0 < found["kernels"] <= found["steps"]
