"""A backend registry: a read-only mapping from backend name to function, with ``register`` to add one."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Mapping

from .requirements import check_compute_capability, hub_cached, package_missing
from .spec import FrameworkSupport, load_spec


PACKAGES_PRESENT: dict[str, bool] = {}
"""Import name -> whether it is installed, looked up once per process (at registration, so that the check costs a
dict lookup on every call and torch.compile traces no import machinery)."""


def package_present(package: str) -> bool:
    if package not in PACKAGES_PRESENT:
        PACKAGES_PRESENT[package] = importlib.util.find_spec(package) is not None
    return PACKAGES_PRESENT[package]


class UnknownBackendError(ValueError, KeyError):
    """Raised for a name that is not registered (a ValueError; a KeyError so that ``in`` works)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class BackendRegistry(Mapping[str, Callable]):
    def __init__(self, framework: str):
        self.framework = framework
        self._functions: dict[str, Callable] = {}
        self._capabilities: dict[str, FrameworkSupport | None] = {}

    def register(self, name: str, fn: Callable, *, capability: FrameworkSupport | None = None) -> None:
        """Add (or replace) a backend that follows the common experts_forward signature."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty string, got {name!r}")
        if not callable(fn):
            raise ValueError(f"fn: expected a callable with the experts_forward signature, got {type(fn).__name__}")
        declared = load_spec().backends
        if capability is None and name in declared:
            capability = declared[name].frameworks.get(self.framework)
        self._functions[name] = fn
        self._capabilities[name] = capability
        for package in capability.requires.packages if capability is not None else ():
            package_present(package)

    def unregister(self, name: str) -> None:
        """Remove a backend added with ``register``."""
        self[name]
        del self._functions[name], self._capabilities[name]

    def capability(self, name: str) -> FrameworkSupport | None:
        """The declared capability of a backend: the spec's entry, or None for an undeclared user backend."""
        self[name]
        return self._capabilities[name]

    def __getitem__(self, name: str) -> Callable:
        try:
            return self._functions[name]
        except (KeyError, TypeError):
            raise UnknownBackendError(
                f"implementation: expected one of the registered {self.framework} backends {sorted(self._functions)}, "
                f"got {name!r}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._functions)

    def __len__(self) -> int:
        return len(self._functions)

    def __repr__(self) -> str:
        return f"BackendRegistry({self.framework!r}, {sorted(self._functions)})"

    def check(self, name: str, *, device_class: str, where: str, dtype: str,
              compute_capability: tuple[int, int] | None = None) -> None:
        """Raise if backend ``name`` cannot run on ``device_class`` (described as ``where`` in messages) with
        weights of ``dtype``: ImportError names the pip extra, RuntimeError the hardware, ValueError the dtype.
        ``compute_capability`` is the CUDA device's, where there is one."""
        support = self.capability(name)
        if support is None:  # a user backend without a declared capability
            return
        for package in support.requires.packages:
            if not (package_present(package) or hub_cached(support.requires)):
                raise ImportError(package_missing(name, support.requires, package))
        try:
            if device_class not in support.devices:
                raise RuntimeError(f"implementation {name!r} runs on {list(support.devices)}, got {where}")
            if compute_capability is not None:
                check_compute_capability(name, support.requires.compute_capability, compute_capability, where)
        except RuntimeError as err:
            if not support.requires.other:
                raise
            raise RuntimeError(f"{err}; it also needs {'; '.join(support.requires.other.values())}") from None
        support.check_dtype(name, dtype)

    def availability(self, check: Callable[[str, str], None]) -> dict[str, str | None]:
        """Every backend -> None if ``check(name, dtype)`` passes for its preferred dtype (bfloat16 where
        declared), else the reason it raised."""
        reasons = {}
        for name in self:
            support = self.capability(name)
            dtype = "bfloat16" if support is None or "bfloat16" in support.dtypes else support.dtypes[0]
            try:
                check(name, dtype)
                reasons[name] = None
            except (ImportError, RuntimeError, ValueError) as err:
                reasons[name] = str(err)
        return reasons
