"""Requirement checks that need no framework: compute capability, the CUDA toolkit, a binary distribution's
framework ABI, quantized scale formats, and importing a required package.

Each raises at the first call with what is missing, what was expected and what was found: RuntimeError for the
hardware and the toolkit, ImportError for packages (naming the pip extra, or the build to install), ValueError for
arguments. Data come from the spec (``Requirements``); nothing here falls back to anything else.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .spec import Requirements, version_tuple

DEFAULT_CUDA_ROOT = "/usr/local/cuda"
TOOLKIT_VARIABLES = ("CUDA_HOME", "CUDA_PATH")  # then nvcc on PATH, then DEFAULT_CUDA_ROOT: DeepGEMM's own order

_NVCC_VERSIONS: dict[str, tuple[int, int]] = {}
_LOADED: dict[tuple, ModuleType] = {}


def _dotted(version) -> str:
    return ".".join(str(v) for v in version)


def for_capability(table: Mapping, compute_capability: tuple[int, int]):
    """The value of ``table`` (minimum compute capability -> value, keys as tuples or "9.0") whose key is the
    highest one at or below ``compute_capability``; None when every key is above it."""
    keys = [k for k in table if tuple(version_tuple(k) if isinstance(k, str) else k) <= tuple(compute_capability)]
    return table[max(keys, key=lambda k: version_tuple(k) if isinstance(k, str) else k)] if keys else None


def check_compute_capability(backend: str, needed: tuple[int, int] | None, compute_capability: tuple[int, int],
                             where: str) -> None:
    if needed is not None and tuple(compute_capability) < tuple(needed):
        raise RuntimeError(f"implementation {backend!r} needs CUDA compute capability >= {_dotted(needed)}, "
                           f"got {_dotted(compute_capability)} on {where}")


@dataclass(frozen=True)
class Toolkit:
    root: str
    found_by: str  # "CUDA_HOME", "CUDA_PATH", "nvcc on PATH" or DEFAULT_CUDA_ROOT

    @property
    def nvcc(self) -> Path:
        return Path(self.root) / "bin" / "nvcc"


def find_cuda_toolkit(backend: str, environ: Mapping[str, str] | None = None) -> Toolkit:
    """The CUDA toolkit DeepGEMM compiles with: CUDA_HOME, CUDA_PATH, the root of the nvcc on PATH (two levels up),
    then /usr/local/cuda. Raises RuntimeError when there is none."""
    env = os.environ if environ is None else environ
    for variable in TOOLKIT_VARIABLES:
        if env.get(variable):
            return Toolkit(env[variable], variable)
    nvcc = shutil.which("nvcc", path=env.get("PATH", ""))
    if nvcc is not None:
        return Toolkit(str(Path(nvcc).parent.parent), "nvcc on PATH")
    if os.path.exists(DEFAULT_CUDA_ROOT):
        return Toolkit(DEFAULT_CUDA_ROOT, DEFAULT_CUDA_ROOT)
    raise RuntimeError(f"implementation {backend!r} needs a CUDA toolkit with nvcc (it compiles its kernels at run "
                       f"time), got none: CUDA_HOME and CUDA_PATH are unset, no nvcc on PATH, no "
                       f"{DEFAULT_CUDA_ROOT}; install the CUDA toolkit and set CUDA_HOME to it")


def nvcc_version(nvcc: str | Path) -> tuple[int, int]:
    """(major, minor) from ``nvcc --version`` ("... release 12.3, V12.3.107"); read once per path."""
    key = str(nvcc)
    if key not in _NVCC_VERSIONS:
        try:
            done = subprocess.run([key, "--version"], capture_output=True, text=True, timeout=60)
            output = done.stdout + done.stderr
        except (OSError, subprocess.SubprocessError) as err:
            raise RuntimeError(f"{key} --version failed: {err}") from err
        found = re.search(r"release (\d+)\.(\d+)", output)
        if found is None:
            raise RuntimeError(f"{key} --version printed no 'release X.Y': {output.strip()[:300]!r}")
        _NVCC_VERSIONS[key] = (int(found[1]), int(found[2]))
    return _NVCC_VERSIONS[key]


def check_toolkit(backend: str, minimums: Mapping[tuple[int, int], tuple[int, int]],
                  compute_capability: tuple[int, int], environ: Mapping[str, str] | None = None) -> Toolkit:
    """The toolkit, after checking that it has nvcc (a runtime-only install has not) at the version ``minimums``
    asks for the device's compute capability. RuntimeError otherwise."""
    toolkit = find_cuda_toolkit(backend, environ)
    needed = for_capability(minimums, compute_capability)
    wanted = f"nvcc >= {_dotted(needed)}" if needed else "nvcc"
    if not (toolkit.nvcc.is_file() and os.access(toolkit.nvcc, os.X_OK)):
        raise RuntimeError(f"implementation {backend!r} needs a full CUDA toolkit with {wanted} (it compiles its "
                           f"kernels at run time), got {toolkit.root} (from {toolkit.found_by}) without bin/nvcc, a "
                           f"runtime-only install; install the toolkit and set CUDA_HOME to it")
    version = nvcc_version(toolkit.nvcc)
    if needed is not None and version < tuple(needed):
        raise RuntimeError(f"implementation {backend!r} needs {wanted} on compute capability "
                           f"{_dotted(compute_capability)}, got nvcc {_dotted(version)} at {toolkit.nvcc} "
                           f"(from {toolkit.found_by})")
    return toolkit


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_abi(backend: str, abi: Mapping) -> None:
    """ImportError unless the installed build of ``abi["distribution"]`` is one ``abi["builds"]`` records for the
    installed ``abi["framework"]``. A package not installed from that distribution (built from source against the
    local framework) is not checked."""
    dist, framework, builds = abi["distribution"], abi["framework"], abi["builds"]
    build = installed_version(dist)
    if build is None:
        return
    have = installed_version(framework)
    if have is not None and _major_minor(have) in builds.get(build, ()):
        return
    matching = [b for b, versions in builds.items() if have is not None and _major_minor(have) in versions]
    built_for = (f"built against {framework} {', '.join(builds[build])}" if build in builds else
                 f"a build whose {framework} ABI is not recorded (recorded: " +
                 "; ".join(f"{b} for {framework} {', '.join(v)}" for b, v in builds.items()) + ")")
    fix = (f"pip install '{dist}=={matching[-1]}'" if matching else
           f"no recorded {dist} build is for it: install {framework} " +
           " or ".join(sorted({v for versions in builds.values() for v in versions})))
    raise ImportError(f"implementation {backend!r} needs the {dist} build for the installed {framework} "
                      f"{have or '(none)'}: {dist} {build} is {built_for}; {fix}")


def install_command(requires: Requirements, package: str | None = None) -> str:
    """The pip command(s) that install a backend's packages: its extra (``package``'s, or every one), then each
    distribution pinned in ``requires.versions`` without its dependencies (their own pins conflict with ours)."""
    extras = [requires.packages[package]] if package is not None else sorted(set(requires.packages.values()))
    commands = [f"pip install 'moe-experts[{','.join(extras)}]'"] if extras else []
    commands += [f"pip install --no-deps '{dist}=={allowed[-1]}'" for dist, allowed in requires.versions.items()]
    return " && ".join(commands)


def check_versions(backend: str, versions: Mapping[str, tuple[str, ...]], requires: Requirements) -> None:
    """ImportError unless each distribution of ``versions`` is installed at one of its listed versions (a backend
    that calls a package's internals runs only the versions it was verified with)."""
    for dist, allowed in versions.items():
        have = installed_version(dist)
        if have not in allowed:
            raise ImportError(f"implementation {backend!r} needs {dist} {' or '.join(allowed)}, got "
                              f"{have or 'none installed'}: {install_command(requires)}")


def check_scales(backend: str, rules: Mapping[str, list], compute_capability: tuple[int, int], scales: str) -> None:
    """ValueError unless quantized experts' ``scales`` format is one ``rules`` (minimum compute capability -> scale
    formats the kernels read) allows on this device: float32 scales on Blackwell must not run."""
    allowed = for_capability(rules, compute_capability) or []
    if scales not in allowed:
        raise ValueError(f"scales: implementation {backend!r} reads {list(allowed)} scales on compute capability "
                         f"{_dotted(compute_capability)}, got {scales}")


def import_required(backend: str, requires: Requirements, package: str) -> ModuleType:
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise ImportError(f"implementation {backend!r} needs the package {package!r}: "
                          f"{install_command(requires, package)} ({err})") from err


HUB_CACHE_VARIABLES = ("KERNELS_CACHE", "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def hub_cache_roots(environ: Mapping[str, str] | None = None) -> list[Path]:
    """Where the ``kernels`` package keeps hub kernels: KERNELS_CACHE, else huggingface_hub's cache (HF_HUB_CACHE,
    HF_HOME/hub, XDG_CACHE_HOME or ~/.cache, then huggingface/hub)."""
    env = os.environ if environ is None else environ
    if env.get("KERNELS_CACHE"):
        return [Path(env["KERNELS_CACHE"])]
    if env.get("HF_HUB_CACHE"):
        return [Path(env["HF_HUB_CACHE"])]
    if env.get("HF_HOME"):
        return [Path(env["HF_HOME"]) / "hub"]
    return [Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub"]


def hub_reference(hub: Mapping) -> str:
    """The ref a hub kernel is pinned to: its revision (a branch or tag), or ``v<version>``."""
    return hub["revision"] if "revision" in hub else f"v{hub['version']}"


def hub_snapshot(hub: Mapping, environ: Mapping[str, str] | None = None) -> Path | None:
    """The local snapshot folder of the hub kernel ``hub`` (``repo_id`` at ``hub_reference``), or None: read from
    the disk only, never the network (the cache's ``refs/<ref>`` file names the snapshot; the folder is
    ``kernels--<org>--<name>``, or ``models--...`` in older caches)."""
    name = hub["repo_id"].replace("/", "--")
    for root in hub_cache_roots(environ):
        for kind in ("kernels", "models"):
            folder = root / f"{kind}--{name}"
            ref = folder / "refs" / hub_reference(hub)
            if ref.is_file():
                snapshot = folder / "snapshots" / ref.read_text().strip()
                if snapshot.is_dir():
                    return snapshot
    return None


def _hub_install_hint(hub: Mapping) -> str:
    pin = f"revision={hub['revision']!r}" if "revision" in hub else f"version={hub['version']}"
    fetch = f"import kernels; kernels.get_kernel({hub['repo_id']!r}, {pin})"
    return (f"or put the hub build {hub['repo_id']} ({hub_reference(hub)}) in the local kernel cache (pip install "
            f"kernels, then once, online: python -c \"{fetch}\"): it is loaded from there, never downloaded at run "
            "time")


_HUB_CACHED: dict[tuple, bool] = {}


def hub_cached(requires: Requirements) -> bool:
    """Whether ``requires.hub`` names a build found in the local kernel cache (looked up once per cache folder)."""
    if requires.hub is None:
        return False
    key = (requires.hub["repo_id"], hub_reference(requires.hub), *hub_cache_roots())
    if key not in _HUB_CACHED:
        _HUB_CACHED[key] = hub_snapshot(requires.hub) is not None
    return _HUB_CACHED[key]


def package_missing(backend: str, requires: Requirements, package: str) -> str:
    """What to do about a missing ``package``: its pip command, and the hub build where ``requires`` names one."""
    hint = f"; {_hub_install_hint(requires.hub)}" if requires.hub is not None else ""
    return f"implementation {backend!r} needs the package {package!r}: {install_command(requires, package)}{hint}"


def load_hub_kernel(backend: str, requires: Requirements, package: str) -> ModuleType:
    """The hub build of ``package`` (``requires.hub``) from the local kernel cache, through the ``kernels``
    package's ``get_local_kernel``: ImportError when the ``kernels`` package or the build is missing, or when the
    build's ``__version__`` is not one ``requires.versions`` lists for ``hub["distribution"]``."""
    hub = requires.hub
    snapshot = hub_snapshot(hub)
    if snapshot is None:
        raise ImportError(f"{package_missing(backend, requires, package)} (not found under "
                          f"{', '.join(str(r) for r in hub_cache_roots())})")
    try:
        kernels = importlib.import_module("kernels")
    except ImportError as err:
        raise ImportError(f"implementation {backend!r}: the hub build {hub['repo_id']} is in the local cache "
                          f"({snapshot}), and loading it needs the kernels package: pip install kernels") from err
    try:
        module = kernels.get_local_kernel(snapshot)
    except FileNotFoundError as err:
        raise ImportError(f"implementation {backend!r}: the hub build {hub['repo_id']} in the local cache ({snapshot}) "
                          f"has no variant for this torch and CUDA ({err}): {install_command(requires, package)}; "
                          f"{_hub_install_hint(hub)}") from err
    allowed = requires.versions.get(hub.get("distribution", ""), ())
    found = getattr(module, "__version__", None)
    if allowed and found not in allowed:
        raise ImportError(f"implementation {backend!r} needs {hub['distribution']} {' or '.join(allowed)}, got the "
                          f"hub build {hub['repo_id']} ({hub_reference(hub)}) at version {found}: "
                          f"{install_command(requires)}")
    return module


def _installed(requires: Requirements, package: str) -> bool:
    """Whether ``package`` is installed: importable, or one of the distributions ``requires`` checks is."""
    if package in sys.modules:
        found = sys.modules[package] is not None
    else:
        found = importlib.util.find_spec(package) is not None
    distributions = [*([requires.abi["distribution"]] if requires.abi is not None else []), *requires.versions]
    return found or any(installed_version(d) is not None for d in distributions)


def load_cuda_package(backend: str, requires: Requirements, package: str, compute_capability: tuple[int, int],
                      where: str) -> ModuleType:
    """``package`` imported after every check ``requires`` makes for a CUDA device of ``compute_capability``
    (described as ``where``): the compute capability, the ABI of its build (before the import: a mismatched build
    must not load), the toolkit. Where ``package`` is not installed and ``requires.hub`` names a kernel-hub build,
    that build from the local kernel cache (``load_hub_kernel``). Once per backend, package, capability, toolkit
    search path and cache."""
    key = (backend, package, tuple(compute_capability),
           *(os.environ.get(v) for v in (*TOOLKIT_VARIABLES, "PATH", *HUB_CACHE_VARIABLES)))
    if key not in _LOADED:
        check_compute_capability(backend, requires.compute_capability, compute_capability, where)
        from_hub = requires.hub is not None and not _installed(requires, package)
        if not from_hub:
            if requires.abi is not None:
                check_abi(backend, requires.abi)
            check_versions(backend, requires.versions, requires)
        if requires.nvcc:
            check_toolkit(backend, requires.nvcc, compute_capability)
        _LOADED[key] = (load_hub_kernel(backend, requires, package) if from_hub else
                        import_required(backend, requires, package))
    return _LOADED[key]
