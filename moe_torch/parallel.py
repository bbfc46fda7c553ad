"""Expert parallelism on torch.distributed: the experts of an ``Experts`` module split evenly over the ranks of a
process group, token slots exchanged with ``all_to_all_single``.

Every rank holds its own tokens and the experts [r * E / W, (r + 1) * E / W). A forward call

1. validates its inputs and exchanges the per-(rank, expert) slot counts, with a status column (one
   ``all_to_all_single`` of a [W, E / W + 1] integer tensor, then one host sync for the split sizes);
2. sends each routed slot's token row to the rank owning its expert, sorted by expert (empty slots, id -1,
   never travel);
3. runs the received rows through the local ``Experts`` module (any registered backend, top-1, unit weights);
4. sends the results back, and combines them on the token's rank with the routing weights in float32.

Both exchanges are ``torch.autograd.Function``s whose backward is the reverse exchange, so gradients reach the
tokens, the routing weights and every rank's experts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from moe_shared import ArrayInfo, check_arguments, check_expert_ids, load_spec
from moe_shared.parallel import experts_per_rank

from .base import Slots, combine, dtype_name, info
from .modules import Experts

_SPEC = load_spec()
_LAYOUT = ("num_experts", "experts on this rank", "hidden_size", "gate_up width", "intermediate_size", "bias",
           "dtype", "activation")


def _all_to_all(rows: torch.Tensor, recv_sizes: Sequence[int], send_sizes: Sequence[int], group) -> torch.Tensor:
    out = rows.new_empty((sum(recv_sizes), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), list(recv_sizes), list(send_sizes), group=group)
    return out


class _Exchange(torch.autograd.Function):
    """all_to_all_single of rows with autograd: the backward sends the gradients back the way the rows came.

    ``anchor`` (an empty tensor that requires grad) keeps the exchange in the autograd graph on every rank that
    takes part in backward, also where this rank sends nothing or its own inputs need no gradient: every rank then
    runs the reverse collective, and none waits for a peer that skipped it."""

    @staticmethod
    def forward(ctx, rows, anchor, recv_sizes, send_sizes, group):
        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        return _all_to_all(rows, recv_sizes, send_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        recv_sizes, send_sizes = ctx.sizes
        return _all_to_all(grad, send_sizes, recv_sizes, ctx.group), None, None, None, None


def _layout(experts: Experts, num_experts: int) -> list[int]:
    activation = experts.activation
    return [num_experts, experts.num_experts, experts.hidden_size, experts.gate_up_proj.shape[1],
            experts.intermediate_size, int(experts.gate_up_bias is not None),
            _code(_SPEC.dtypes, dtype_name(experts.gate_up_proj.dtype)),
            -1 if callable(activation) else _code(_SPEC.activations, activation)]


def _code(names: Sequence[str], name: str) -> int:
    return names.index(name) if name in names else -1


def _describe(row: Sequence[int]) -> str:
    named = dict(zip(_LAYOUT, row))
    named["dtype"] = _SPEC.dtypes[row[6]] if row[6] >= 0 else "another dtype"
    named["activation"] = _SPEC.activations[row[7]] if row[7] >= 0 else "a callable"
    return ", ".join(f"{k}={v}" for k, v in named.items())


def _local_slice(experts: Experts, first: int, count: int) -> Experts:
    """A new Experts module holding experts [first, first + count) of ``experts`` (copied)."""
    device, dtype = experts.gate_up_proj.device, experts.gate_up_proj.dtype
    local = Experts(count, experts.hidden_size, experts.intermediate_size, activation=experts.activation,
                    bias=experts.gate_up_bias is not None, experts_implementation=experts.experts_implementation,
                    device="meta", dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        for name, param in local.named_parameters():
            source = getattr(experts, name)
            param.copy_(source[first:first + count])
            param.requires_grad_(source.requires_grad)
    return local


class ExpertParallel(nn.Module):
    """The experts of ``experts`` split evenly over the ranks of ``group`` (default: the world group).

    ``ExpertParallel(experts)``: ``experts`` holds all E experts, the same on every rank (same seed or checkpoint);
    each rank keeps a copy of its E / W. ``ExpertParallel(experts, num_experts=E)``: ``experts`` already holds only
    this rank's E / W experts. The local experts are ``self.experts``, an ``Experts`` module:
    ``set_experts_implementation``, ``get_experts_implementation`` and ``decode_mode`` reach it as usual, and its
    backend (any registered one) runs the local computation.

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` with global expert ids;
    T may differ between ranks (also 0). Every rank of the group must call forward (and backward) the same number
    of times, as with any collective. Construction is collective too: it checks that every rank wraps the same
    layout. A rank whose inputs are rejected raises its ValueError, and the other ranks raise a RuntimeError naming
    it, before any token moves. Give the process group a ``timeout`` so that a rank that dies cannot stall the
    others forever. The split sizes are read on the host (one sync per call): not ``fullgraph`` compilable.
    """

    def __init__(self, experts: Experts, group: dist.ProcessGroup | None = None, *, num_experts: int | None = None):
        super().__init__()
        if not isinstance(experts, Experts):
            raise ValueError(f"experts: expected a moe_torch.Experts module, got {type(experts).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ExpertParallel needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group)")
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        total = experts.num_experts if num_experts is None else num_experts
        if not isinstance(total, int) or total < 1:
            raise ValueError(f"num_experts: expected a positive int, got {total!r}")
        rows = self._gather_layouts(_layout(experts, total), experts.gate_up_proj.device)
        if any(row != rows[0] for row in rows):
            listed = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(rows))
            raise ValueError(f"experts: expected the same experts layout on every rank of the process group, "
                             f"got {listed}")
        self.num_experts = total
        self.num_local_experts = experts_per_rank(total, self.world_size)
        self.first_expert = self.rank * self.num_local_experts
        if num_experts is None:
            self.experts = _local_slice(experts, self.first_expert, self.num_local_experts)
        elif experts.num_experts == self.num_local_experts:
            self.experts = experts
        else:
            raise ValueError(f"num_experts: expected experts.num_experts * world size = {experts.num_experts} * "
                             f"{self.world_size} = {experts.num_experts * self.world_size} (experts holds this "
                             f"rank's share), got {total}")

    def _gather_layouts(self, row: list[int], device: torch.device) -> list[list[int]]:
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.group)
        return [r.tolist() for r in rows]

    def _check(self, hidden_states, top_k_index, top_k_weights) -> None:
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        for name, t in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                        ("top_k_weights", top_k_weights)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.device != gate_up.device:
                raise ValueError(f"{name}: expected a tensor on {gate_up.device} (the device of the experts), "
                                 f"got one on {t.device}")
        whole = lambda p: ArrayInfo((self.num_experts, *p.shape[1:]), dtype_name(p.dtype))
        dims = check_arguments(info(hidden_states), info(top_k_index), info(top_k_weights), whole(gate_up),
                               whole(down), activation=self.experts.activation)
        if gate_up.device.type == "cpu" and not torch.compiler.is_compiling() and dims.slots:
            lowest, highest = torch.aminmax(top_k_index)
            check_expert_ids(int(lowest), int(highest), self.num_experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        W, El = self.world_size, self.num_local_experts
        device = self.experts.gate_up_proj.device
        try:
            self._check(hidden_states, top_k_index, top_k_weights)
            rejected = None
        except ValueError as err:
            rejected = err
        counts = torch.zeros(W, El + 1, dtype=torch.int64, device=device)
        if rejected is None:
            slots = Slots(top_k_index.contiguous(), self.num_experts)
            key = slots.expert_key()
            counts[:, :El] = torch.bincount(key, minlength=self.num_experts + 1)[:-1].view(W, El)
        else:
            counts[:, El] = 1
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        send_sizes, recv_sizes, failed = torch.stack(
            [counts[:, :El].sum(1), received[:, :El].sum(1), received[:, El]]).tolist()
        if rejected is not None:
            raise rejected
        if any(failed):
            ranks = [r for r, f in enumerate(failed) if f]
            raise RuntimeError(f"expert parallel forward: rank(s) {ranks} of the process group rejected their "
                               f"inputs (see the ValueError there); no slots were exchanged")

        hidden_states, top_k_weights = hidden_states.contiguous(), top_k_weights.contiguous()
        participates = torch.is_grad_enabled() and (
            hidden_states.requires_grad or top_k_weights.requires_grad
            or any(p.requires_grad for p in self.experts.parameters()))
        anchor = torch.empty(0, device=device, requires_grad=participates)
        order = torch.argsort(key, stable=True)[:sum(send_sizes)]
        send_rows = hidden_states[order // slots.k]
        recv_rows = _Exchange.apply(send_rows, anchor, recv_sizes, send_sizes, self.group)

        if recv_rows.shape[0]:
            local_ids = torch.arange(El, device=device).repeat(W).repeat_interleave(
                received[:, :El].reshape(-1), output_size=recv_rows.shape[0])
            ones = top_k_weights.new_ones(recv_rows.shape[0], 1)
            results = self.experts(recv_rows, local_ids[:, None], ones)
        else:
            results = recv_rows * 0  # no rows: keeps the dispatch exchange in the graph for backward
        returned = _Exchange.apply(results, anchor, send_sizes, recv_sizes, self.group)
        per_slot = returned.new_zeros(slots.count, returned.shape[1]).index_copy(0, order, returned)
        return combine(per_slot, slots, top_k_weights, hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, world_size={self.world_size}, rank={self.rank}, "
                f"local experts [{self.first_expert}, {self.first_expert + self.num_local_experts})")
