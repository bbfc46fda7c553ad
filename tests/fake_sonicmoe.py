"""SonicMoE's kernel steps as plain torch, for running both ``sonicmoe`` bindings on the CPU.

Each function takes the arguments of the SonicMoE function the spec names for its step (sonic-moe 0.1.2.post1)
and fills its output buffers with what that kernel computes, in float32 with the results rounded to the buffers'
dtype. It checks what SonicMoE needs of its inputs (dtypes, shapes, the weights' strided layout, routing metadata
that gives every slot a row), so a binding that passed anything else fails here. The pre-activation buffer holds
[gate; up] (SonicMoE keeps its own interleaved order there; only these steps read it). ``routing_reference`` is
what SonicMoE's own routing step gives, which the shared Triton routing the bindings run must match. The real
kernels run in tests/device_sonicmoe_check.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def _rows(offsets: torch.Tensor) -> torch.Tensor:
    """The expert of each grouped row."""
    counts = (offsets[1:] - offsets[:-1]).long()
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def _weights(w: torch.Tensor, name: str) -> torch.Tensor:
    """SonicMoE's (N, K, E) weight view, stride order (2, 0, 1), as [E, N, K]."""
    stored = w.permute(2, 0, 1)
    assert stored.is_contiguous(), f"{name}: expected a permuted view of contiguous [E, N, K] weights"
    return stored.float()


def routing_reference(ids, w, E) -> dict:
    """SonicMoE's routing metadata (as its own routing step gives it) for ``ids`` [T, k], every id outside [0, E)
    routed to expert 0 with the routing weight 0: the stable order of the slots by expert (``s_scatter``), each
    sorted row's token, each slot's sorted row, the experts' row offsets and the weights in float32."""
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    experts = torch.where(valid, flat, 0)
    order = torch.sort(experts, stable=True).indices
    counts = torch.bincount(experts, minlength=E)
    return {"scores": torch.where(valid, w.reshape(-1).float(), 0.0),
            "offsets": torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int(),
            "x_gather": (order // k).int(), "s_scatter": order.int(),
            "s_reverse": torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel())).int()}


def _check_routing(offsets, x_gather):
    assert offsets.dtype == torch.int32 and x_gather.dtype == torch.int32 and int(offsets[0]) == 0
    assert int(offsets[-1]) == x_gather.numel(), "every slot takes a row of some expert"


def up(x, w1, h, a, b1, offsets, x_gather, activation, inference, concat_layout):
    assert activation == "swiglu" and concat_layout and x.is_contiguous()
    _check_routing(offsets, x_gather)
    assert (h is None) == inference
    gate_up = _weights(w1, "w1")
    experts = _rows(offsets)
    pre = torch.einsum("sh,snh->sn", x[x_gather.long()].float(), gate_up[experts])
    if b1 is not None:
        pre = pre + b1.float()[experts]
    I = pre.shape[1] // 2
    a.copy_(F.silu(pre[:, :I]) * pre[:, I:])
    if h is not None:
        h.copy_(pre)


def down(w2, a, y, b2, offsets):
    weights, experts = _weights(w2, "w2"), _rows(offsets)
    out = torch.einsum("si,shi->sh", a.float(), weights[experts])
    y.copy_(out if b2 is None else out + b2.float()[experts])


def combine(y, o, scores, s_reverse, per_token_offsets, k, H, varlen):
    assert per_token_offsets is None and not varlen and scores.dtype == torch.float32
    rows = y.float()[s_reverse.long()] * scores[:, None]
    o.copy_(rows.view(-1, k, H).sum(1))


def down_backward(dout, h, w2, dh, ds, b2, db2, a_prime, scores, offsets, x_gather, s_scatter, activation):
    assert activation == "swiglu"
    weights, experts = _weights(w2, "w2"), _rows(offsets)
    slot = s_scatter.long()
    d_rows = dout.float()[x_gather.long()]
    s = scores[slot]
    pre = h.float()
    I = pre.shape[1] // 2
    g, u = pre[:, :I], pre[:, I:]
    act = F.silu(g) * u
    d_act = torch.einsum("sh,shi->si", d_rows, weights[experts])
    d_scores = (d_act * act).sum(1)
    if b2 is not None:
        d_scores = d_scores + (d_rows * b2.float()[experts]).sum(1)
        db2.copy_(torch.zeros(b2.shape).index_add_(0, experts, d_rows * s[:, None]))
    ds[slot] = d_scores
    d_act = d_act * s[:, None]
    sig = torch.sigmoid(g)
    dh.copy_(torch.cat([d_act * u * sig * (1 + g * (1 - sig)), d_act * F.silu(g)], 1))
    a_prime.copy_(act * s[:, None])


def down_backward_weight(dout, a_prime, dw2, offsets, x_gather):
    experts = _rows(offsets)
    per_row = torch.einsum("sh,si->shi", dout.float()[x_gather.long()], a_prime.float())
    dw2.permute(2, 0, 1).copy_(torch.zeros(dw2.permute(2, 0, 1).shape).index_add_(0, experts, per_row))


def up_backward(w1, dx_slots, dh, db1, offsets, glu, concat_layout):
    assert glu and concat_layout
    gate_up, experts = _weights(w1, "w1"), _rows(offsets)
    dx_slots.copy_(torch.einsum("sn,snh->sh", dh.float(), gate_up[experts]))
    if db1 is not None:
        db1.copy_(torch.zeros(db1.shape).index_add_(0, experts, dh.float()))


def up_backward_weight(x, dw1, dh, offsets, x_gather, glu, concat_layout):
    assert glu and concat_layout
    experts = _rows(offsets)
    per_row = torch.einsum("sn,sh->snh", dh.float(), x.float()[x_gather.long()])
    dw1.permute(2, 0, 1).copy_(torch.zeros(dw1.permute(2, 0, 1).shape).index_add_(0, experts, per_row))


def token_sum(dx, dx_slots, s_reverse, per_token_offsets, k, H, varlen):
    assert per_token_offsets is None and not varlen
    dx.copy_(dx_slots.float()[s_reverse.long()].view(-1, k, H).sum(1))


def steps() -> SimpleNamespace:
    return SimpleNamespace(up=up, down=down, combine=combine, down_backward=down_backward,
                           down_backward_weight=down_backward_weight, up_backward=up_backward,
                           up_backward_weight=up_backward_weight, token_sum=token_sum)
