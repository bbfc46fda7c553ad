"""The native builds: the CPU row kernel's (``kernels/expert_rows.h``, ``slot_rows.h``, ``weight_grads.h``,
``zero_pages.h``; one binding per framework) and moe_jax's Triton launcher (``load_library``): compiled on the
user's machine at first use with the host's C++ compiler (``$CXX``, else ``c++``) into ``$MOE_EXPERTS_CACHE``
(default ``~/.cache/moe_experts``), cached by source, every kernel header, flags, compiler and the binding's own key
(its framework's version).

Each binding has a mode variable (``MOE_JAX_ROW_KERNEL``, ``MOE_TORCH_ROW_KERNEL``): ``auto`` (default) uses the
kernel where the CPU has AVX512-BF16 and the build succeeds (warning once when the build fails); ``on`` raises
``RuntimeError`` with the reason where it cannot run; ``off`` never uses it. ``<variable>_AMX=0`` keeps the kernel
off AMX tiles (AVX512-BF16 dot products instead).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

KERNEL_DIR = Path(__file__).with_name("kernels")  # expert_rows.h, slot_rows.h, weight_grads.h, zero_pages.h
CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")  # as /proc/cpuinfo spells them
AMX_FLAGS = ("amx_tile", "amx_bf16")
# -ffp-contract=off: products and sums rounded as written, never fused (expert_rows_add gives XLA's scatter-add bits)
COMPILE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-mavx512f", "-mavx512bw", "-mavx512bf16",
                 "-mamx-tile", "-mamx-bf16", "-ffp-contract=off", "-w")
LIBRARY_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-w")  # no CPU-specific code (load_library)
MODES = ("auto", "on", "off")
# With MOE_EXPERTS_HUGE_PAGES=1, CPU buffers from this size on are asked for transparent huge pages (both
# bindings): a weight gradient of qwen3-cpu's gate/up weights (100 MB, fresh memory every call) took 49 ms to write
# on 4 KB pages and 28 ms on 2 MB ones (8 rows per expert; 15 ms in memory touched before): the first touch of each
# page is a fault. glibc gives allocations of 32 MB and more (its largest mmap threshold) a mapping of their own, so
# the hint reaches no other allocation's memory. Off by default: on the 2-core VMs measured, steps on advised
# memory were faster at the median but one in ten or so stalled for up to a second (README, "CPU"); the zeros of
# idle experts' rows need no pages at all since zero_pages.h.
HUGE_PAGES_FROM_BYTES = 32 << 20
HUGE_PAGES_VARIABLE = "MOE_EXPERTS_HUGE_PAGES"


def huge_pages_from_bytes() -> int | None:
    """The buffer size from which the bindings ask for transparent huge pages where ``MOE_EXPERTS_HUGE_PAGES`` is
    ``1``; None where it is ``0`` (the default)."""
    value = os.environ.get(HUGE_PAGES_VARIABLE, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{HUGE_PAGES_VARIABLE}: expected '0' or '1', got {value!r}")
    return HUGE_PAGES_FROM_BYTES if value == "1" else None


def mode(variable: str) -> str:
    value = os.environ.get(variable, "auto")
    if value not in MODES:
        raise ValueError(f"{variable}: expected one of {MODES}, got {value!r}")
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


def amx(variable: str) -> bool:
    """Whether the kernel runs on AMX tiles: where the CPU has them, Linux grants this process their state and
    ``<variable>_AMX`` is not ``0``."""
    return os.environ.get(f"{variable}_AMX", "1") != "0" and _amx_granted()


@cache
def _amx_granted() -> bool:
    if not all(flag in cpu_flags() for flag in AMX_FLAGS):
        return False
    try:  # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), as the kernel asks too
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0
    except (OSError, AttributeError):
        return False


def _cache_dir() -> Path:
    return Path(os.environ.get("MOE_EXPERTS_CACHE") or Path.home() / ".cache" / "moe_experts")


def _build(compiler: str, source: Path, include_dirs: Sequence[str], key: str, flags: Sequence[str]) -> Path:
    """The shared library, compiled once per source, header, flags, compiler and key (RuntimeError when it
    fails)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    texts = [source.read_text(), *(header.read_text() for header in sorted(KERNEL_DIR.glob("*.h")))]
    parts = [*texts, *flags, compiler, version, key]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    library = _cache_dir() / f"{source.stem}-{digest}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    includes = [arg for d in (str(KERNEL_DIR), *include_dirs) for arg in ("-I", d)]
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = Path(scratch) / library.name
        run = subprocess.run([compiler, *flags, *includes, str(source), "-o", str(built)],
                             capture_output=True, text=True, timeout=300)
        if run.returncode:
            raise RuntimeError(f"{compiler} failed on {source.name}: {run.stderr.strip()[-800:]}")
        built.replace(library)  # atomic: concurrent builders leave one complete file
    return library


def load(source: Path, include_dirs: Sequence[str] = (), key: str = "",
         flags: Sequence[str] = ()) -> tuple[ctypes.CDLL | None, str | None]:
    """(the built binding, None), or (None, why the row kernel cannot run on this host). ``flags``: the binding's
    own compiler flags, after COMPILE_FLAGS."""
    missing = [flag for flag in CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        return None, f"the CPU lacks {', '.join(missing)}"
    return load_library(source, include_dirs, key, (*COMPILE_FLAGS, *flags))


def load_library(source: Path, include_dirs: Sequence[str] = (), key: str = "",
                 flags: Sequence[str] = LIBRARY_FLAGS) -> tuple[ctypes.CDLL | None, str | None]:
    """(the built library, None), or (None, why it cannot be built or loaded): ``source`` compiled with ``flags``
    on any host."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not compiler:
        return None, "no C++ compiler found (set CXX)"
    try:
        return ctypes.cdll.LoadLibrary(str(_build(compiler, source, include_dirs, key, flags))), None
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        return None, str(error)


def enabled(variable: str, unavailable: Callable[[], str | None], fallback: str) -> bool:
    """Whether a binding uses the row kernel under ``variable``'s mode; ``unavailable()`` builds it (or says why
    not); ``fallback`` says what runs instead, for the warning."""
    chosen = mode(variable)
    if chosen == "off":
        return False
    reason = unavailable()
    if reason and chosen == "on":
        raise RuntimeError(f"{variable}=on, but the row kernel cannot run: {reason}")
    if reason and not reason.startswith("the CPU lacks"):
        warn_once(reason, fallback)
    return reason is None


@cache
def warn_once(reason: str, fallback: str) -> None:
    warnings.warn(f"the CPU row kernel is not used ({reason}): {fallback}", RuntimeWarning, stacklevel=4)
