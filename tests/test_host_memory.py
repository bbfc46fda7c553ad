"""moe_jax.host_memory: glibc's allocator set at import where JAX runs on the CPU, and what it changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moe_jax import host_memory

# a new thread writes a freed-and-reallocated 100 MB block twice: the page faults of each round (that thread's own)
_ROUNDS = """
import ctypes, json, resource, threading
import moe_jax
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size, faults = 100 << 20, []
def rounds():
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(json.dumps({"state": moe_jax.host_memory.STATE, "faults": faults}))
"""


def _rounds(setting: str) -> dict:
    env = dict(os.environ, MOE_JAX_MALLOC=setting)
    out = subprocess.run([sys.executable, "-c", _ROUNDS], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux")
def test_set_allocator_reuses_a_threads_freed_pages_where_the_default_maps_them_again():
    """With the setting, a worker thread's second 100 MB block lands on the pages of its first (almost no page
    faults); with glibc's default it is a new mapping, faulted in again page by page (what each JAX training step's
    weight gradients paid)."""
    kept, default = _rounds("keep"), _rounds("default")
    assert kept["state"].startswith("set:") and default["state"].startswith("left as it was")
    first, second = default["faults"]
    assert first > 1000 and second > first / 2, default
    first, second = kept["faults"]
    assert first > 1000 and second < first / 10, kept


@pytest.mark.parametrize("setting, platforms, plugins, libc, wanted, why", [
    ("auto", None, [], "glibc", True, "no accelerator plugin"),
    ("auto", None, ["xla_cuda13"], "glibc", False, "accelerator plugins installed: xla_cuda13"),
    ("auto", "cpu", ["xla_cuda13"], "glibc", True, "JAX_PLATFORMS puts the CPU first"),
    ("auto", "cuda,cpu", [], "glibc", False, "JAX_PLATFORMS puts 'cuda' first"),
    ("auto", None, [], "", False, "not glibc"),
    ("keep", "cuda", ["xla_cuda13"], "glibc", True, "MOE_JAX_MALLOC=keep"),
    ("keep", None, [], "musl", False, "not glibc"),
    ("default", None, [], "glibc", False, "MOE_JAX_MALLOC=default"),
])
def test_decide(setting, platforms, plugins, libc, wanted, why):
    got, reason = host_memory.decide(setting, platforms, plugins, libc)
    assert got == wanted and why in reason


def test_a_bad_setting_names_the_variable():
    with pytest.raises(ValueError, match=r"MOE_JAX_MALLOC: expected one of \['auto', 'keep', 'default'\], got 'on'"):
        host_memory.decide("on", None, [], "glibc")


def test_this_process_state_says_what_import_did():
    """This CPU-only install: set at import unless the variable turned it off."""
    expected = "left as it was" if os.environ.get("MOE_JAX_MALLOC") == "default" else "set:"
    assert host_memory.STATE.startswith(expected)
    assert host_memory.accelerator_plugins() == []
