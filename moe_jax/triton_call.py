"""Triton kernels as XLA custom calls, with their global scratch: what lets them build tensor descriptors (TMA).

Each launch is one custom call on XLA's stream, under ``jax.jit`` or eagerly. The kernel is compiled here by
``triton.compile`` with the options and argument specialisation of triton's own launch (what moe_torch runs), so
both frameworks run the same binary code for the same plan step.

A Triton kernel takes its global scratch, the memory in which device-side tensor descriptors are built, as a
hidden parameter after its own; jaxlib's Triton launcher (the ``triton_kernel_call`` custom-call target, the one
jax_triton calls) passes a null pointer there: such a kernel faults from jax_triton. Here a kernel that needs
scratch gets it as one more output of the call (programs x scratch bytes, uint8). Through jaxlib's launcher
(``launch_jaxlib``) it is passed as the last array parameter, which lands in the scratch slot; jaxlib's two
trailing null pointers then fill the profile-scratch slot and one slot past the end, which ``cuLaunchKernel`` does
not read (it reads as many parameters as the kernel declares).

``launch`` goes through a launcher of this package instead (``triton_launch.cc``, the XLA FFI target
``moe_triton_launch``, built at first use with the host's C++ compiler): each kernel's cubin, the one triton's
ptxas made for moe_torch, is registered once and named in a call by a small integer id, with the grid and the
parameter list (operands, results, integers, null pointers) as attributes. jaxlib's launcher looks its kernel up
by hashing the call's whole opaque string (the compressed PTX) at every launch, and assembles the PTX with XLA's
own ptxas; ``launch_jaxlib`` keeps that route, for comparison. The ids are this process's: a program lowered here
runs here. The launch is registered twice: as ``moe_triton_launch``, launched at every call, and as
``moe_triton_launch_graphed`` (which also counts its launches captured into graphs), marked command-buffer
compatible, which XLA (``--xla_gpu_enable_command_buffer`` with CUSTOM_CALL, its default) may trace into a CUDA
graph together with the neighbouring fusions and replay.
"""

from __future__ import annotations

import ctypes
import inspect
import zlib
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "triton_kernel_call"  # jaxlib's custom-call target for Triton kernels (legacy API, version 2)
LAUNCH_TARGET = "moe_triton_launch"  # this package's (XLA FFI, triton_launch.cc), launched at every call
GRAPHED_LAUNCH_TARGET = "moe_triton_launch_graphed"  # the same launch, which XLA may trace into command buffers
LAUNCH_SOURCE = Path(__file__).with_name("triton_launch.cc")
POINTER_DIVISIBILITY = 16  # bytes: every array argument is specialised as 16-byte aligned (XLA's buffers are)
HIDDEN_PARAMETERS = 2  # pointers triton (3.5 on) appends to a kernel's parameters: global scratch, profile scratch

@dataclass(frozen=True)
class Compiled:
    name: str
    ptx: str
    shared: int  # bytes of shared memory a program takes
    scratch_bytes: int  # global scratch per program (0: none)
    scratch_align: int
    cubin: bytes = b""


def argument_type(arg) -> str | int:
    """Triton's signature type of a kernel argument: ``*bf16`` etc. for an array (or its ShapeDtypeStruct),
    ``i32``/``i64`` for an integer, and the integer 1 itself, which triton's launch specialises as a constant."""
    if isinstance(arg, bool):
        raise TypeError("Triton kernel argument: expected an array or an integer, got a bool (pass a flag as a "
                        "constexpr keyword)")
    if isinstance(arg, int):
        if arg == 1:
            return 1
        return "i32" if -2**31 <= arg < 2**31 else "i64"
    from triton.runtime.jit import type_canonicalisation_dict as triton_types  # numpy dtype names included
    name = jnp.dtype(arg.dtype).name
    if name not in triton_types:
        raise TypeError(f"Triton kernel argument: expected an array of one of {sorted(triton_types)}, got {name}")
    return "*" + triton_types[name]


def triton_signature(kernel, types: tuple, constants: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of ``triton.compiler.ASTSource`` for ``kernel`` called with arguments of
    ``types`` (``argument_type``) in its parameter order and ``constants`` by keyword; a constexpr parameter left
    out takes its default."""
    names = kernel.arg_names
    if len(types) + len(constants) > len(names):
        raise TypeError(f"{kernel.__name__}: {len(types)} arguments and {len(constants)} constants for "
                        f"{len(names)} parameters")
    signature, constexprs, attrs = {}, {}, {}
    for i, kind in enumerate(types):
        if kind == 1:
            signature[names[i]], constexprs[names[i]] = "constexpr", 1
        else:
            signature[names[i]] = kind
            if kind.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", POINTER_DIVISIBILITY]]
    parameters = inspect.signature(kernel.fn).parameters
    for name in names[len(types):]:
        if name in constants:
            value = constants[name]
        elif parameters[name].default is not inspect.Parameter.empty:
            value = parameters[name].default
        else:
            raise TypeError(f"{kernel.__name__}: no value for its parameter {name!r}")
        signature[name], constexprs[name] = "constexpr", value
    return signature, constexprs, attrs


@lru_cache(maxsize=1024)
def compile_kernel(kernel, types: tuple, constants: tuple, num_warps: int, num_stages: int,
                   capability: int) -> Compiled:
    """``kernel`` compiled for compute capability ``capability`` (e.g. 90) by ``triton.compile`` (its disk
    cache applies)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = triton_signature(kernel, types, dict(constants))
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    meta, ptx = compiled.metadata, compiled.asm["ptx"]
    own = sum(kind != 1 for kind in types)
    declared = entry_parameters(ptx)
    if declared != own + HIDDEN_PARAMETERS:
        raise RuntimeError(
            f"{kernel.__name__}: triton {triton.__version__} compiled {declared} parameters for {own} arguments; "
            f"moe_jax.triton_call passes the global scratch as parameter {own} of {own + HIDDEN_PARAMETERS} "
            f"(triton 3.5-3.6's calling convention)")
    return Compiled(meta.name, ptx, meta.shared, meta.global_scratch_size, meta.global_scratch_align,
                    compiled.asm["cubin"])


def entry_parameters(ptx: str) -> int:
    """How many parameters the kernel entry of ``ptx`` declares."""
    start = ptx.index(".entry")
    return ptx[start:ptx.index(")", start)].count(".param")


@cache
def _jaxlib_triton() -> ModuleType:
    from jax._src.lib import gpu_triton
    if not hasattr(gpu_triton, "TritonKernelCall"):
        raise ImportError("jaxlib has no Triton launcher here (jax._src.lib.gpu_triton.TritonKernelCall): "
                          "a CUDA build of jaxlib is needed (pip install 'jax[cuda13]')")
    return gpu_triton


def compute_capability(device=None) -> int:
    """The compute capability of a CUDA device as an integer (9.0 -> 90); default: JAX's first device."""
    device = jax.devices()[0] if device is None else device
    major, minor = str(device.compute_capability).split(".")
    return int(major) * 10 + int(minor)


def _compiled(kernel, args: list, out_shapes: list, constants: dict, num_warps: int,
              num_stages: int) -> tuple[tuple, Compiled, int]:
    capability = compute_capability()
    types = tuple(argument_type(a) for a in (*args, *out_shapes))
    compiled = compile_kernel(kernel, types, tuple(sorted(constants.items())), num_warps, num_stages, capability)
    return types, compiled, capability


def _results(out_shapes: list, compiled: Compiled, grid: int) -> list:
    """The call's results: the outputs, then the global scratch (programs x bytes) where the kernel takes one."""
    if not compiled.scratch_bytes:
        return list(out_shapes)
    return [*out_shapes, jax.ShapeDtypeStruct((grid * compiled.scratch_bytes,), jnp.uint8)]


# the kinds of moe_triton_launch's `parameters` pairs (triton_launch.cc)
ARGUMENT, RESULT, ZEROED_RESULT, INT32, INT64, NULL_POINTER = range(6)


@cache
def _launcher_library() -> ctypes.CDLL:
    """triton_launch.cc, built and registered as the CUDA target ``moe_triton_launch``."""
    import jaxlib
    import triton
    from moe_shared import native

    driver_headers = Path(triton.__file__).parent / "backends" / "nvidia" / "include"  # triton's cuda.h
    library, reason = native.load_library(LAUNCH_SOURCE, include_dirs=(str(driver_headers), jax.ffi.include_dir()),
                                          key=f"jaxlib {jaxlib.__version__}")
    if library is None:
        raise RuntimeError(f"moe_jax's Triton launcher cannot be built: {reason} (jaxlib's launcher needs no build: "
                           f"moe_jax.backends.triton.use_launcher(moe_jax.backends.triton.JAXLIB_LAUNCHER))")
    library.moe_triton_register.restype = ctypes.c_int64
    library.moe_triton_register.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int32,
                                            ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
    library.moe_triton_driver_error.restype = ctypes.c_char_p
    library.moe_triton_captured_launches.restype = ctypes.c_int64
    from jaxlib import xla_client
    jax.ffi.register_ffi_target(LAUNCH_TARGET, jax.ffi.pycapsule(library.moe_triton_launch), platform="CUDA")
    jax.ffi.register_ffi_target(GRAPHED_LAUNCH_TARGET, jax.ffi.pycapsule(library.moe_triton_launch_graphed),
                                platform="CUDA", traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
    return library


def captured_launches() -> int:
    """How many of this process's ``moe_triton_launch_graphed`` launches were recorded into a CUDA graph being
    captured (XLA tracing a command buffer it then replays) instead of being sent to the GPU."""
    return _launcher_library().moe_triton_captured_launches()


@lru_cache(maxsize=None)
def kernel_id(compiled: Compiled, num_warps: int) -> int:
    """The id under which ``moe_triton_launch`` knows ``compiled`` (registered at the first call)."""
    if not compiled.cubin:
        raise ValueError(f"{compiled.name}: no cubin to register (compiled without triton's ptxas)")
    library = _launcher_library()
    error = ctypes.create_string_buffer(512)
    found = library.moe_triton_register(compiled.name.encode(), compiled.cubin, len(compiled.cubin), num_warps,
                                        compiled.shared, error, len(error))
    if found < 0:
        raise RuntimeError(f"{compiled.name}: moe_triton_register failed: {error.value.decode()}")
    return found


def launch_parameters(args: list, types: tuple, out_count: int, zeroed: tuple[int, ...],
                      scratch: bool) -> list[int]:
    """``moe_triton_launch``'s ``parameters`` attribute: a (kind, value) pair per kernel parameter, in order: the
    arguments (an array as its operand index, an integer as itself; 1s are constants, not parameters), the
    outputs (result indices, zeroed ones marked), then triton's two hidden pointers: the global scratch (the last
    result, or null) and the profile scratch (null)."""
    pairs, operand = [], 0
    for arg, kind in zip(args, types):
        if kind == 1:
            continue
        if isinstance(arg, int):
            pairs += [INT32 if kind == "i32" else INT64, arg]
        else:
            pairs += [ARGUMENT, operand]
            operand += 1
    for i in range(out_count):
        pairs += [ZEROED_RESULT if i in zeroed else RESULT, i]
    pairs += [RESULT, out_count] if scratch else [NULL_POINTER, 0]
    return pairs + [NULL_POINTER, 0]


def launch(kernel, grid: int, args: list, out_shapes: list, constants: dict, *, num_warps: int,
           num_stages: int, zeroed: tuple[int, ...] = (), target: str = LAUNCH_TARGET) -> list:
    """Run ``kernel`` over a 1-D ``grid`` on ``args`` (arrays and integers, in its parameter order) with the
    outputs ``out_shapes`` (``jax.ShapeDtypeStruct``, following the arguments) and ``constants`` (constexpr
    keywords); the outputs in ``zeroed`` start as zeros. One call of ``target`` (``LAUNCH_TARGET``, or
    ``GRAPHED_LAUNCH_TARGET`` to let XLA capture it into a CUDA graph with its neighbours). Returns the output
    arrays."""
    types, compiled, _ = _compiled(kernel, args, out_shapes, constants, num_warps, num_stages)
    parameters = launch_parameters(args, types, len(out_shapes), zeroed, bool(compiled.scratch_bytes))
    if target not in (LAUNCH_TARGET, GRAPHED_LAUNCH_TARGET):
        raise ValueError(f"target: expected {LAUNCH_TARGET!r} or {GRAPHED_LAUNCH_TARGET!r}, got {target!r}")
    outputs = jax.ffi.ffi_call(target, _results(out_shapes, compiled, grid))(
        *[a for a in args if not isinstance(a, int)], kernel=np.int64(kernel_id(compiled, num_warps)),
        grid=np.int64(grid), parameters=np.asarray(parameters, np.int64))
    return list(outputs[:len(out_shapes)])


def launch_jaxlib(kernel, grid: int, args: list, out_shapes: list, constants: dict, *, num_warps: int,
                  num_stages: int, zeroed: tuple[int, ...] = ()) -> list:
    """``launch`` through jaxlib's Triton launcher (the compressed PTX in each call's opaque string)."""
    lib = _jaxlib_triton()
    types, compiled, capability = _compiled(kernel, args, out_shapes, constants, num_warps, num_stages)
    params = []
    for arg, kind in zip(args, types):
        if kind == 1:
            continue
        if isinstance(arg, int):
            params.append(lib.create_scalar_parameter(arg, kind))
        else:
            params.append(lib.create_array_parameter(0, POINTER_DIVISIBILITY))
    for i, shape in enumerate(out_shapes):
        zero_bytes = int(np.prod(shape.shape)) * jnp.dtype(shape.dtype).itemsize if i in zeroed else 0
        params.append(lib.create_array_parameter(zero_bytes, POINTER_DIVISIBILITY))
    if compiled.scratch_bytes:
        params.append(lib.create_array_parameter(0, max(compiled.scratch_align, POINTER_DIVISIBILITY)))
    call = lib.TritonKernelCall(
        lib.TritonKernel(compiled.name, num_warps, 1, compiled.shared, compiled.ptx, "", capability),
        grid, 1, 1, params)
    opaque = zlib.compress(call.to_proto(compiled.name, b""))
    outputs = jax.ffi.ffi_call(TARGET, _results(out_shapes, compiled, grid), custom_call_api_version=2,
                               legacy_backend_config=opaque)(*[a for a in args if not isinstance(a, int)])
    return list(outputs[:len(out_shapes)])
