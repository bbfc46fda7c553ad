"""glibc's allocator where JAX runs on the CPU: one arena, freed blocks kept for the next step.

XLA's CPU runtime allocates a jitted step's buffers from its worker threads. glibc serves each of those threads from
an arena of its own, which maps every block over 64 MB afresh and unmaps it when it is freed, so each training step
writes its weight gradients (qwen3-cpu: 150 MB a step) into new pages and pays a page fault every 4 KB. Where JAX
runs on the CPU, importing moe_jax sets glibc (``mallopt``) to serve every thread from its main arena, to take blocks
up to 2 GB from the heap and to keep up to 4 GB of freed heap: the next step's buffers reuse pages already in memory
(a qwen3-cpu T=16 ``grouped_mm`` training step on a 2-core EPYC: 62 -> 27 ms; the same as setting
``MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000`` before the process
starts). It binds the threads whose first allocation comes after it: import moe_jax before JAX runs anything (set
after, the step above stays at 62 ms). The cost: freed memory stays with the process (up to 4 GB of it) and every
thread allocates from one arena.

``MOE_JAX_MALLOC``: ``auto`` (the default: set where JAX runs on the CPU, i.e. ``JAX_PLATFORMS`` names ``cpu`` first,
or is unset and no accelerator plugin is installed), ``keep`` (set wherever glibc is), ``default`` (never set).
``STATE`` says what importing moe_jax did and why.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import platform
import pkgutil

VARIABLE = "MOE_JAX_MALLOC"
SETTINGS = ("auto", "keep", "default")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
MALLOPT = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, 2_000_000_000), (M_TRIM_THRESHOLD, 4_000_000_000))
ACCELERATOR_MODULES = ("libtpu",)  # JAX finds TPUs through this module; GPU plugins through jax_plugins

STATE = "not set yet"


def accelerator_plugins() -> list[str]:
    """The JAX PJRT plugins installed besides the CPU (entry points and ``jax_plugins`` modules, as JAX finds
    them), and libtpu."""
    found = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        found += [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
    found += [name for name in ACCELERATOR_MODULES if importlib.util.find_spec(name) is not None]
    return sorted(set(found))


def decide(setting: str, jax_platforms: str | None, plugins: list[str], libc: str) -> tuple[bool, str]:
    """(whether to set glibc's allocator, why) for a ``MOE_JAX_MALLOC`` value, the ``JAX_PLATFORMS`` variable (None:
    unset), the accelerator plugins installed and the C library (``platform.libc_ver()[0]``)."""
    if setting not in SETTINGS:
        raise ValueError(f"{VARIABLE}: expected one of {list(SETTINGS)}, got {setting!r}")
    if setting == "default":
        return False, f"{VARIABLE}=default"
    if libc != "glibc":
        return False, f"the C library is {libc or 'unknown'}, not glibc"
    if setting == "keep":
        return True, f"{VARIABLE}=keep"
    if jax_platforms:
        first = jax_platforms.split(",")[0].strip()
        if first == "cpu":
            return True, "JAX_PLATFORMS puts the CPU first"
        return False, f"JAX_PLATFORMS puts {first!r} first"
    if plugins:
        return False, f"accelerator plugins installed: {', '.join(plugins)}"
    return True, "no accelerator plugin installed: JAX runs on the CPU"


def apply() -> str:
    """Set glibc's allocator as ``decide`` says for this process; returns (and stores in ``STATE``) what was done."""
    global STATE
    wanted, why = decide(os.environ.get(VARIABLE, "auto"), os.environ.get("JAX_PLATFORMS"), accelerator_plugins(),
                         platform.libc_ver()[0])
    if not wanted:
        STATE = f"left as it was ({why})"
        return STATE
    mallopt = ctypes.CDLL(None).mallopt
    refused = [option for option, value in MALLOPT if mallopt(option, value) != 1]
    STATE = (f"set: one arena, blocks up to 2 GB from the heap, 4 GB of freed heap kept ({why})" if not refused
             else f"glibc refused mallopt options {refused} ({why})")
    return STATE
