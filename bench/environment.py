"""What the results were measured on: device name and tag, library versions, commit."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def stolen_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """CPU time the hypervisor has taken from this machine's CPUs, all of them together, since boot (the ``steal``
    column of /proc/stat's ``cpu`` line); None where the kernel does not report it."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_name()} ({cores()} cores)"


def device_tag(device: torch.device) -> str:
    """"nvidia-h200", "cpu-2core": the results sub-folder."""
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{cores()}core"


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


# the packages the kernel backends and peers run on, recorded where installed (distribution names)
KERNEL_PACKAGES = ("jax-triton", "sonic-moe", "quack-kernels", "nvidia-cutlass-dsl", "apache-tvm-ffi",
                   "torch-c-dlpack-ext", "sgl-deep-gemm", "kernels", "transformers", "tokamax")


# the environment variables, set before the process started, that change what a point measures: glibc's allocator
# (memory kept between steps or handed back, README "CPU"; moe_jax's setting of it), the kernel library's huge pages,
# the thread counts, XLA's flags and which GPU client runs JAX's calls and how it waits for them
TIMING_VARIABLES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES",
                    "LD_PRELOAD", "MOE_JAX_MALLOC", "MOE_EXPERTS_HUGE_PAGES", "OMP_NUM_THREADS", "XLA_FLAGS",
                    "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT", "XLA_CUDA_HOST_CALLBACK_SPINWAIT")


def timing_environment() -> dict[str, str]:
    """The TIMING_VARIABLES that are set, with their values."""
    return {name: os.environ[name] for name in TIMING_VARIABLES if name in os.environ}


def versions() -> dict:
    installed = {name: _version(name) for name in KERNEL_PACKAGES}
    return {"torch": torch.__version__, "jax": _version("jax"), "triton": _version("triton"),
            "python": platform.python_version(), "packages": {k: v for k, v in installed.items() if v is not None}}
