"""The experts_forward contract: argument checks shared by every framework.

Shape legend: T tokens, H hidden size, I intermediate size, E experts, k slots per token (top-k),
N width of the first projection (2I for the named gated activations).

    out[t] = sum_j w[t, j] * (down[e] @ (act(g) * u) + b2[e]),   [g; u] = gate_up[e] @ x[t] + b1[e],   e = idx[t, j]

An expert id of -1 marks an empty slot: it contributes exactly zero. Each framework describes its arrays as
``ArrayInfo`` (shape and canonical dtype name) and calls ``check_arguments``; a failure is a ``ValueError`` that
names the argument, what was expected and what was received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from .spec import load_spec

_SPEC = load_spec()  # read once at import: these checks also run inside torch.compile / jax.jit traces


@dataclass(frozen=True)
class ArrayInfo:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Dims:
    T: int
    H: int
    I: int
    E: int
    k: int
    N: int

    @property
    def slots(self) -> int:
        return self.T * self.k


def _fail(arg: str, expected: str, got: str) -> ValueError:
    return ValueError(f"{arg}: expected {expected}, got {got}")


def _rank(arg: str, info: ArrayInfo, legend: str) -> None:
    want = legend.count(",") + 1
    if len(info.shape) != want:
        raise _fail(arg, f"a {want}-D array {legend}", f"shape {info.shape}")


def _dims(arg: str, info: ArrayInfo, legend: str, expected: tuple[int | None, ...]) -> None:
    if any(e is not None and e != s for e, s in zip(expected, info.shape)):
        shown = tuple("?" if e is None else e for e in expected)
        raise _fail(arg, f"shape {legend} = {shown}".replace("'", ""), f"shape {info.shape}")


def _dtype(arg: str, info: ArrayInfo, allowed: tuple[str, ...]) -> None:
    if info.dtype not in allowed:
        raise _fail(arg, f"dtype in {list(allowed)}", f"dtype {info.dtype}")


def check_activation(activation: str | Callable) -> None:
    spec = _SPEC
    if callable(activation):
        return
    if not isinstance(activation, str) or activation not in spec.activations:
        raise _fail("activation", f"one of {list(spec.activations)} or a callable gate", repr(activation))


def check_arguments(
    hidden_states: ArrayInfo,
    top_k_index: ArrayInfo,
    top_k_weights: ArrayInfo,
    gate_up_proj: ArrayInfo,
    down_proj: ArrayInfo,
    gate_up_bias: ArrayInfo | None = None,
    down_bias: ArrayInfo | None = None,
    *,
    activation: str | Callable = "silu",
) -> Dims:
    """Check shapes and dtypes of every argument and return the problem's dimensions."""
    spec = _SPEC
    check_activation(activation)

    _rank("hidden_states", hidden_states, "[T, H]")
    _dtype("hidden_states", hidden_states, spec.dtypes)
    T, H = hidden_states.shape

    _rank("top_k_index", top_k_index, "[T, k]")
    _dtype("top_k_index", top_k_index, spec.index_dtypes)
    _dims("top_k_index", top_k_index, "[T, k]", (T, None))
    k = top_k_index.shape[1]
    if k < 1:
        raise _fail("top_k_index", "at least one slot per token (k >= 1)", f"shape {top_k_index.shape}")

    _rank("top_k_weights", top_k_weights, "[T, k]")
    _dtype("top_k_weights", top_k_weights, spec.dtypes)
    _dims("top_k_weights", top_k_weights, "[T, k]", (T, k))

    _rank("gate_up_proj", gate_up_proj, "[E, 2I, H]")
    _dtype("gate_up_proj", gate_up_proj, spec.dtypes)
    E, N = gate_up_proj.shape[:2]
    if E < 1:
        raise _fail("gate_up_proj", "at least one expert (E >= 1)", f"shape {gate_up_proj.shape}")
    _dims("gate_up_proj", gate_up_proj, "[E, 2I, H]", (None, None, H))

    _rank("down_proj", down_proj, "[E, H, I]")
    _dims("down_proj", down_proj, "[E, H, I]", (E, H, None))
    if down_proj.dtype != gate_up_proj.dtype:
        raise _fail("down_proj", f"the dtype of gate_up_proj ({gate_up_proj.dtype})", f"dtype {down_proj.dtype}")
    I = down_proj.shape[2]
    if not callable(activation) and N != 2 * I:
        raise _fail("gate_up_proj", f"shape [E, 2I, H] = ({E}, {2 * I}, {H}) for I = {I} from down_proj",
                    f"shape {gate_up_proj.shape}")

    for arg, bias, legend, expected in (
        ("gate_up_bias", gate_up_bias, "[E, 2I]", (E, N)),
        ("down_bias", down_bias, "[E, H]", (E, H)),
    ):
        if bias is None:
            continue
        _rank(arg, bias, legend)
        _dims(arg, bias, legend, expected)
        if bias.dtype != gate_up_proj.dtype:
            raise _fail(arg, f"the dtype of the weights ({gate_up_proj.dtype})", f"dtype {bias.dtype}")
    return Dims(T=T, H=H, I=I, E=E, k=k, N=N)


def check_expert_ids(lowest: int, highest: int, num_experts: int) -> None:
    """Value check of top_k_index: every id in [-1, E)."""
    empty = _SPEC.empty_slot
    if lowest < empty or highest >= num_experts:
        raise _fail("top_k_index", f"expert ids in [{empty}, {num_experts}) ({empty} = empty slot)",
                    f"ids from {lowest} to {highest}")


# Where each dimension a backend may need a multiple of is read and reported: (argument, its legend, axis). H is the
# K of the gate/up GEMM (gate_up_proj's last axis), I the K of the down GEMM (down_proj's last axis).
DIMENSION_AXES = {"H": ("gate_up_proj", "[E, 2I, H]", 2), "I": ("down_proj", "[E, H, I]", 2)}


def check_multiples(backend: str, multiples: Mapping[str, int], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """ValueError naming the argument if a dimension of ``multiples`` (dimension -> multiple) is not a multiple of
    it; ``shapes`` maps argument names to shapes."""
    for dim, multiple in multiples.items():
        arg, legend, axis = DIMENSION_AXES[dim]
        size = shapes[arg][axis]
        if size % multiple:
            raise _fail(arg, f"{dim} a multiple of {multiple} for implementation {backend!r} (shape {legend})",
                        f"shape {tuple(shapes[arg])}, {dim} = {size}")


def check_kernel_inputs(backend: str, support, activation, dtype: str, gate_up_shape: tuple[int, ...],
                        down_shape: tuple[int, ...]) -> None:
    """What a kernel backend's ``support`` (a spec FrameworkSupport) cannot take raises ValueError before any work:
    the activation, the weights' dtype, and the dimensions its ``multiples`` constrain."""
    support.check_activation(backend, activation)
    support.check_dtype(backend, dtype)
    check_multiples(backend, support.multiples, {"gate_up_proj": tuple(gate_up_shape), "down_proj": tuple(down_shape)})
