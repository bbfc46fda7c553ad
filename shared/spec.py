"""The backend spec (``spec.toml``) as read-only Python objects."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

SPEC_PATH = Path(__file__).with_name("spec.toml")
DEVICE_CLASSES = ("cpu", "cuda", "tpu")
FRAMEWORKS = ("torch", "jax")


@dataclass(frozen=True)
class CompileSupport:
    """Which torch.compile settings a backend is verified with."""

    fullgraph: bool
    modes: tuple[str, ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class Requirements:
    packages: Mapping[str, str] = field(default_factory=dict)  # import name -> pip extra
    compute_capability: tuple[int, int] | None = None
    nvcc: Mapping[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # min CC -> min nvcc version
    abi: Mapping[str, Any] | None = None  # distribution, package, framework, builds: {version: [framework versions]}
    versions: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # distribution -> the versions that work
    other: Mapping[str, str] = field(default_factory=dict)  # what else a backend needs, described (checked there)
    hub: Mapping[str, Any] | None = None  # a kernel-hub build of the package: repo_id, revision or version, ...


_NO_GRADIENTS = {"torch": "call it under torch.no_grad() or on inputs without requires_grad",
                 "jax": "call it outside jax.grad / jax.vjp"}


@dataclass(frozen=True)
class FrameworkSupport:
    framework: str
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]
    quantized: tuple[str, ...]
    requires: Requirements
    compile: CompileSupport | None = None  # torch only
    jit: bool | None = None  # jax only
    details: Mapping[str, Any] = field(default_factory=dict)  # backend-specific data (kernels, ...)
    activations: tuple[str, ...] | None = None  # named activations only; None: every contract one and callables
    training: bool = True  # False: inference only, a differentiated call raises
    multiples: Mapping[str, int] = field(default_factory=dict)  # dimension (H, I, ...) -> what it must divide by
    # device class -> the most expert weights (MiB) an inference call may read and replay a captured graph (torch)
    graphs: Mapping[str, int] = field(default_factory=dict)
    # device class -> the same for a training step replayed as two graphs (torch; none: never)
    training_graphs: Mapping[str, int] = field(default_factory=dict)

    def check_dtype(self, backend: str, dtype: str) -> None:
        """Raise ValueError if the weights' ``dtype`` is not one this backend takes."""
        if dtype not in self.dtypes:
            raise ValueError(f"gate_up_proj: implementation {backend!r} supports dtypes {list(self.dtypes)}, "
                             f"got dtype {dtype}")

    def training_error(self, backend: str, trainers: tuple[str, ...] = ()) -> RuntimeError:
        """The error a differentiated call of an inference-only backend raises (``trainers``: backends that train)."""
        hint = f"; train with one of {list(trainers)}" if trainers else ""
        return RuntimeError(f"implementation {backend!r} is inference only (the spec's training = false), got a "
                            f"differentiated call: {_NO_GRADIENTS.get(self.framework, 'call it without gradients')}"
                            f"{hint}")

    def check_activation(self, backend: str, activation) -> None:
        """Raise ValueError if this backend cannot take ``activation`` (a name or a callable gate)."""
        if self.activations is None or (isinstance(activation, str) and activation in self.activations):
            return
        got = f"the callable {getattr(activation, '__name__', type(activation).__name__)}" if callable(activation) \
            else repr(activation)
        raise ValueError(f"activation: implementation {backend!r} takes one of {list(self.activations)}, got {got}")


@dataclass(frozen=True)
class BackendSpec:
    name: str
    description: str
    data_dependent: bool
    frameworks: Mapping[str, FrameworkSupport]

    def support(self, framework: str) -> FrameworkSupport:
        try:
            return self.frameworks[framework]
        except KeyError:
            raise ValueError(
                f"backend {self.name!r} is not declared for framework {framework!r}; "
                f"it is declared for {sorted(self.frameworks)}"
            ) from None


@dataclass(frozen=True)
class Spec:
    activations: tuple[str, ...]
    dtypes: tuple[str, ...]
    index_dtypes: tuple[str, ...]
    empty_slot: int
    tolerance: Mapping[str, float]
    decode_max_gathered_mib: Mapping[str, Mapping[str, int]]
    backends: Mapping[str, BackendSpec]

    def backend_names(self, framework: str) -> tuple[str, ...]:
        return tuple(n for n, b in self.backends.items() if framework in b.frameworks)

    def trainers(self, framework: str) -> tuple[str, ...]:
        """The backends of ``framework`` that support gradients."""
        return tuple(n for n in self.backend_names(framework) if self.backends[n].frameworks[framework].training)

    def tolerance_for(self, dtype: str) -> float:
        try:
            return self.tolerance[dtype]
        except KeyError:
            raise ValueError(f"no tolerance for dtype {dtype!r}; the spec has {sorted(self.tolerance)}") from None

    def decode_threshold(self, framework: str, device_class: str) -> int:
        """The most weights (MiB) batched_mm gathers, T*k times one expert's, while it beats grouped_mm for
        ``framework`` on ``device_class`` (0: never)."""
        return int(self.decode_max_gathered_mib.get(framework, {}).get(device_class, 0))


_KNOWN_SUPPORT_KEYS = {"devices", "dtypes", "quantized", "requires", "compile", "jit", "activations", "training",
                       "multiples", "graphs", "training_graphs"}
_BACKEND_KEYS = {"description", "data_dependent", *FRAMEWORKS}
_CHECKED_REQUIREMENTS = {"packages", "compute_capability", "nvcc", "abi", "versions", "hub"}


def version_tuple(text: str) -> tuple[int, ...]:
    """"12.3" -> (12, 3)."""
    return tuple(int(part) for part in str(text).split("."))


def _merged(common: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """``own`` over ``common``, tables merged key by key."""
    out = dict(common)
    for key, value in own.items():
        out[key] = _merged(common[key], value) if isinstance(value, Mapping) and isinstance(
            common.get(key), Mapping) else value
    return out


def _requirements(req: Mapping[str, Any], distributions: Mapping[str, Any]) -> Requirements:
    cc = req.get("compute_capability")
    return Requirements(
        packages=MappingProxyType(dict(req.get("packages", {}))),
        compute_capability=tuple(cc) if cc is not None else None,
        nvcc=MappingProxyType({version_tuple(c): tuple(v) for c, v in req.get("nvcc", {}).items()}),
        abi=MappingProxyType({"distribution": req["abi"]} | distributions[req["abi"]]) if "abi" in req else None,
        versions=MappingProxyType({d: tuple(v) for d, v in req.get("versions", {}).items()}),
        hub=MappingProxyType(dict(req["hub"])) if "hub" in req else None,
        other=MappingProxyType({k: v for k, v in req.items() if k not in _CHECKED_REQUIREMENTS}),
    )


def _support(framework: str, raw: Mapping[str, Any], distributions: Mapping[str, Any]) -> FrameworkSupport:
    comp = raw.get("compile")
    return FrameworkSupport(
        framework=framework,
        devices=tuple(raw["devices"]),
        dtypes=tuple(raw["dtypes"]),
        quantized=tuple(raw.get("quantized", ())),
        requires=_requirements(raw.get("requires", {}), distributions),
        compile=CompileSupport(bool(comp["fullgraph"]), tuple(comp["modes"]), tuple(comp["dtypes"])) if comp else None,
        jit=raw.get("jit"),
        activations=tuple(raw["activations"]) if "activations" in raw else None,
        training=bool(raw.get("training", True)),
        multiples=MappingProxyType(dict(raw.get("multiples", {}))),
        graphs=MappingProxyType({k: int(v) for k, v in raw.get("graphs", {}).items()}),
        training_graphs=MappingProxyType({k: int(v) for k, v in raw.get("training_graphs", {}).items()}),
        details=MappingProxyType({k: v for k, v in raw.items() if k not in _KNOWN_SUPPORT_KEYS}),
    )


def parse_spec(raw: Mapping[str, Any]) -> Spec:
    contract = raw["contract"]
    backends = {}
    for name, b in raw["backends"].items():
        common = {k: v for k, v in b.items() if k not in _BACKEND_KEYS}  # defaults of every framework entry
        frameworks = {fw: _support(fw, _merged(common, b[fw]), raw.get("distributions", {}))
                      for fw in FRAMEWORKS if fw in b}
        backends[name] = BackendSpec(name, b["description"], bool(b.get("data_dependent", False)),
                                     MappingProxyType(frameworks))
    decode = raw.get("decode", {}).get("max_gathered_mib", {})
    return Spec(
        activations=tuple(contract["activations"]),
        dtypes=tuple(contract["dtypes"]),
        index_dtypes=tuple(contract["index_dtypes"]),
        empty_slot=int(contract["empty_slot"]),
        tolerance=MappingProxyType({k: float(v) for k, v in raw["tolerance"].items()}),
        decode_max_gathered_mib=MappingProxyType({fw: MappingProxyType(dict(v)) for fw, v in decode.items()}),
        backends=MappingProxyType(backends),
    )


@cache
def load_spec() -> Spec:
    with SPEC_PATH.open("rb") as f:
        return parse_spec(tomllib.load(f))
