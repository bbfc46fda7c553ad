"""Expert parallelism on JAX sharding: the experts split evenly over a mesh axis, token slots exchanged inside
``jax.shard_map``.

Device r of the axis (size W) holds T / W tokens and the experts [r * E / W, (r + 1) * E / W). Each device sorts its
routed slots by expert and sends every slot's token row to the device owning its expert, through a buffer of C rows
per (sender, receiver) pair, C = ``moe_shared.parallel.slot_capacity(T / W * k, W, capacity_factor)``: the first C
slots a device routes to a receiver (in expert order, then slot order) travel, the rest are dropped, computed as
empty slots, and counted. The default capacity (``capacity_factor=None``) is all of a device's slots, so nothing is
ever dropped; a smaller factor trades memory (buffers of W * C rows) for dropped slots, which the functions here
return. The receiver runs its local experts on the W * C rows with any jittable backend, the results go back the
same way, and the token's device combines them with the routing weights in float32.

The exchange per device class (``TRANSPORTS``): ``jax.lax.ragged_all_to_all`` moves only the routed rows where
XLA implements it; XLA:CPU does not (jax 0.10.2: "HLO opcode ragged-all-to-all is not supported"), so there
``jax.lax.all_to_all`` moves the whole [W * C, H] buffer. Both are differentiable: gradients reach the tokens,
the routing weights and every device's experts.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from moe_shared import ArrayInfo, check_arguments, check_expert_ids
from moe_shared.parallel import experts_per_rank, slot_capacity
from moe_shared.switching import auto_backend, expert_bytes

from . import api
from .base import Slots, combine, device_class, info, is_traced, platform_of

AUTO = "auto"
TRANSPORTS = {"cpu": "all_to_all", "cuda": "ragged_all_to_all", "tpu": "ragged_all_to_all"}
ragged_all_to_all = lax.ragged_all_to_all  # module attribute: the tests substitute an emulation on CPU


def _with_zero_row(a):
    return jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])


def _transport(name: str | None) -> str:
    name = name or TRANSPORTS.get(device_class(jax.default_backend()), "all_to_all")
    if name not in set(TRANSPORTS.values()):
        raise ValueError(f"transport: expected one of {sorted(set(TRANSPORTS.values()))} or None, got {name!r}")
    return name


def _dense_exchange(rows, send_index, axis_name):
    """Rows gathered into the [W * C, H] send buffer (index len(rows): a zero row), then one all_to_all."""
    buffer = _with_zero_row(rows)[send_index]
    return lax.all_to_all(buffer, axis_name, 0, 0, tiled=True)


def shard_experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *, axis_name: str,
                          implementation: str = "grouped_mm", activation: str | Callable = "silu",
                          gate_up_bias=None, down_bias=None, capacity_factor: float | None = None,
                          transport: str | None = None):
    """The expert-parallel forward on one device, inside ``jax.shard_map`` over ``axis_name``.

    Per-device shapes: hidden_states [T, H], top_k_index [T, k] (global expert ids, -1 = empty), top_k_weights
    [T, k]; gate_up_proj [E / W, 2I, H], down_proj [E / W, H, I] (+ biases): this device's experts. Returns
    ``(out [T, H], dropped)``, ``dropped`` the number of slots over the capacity on the whole axis (an int32
    scalar, the same on every device). ``implementation`` names a jittable backend (or "auto").
    """
    W = lax.axis_size(axis_name)
    El, H = gate_up_proj.shape[0], gate_up_proj.shape[2]
    E = El * W
    whole = lambda a: None if a is None else ArrayInfo((E, *a.shape[1:]), jnp.dtype(a.dtype).name)
    check_arguments(info(hidden_states), info(top_k_index), info(top_k_weights), whole(gate_up_proj),
                    whole(down_proj), whole(gate_up_bias), whole(down_bias), activation=activation)
    transport = _transport(transport)
    T, k = top_k_index.shape
    S = T * k
    C = slot_capacity(S, W, capacity_factor)
    if C == 0:  # no slots on any device (shapes are the same on all of them)
        return jnp.zeros((T, H), hidden_states.dtype), jnp.zeros((), jnp.int32)
    me = lax.axis_index(axis_name)
    slots = Slots(top_k_index, E)

    # Slots sorted by global expert id, hence by receiver, then by the receiver's local expert; empty ones last.
    key = jnp.where(slots.valid, slots.ids, E)
    order = jnp.argsort(key, stable=True)
    counts = jnp.zeros(E + 1, jnp.int32).at[key].add(1)[:E].reshape(W, El)  # [receiver, its local expert]
    sent = counts.sum(1)
    start = jnp.cumsum(sent) - sent
    receiver = jnp.minimum(key[order] // El, W - 1)
    position = jnp.arange(S) - start[receiver]
    kept = (key[order] < E) & (position < C)
    dropped = lax.psum(jnp.sum(key < E) - jnp.sum(kept), axis_name).astype(jnp.int32)

    # What each sender sends here: its counts per local expert, of which the first C rows travel.
    incoming = lax.all_to_all(counts, axis_name, 0, 0, tiled=True)  # [sender, local expert]
    arrived = jnp.minimum(incoming.sum(1), C)
    row = jnp.arange(C)
    local_ids = (jnp.cumsum(incoming, axis=1)[:, None, :] <= row[None, :, None]).sum(-1)  # [sender, row]
    local_ids = jnp.where(row < arrived[:, None], local_ids, -1).reshape(W * C)

    x = hidden_states
    if transport == "all_to_all":
        # Send buffer row (receiver j, q): the sorted slot start[j] + q while q < min(sent[j], C).
        q = jnp.arange(W * C) % C
        j = jnp.arange(W * C) // C
        slot = order[jnp.minimum(start[j] + q, S - 1)]
        send_index = jnp.where(q < jnp.minimum(sent[j], C), slot // k, T)
        received = _dense_exchange(x, send_index, axis_name)
    else:
        offsets = (jnp.arange(W) * C).astype(jnp.int32)
        sizes_out = jnp.minimum(sent, C).astype(jnp.int32)
        received = ragged_all_to_all(x[order // k], jnp.zeros((W * C, H), x.dtype), start.astype(jnp.int32),
                                     sizes_out, jnp.full(W, me * C, jnp.int32), arrived.astype(jnp.int32),
                                     axis_name=axis_name)

    backend = implementation
    if backend == AUTO:
        weight_bytes = expert_bytes(gate_up_proj.shape, down_proj.shape, gate_up_proj.dtype.itemsize)
        backend = auto_backend("jax", device_class(jax.default_backend()), W * C, weight_bytes)
    results = api.experts_forward(received, local_ids[:, None], jnp.ones((W * C, 1), top_k_weights.dtype),
                                  gate_up_proj, down_proj, implementation=backend, activation=activation,
                                  gate_up_bias=gate_up_bias, down_bias=down_bias)

    if transport == "all_to_all":
        returned = lax.all_to_all(results, axis_name, 0, 0, tiled=True)
    else:
        returned = ragged_all_to_all(results, jnp.zeros((W * C, H), results.dtype), offsets, arrived.astype(jnp.int32),
                                     jnp.full(W, me * C, jnp.int32), sizes_out, axis_name=axis_name)
    # Sorted slot i came back at row receiver * C + position; dropped and empty slots read the zero row.
    address = jnp.where(kept, receiver * C + position, W * C)
    per_slot = _with_zero_row(returned)[jnp.zeros(S, address.dtype).at[order].set(address)]
    return combine(per_slot, slots, top_k_weights, hidden_states.dtype), dropped


def expert_spec(axis: str, ndim: int) -> PartitionSpec:
    """Split on dimension 0 (tokens or experts) over ``axis``, the rest whole."""
    return PartitionSpec(axis, *([None] * (ndim - 1)))


def check_mesh(mesh, axis: str, num_experts: int, capacity_factor: float | None = None) -> int:
    """The size W of mesh axis ``axis``; ValueError unless it exists and divides ``num_experts``."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise ValueError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: expected one of the mesh axes {list(mesh.axis_names)}, got {axis!r}")
    W = mesh.shape[axis]
    experts_per_rank(num_experts, W)
    slot_capacity(0, W, capacity_factor)
    return W


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *, mesh,
                    axis: str = "expert", implementation: str = "grouped_mm", activation: str | Callable = "silu",
                    gate_up_bias=None, down_bias=None, capacity_factor: float | None = None,
                    transport: str | None = None, validate: bool | None = None):
    """Expert-parallel ``experts_forward`` over the mesh axis ``axis``: tokens split evenly over it (T divisible
    by its size W), experts too (E divisible by W). Global shapes as in ``moe_jax.experts_forward``.

    Returns ``(out [T, H], dropped)``: ``dropped`` counts the slots over the exchange capacity (always 0 with the
    default ``capacity_factor=None``). Works under ``jax.jit`` (mesh, axis, implementation, activation,
    capacity_factor and transport static) and ``jax.grad``. ``transport`` overrides ``TRANSPORTS``.
    """
    arrays = {"hidden_states": hidden_states, "top_k_index": top_k_index, "top_k_weights": top_k_weights,
              "gate_up_proj": gate_up_proj, "down_proj": down_proj, "gate_up_bias": gate_up_bias,
              "down_bias": down_bias}
    for name, a in arrays.items():
        if a is not None and not isinstance(a, (jax.Array, np.ndarray)):
            raise ValueError(f"{name}: expected a jax.Array, got {type(a).__name__}")
    arrays = {n: jnp.asarray(a) for n, a in arrays.items() if a is not None}
    dims = check_arguments(*(info(arrays.get(n)) for n in
                             ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj",
                              "gate_up_bias", "down_bias")), activation=activation)
    W = check_mesh(mesh, axis, dims.E, capacity_factor)
    if dims.T % W:
        raise ValueError(f"hidden_states: expected a number of tokens divisible by the size {W} of mesh axis "
                         f"{axis!r} (the tokens are split evenly over it), got T = {dims.T}")
    _transport(transport)
    index = arrays["top_k_index"]
    if validate is None:
        validate = not is_traced(index) and platform_of(index) == "cpu"
    if validate and dims.slots:
        ids = np.asarray(index)
        check_expert_ids(int(ids.min()), int(ids.max()), dims.E)

    names = list(arrays)
    specs = tuple(expert_spec(axis, arrays[n].ndim) for n in names)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        arrays = {n: jax.reshard(arrays[n], NamedSharding(mesh, s)) for n, s in zip(names, specs)}

    def body(*values):
        named = dict(zip(names, values))
        return shard_experts_forward(
            named["hidden_states"], named["top_k_index"], named["top_k_weights"], named["gate_up_proj"],
            named["down_proj"], gate_up_bias=named.get("gate_up_bias"), down_bias=named.get("down_bias"),
            axis_name=axis, implementation=implementation, activation=activation,
            capacity_factor=capacity_factor, transport=transport)

    # check_vma=False: the local backends' loops (the CPU expert loop's while_loop carries) are not written
    # for varying-manual-axes types; the outputs' specs hold by construction (out per device, dropped psum-ed).
    mapped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(expert_spec(axis, 2), PartitionSpec()),
                           check_vma=False)
    return mapped(*(arrays[n] for n in names))
