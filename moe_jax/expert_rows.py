"""The expert loop's row kernel on CPU: ``x[:count] @ w[e].T`` in float32 for a block of a few rows, reading expert
e's bfloat16 weights where they lie in ``w`` [E, N, K].

XLA:CPU copies a dynamic slice of the weights before every dot, and at decode that copy costs as much as the dot
(qwen3-cpu, 2-row blocks: 85 us to copy an expert's gate/up weights, 80 us for the dot). This kernel
(``expert_rows.cc``, an XLA FFI custom call on AMX tiles where the CPU has them, else AVX512-BF16 dot
products) reads them in place and skips the block's padding rows. It is built on first use with the host's C++
compiler (``$CXX``, else ``c++``) against jaxlib's FFI headers, into ``$MOE_EXPERTS_CACHE`` (default
``~/.cache/moe_experts``).

``MOE_JAX_ROW_KERNEL``: ``auto`` (default) uses it where the host has AVX512-BF16, the build succeeds and JAX's
default backend is the CPU, else XLA's dots (with a warning when the build failed); ``on`` raises ``RuntimeError`` with the reason where it cannot
run; ``off`` never uses it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp

SOURCE = Path(__file__).with_name("expert_rows.cc")
TARGET = "moe_expert_rows"
CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")  # as /proc/cpuinfo spells them
COMPILE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile",
                 "-mamx-bf16", "-w")
AMX_FLAGS = ("amx_tile", "amx_bf16")
MODES = ("auto", "on", "off")


def mode() -> str:
    value = os.environ.get("MOE_JAX_ROW_KERNEL", "auto")
    if value not in MODES:
        raise ValueError(f"MOE_JAX_ROW_KERNEL: expected one of {MODES}, got {value!r}")
    return value


@cache
def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags, as /proc/cpuinfo spells them (none where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def _cache_dir() -> Path:
    return Path(os.environ.get("MOE_EXPERTS_CACHE") or Path.home() / ".cache" / "moe_experts")


def _build(compiler: str) -> Path:
    """The shared library, compiled once per source, flags, compiler and jaxlib (RuntimeError when it fails)."""
    import jaxlib
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *COMPILE_FLAGS, compiler, version,
                                    jaxlib.__version__]).encode()).hexdigest()[:16]
    library = _cache_dir() / f"expert_rows-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        run = subprocess.run([compiler, *COMPILE_FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(built)],
                             capture_output=True, text=True, timeout=300)
        if run.returncode:
            raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {run.stderr.strip()[-800:]}")
        built.replace(library)  # atomic: concurrent builders leave one complete file
    return library


@cache
def unavailable() -> str | None:
    """Why the row kernel cannot run on this host (None: it is built and registered)."""
    missing = [flag for flag in CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not compiler:
        return "no C++ compiler found (set CXX)"
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        return str(error)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.moe_expert_rows), platform="cpu")
    _LOADED.append(library)
    return None


_LOADED: list = []  # the loaded library stays referenced while the process runs


def enabled() -> bool:
    """Whether the expert loop uses the row kernel (see ``MOE_JAX_ROW_KERNEL``). ``auto`` uses it only in a
    process whose default backend is the CPU: beside an accelerator, grouped_mm's CPU branch is traced but not what
    runs (``platform_dependent``), and nothing is built or registered for it."""
    chosen = mode()
    if chosen == "off" or (chosen == "auto" and jax.default_backend() != "cpu"):
        return False
    reason = unavailable()
    if reason and chosen == "on":
        raise RuntimeError(f"MOE_JAX_ROW_KERNEL=on, but the row kernel cannot run: {reason}")
    if reason and not reason.startswith("the CPU lacks"):
        _warn_once(reason)
    return reason is None


@cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"moe_jax: the CPU row kernel is not used ({reason}); the expert loop runs XLA's dots",
                  RuntimeWarning, stacklevel=3)


def amx() -> bool:
    """Whether the kernel runs on AMX tiles (where the CPU has them and Linux grants this process their state;
    ``MOE_JAX_ROW_KERNEL_AMX=0`` turns it off), else on AVX512-BF16 dot products."""
    return os.environ.get("MOE_JAX_ROW_KERNEL_AMX", "1") != "0" and _amx_granted()


@cache
def _amx_granted() -> bool:
    if not all(flag in cpu_flags() for flag in AMX_FLAGS):
        return False
    try:  # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), as the kernel asks too
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


def expert_rows(x, weights, expert, count):
    """float32 [B, N]: the first ``count`` rows of ``x`` [B, K] times ``weights[expert]`` [N, K] transposed, zeros
    below them; bfloat16 operands, ``expert`` and ``count`` int32 scalars."""
    B, N = x.shape[0], weights.shape[1]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((B, N), jnp.float32), vmap_method="sequential")
    return call(x, weights, jnp.asarray(expert, jnp.int32), jnp.asarray(count, jnp.int32), amx=amx())
