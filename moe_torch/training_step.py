"""A backend's training step as one autograd node, and the same step replayed as two CUDA graphs.

Training with a named activation and no biases is host-bound at decode: the composed path records a node per step
(gather, projection, gate, projection, combine), each with its own backward. A backend whose math allows it gives
its step as a ``Step``, written with the ops of its composed path, and ``apply`` runs it:

- as ``_TrainingStep``, one autograd node: the forward keeps what the backward reads, the backward makes every
  gradient in one call (the weight gradients as K-grouped matmuls over the slots sorted by expert);
- within the spec's ``training_graphs`` bound (``moe_torch.graphs.training_wanted``) as ``_GraphedTrainingStep``:
  the forward and the backward up to the weight gradients replayed as CUDA graphs of the decode graphs' pool. The
  backward's graph makes the forward's values again from the call's own inputs (the same kernels, so the same bits),
  so nothing of a graph is kept between forward and backward and steps may interleave. The weight gradients are made
  outside the graphs: fresh tensors autograd keeps without a copy.

Shapes: T tokens, k slots per token, H hidden, E experts; x [T, H] in the weights' dtype, ids [T*k] in [0, E),
empty [T, k] or None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from . import graphs
from .base import Slots, as_dtype, takes_grad


class Step(NamedTuple):
    """A backend's training step. Gradient operands are (rows [R, N], inputs [R, K], int32 end row per expert, E)
    for ``weight_grad``, None where that weight's gradient is not needed; ``needs``: which of (hidden states,
    routing weights, gate_up_proj, down_proj) take gradients."""

    forward: Callable  # (x, top_k_weights, gate_up_proj, down_proj, ids, empty, activation, T, k, needs)
    # -> (the sum over k in float32 [T, H], what backward reads)
    backward: Callable  # (grad, x, gate_up_proj, down_proj, ids, empty, kept, activation, T, k, needs, hidden_dtype)
    # -> (d hidden_states, d routing weights [T, k], gate_up_proj's operands, down_proj's operands)
    weight_grad: Callable  # (rows, inputs, offs, E) -> [E, N, K]


def wanted(activation, gate_up_bias, down_bias, *tensors: torch.Tensor) -> bool:
    """Whether a call runs as a training step: a named activation, no biases, and a tensor of ``tensors`` taking
    gradients."""
    return isinstance(activation, str) and gate_up_bias is None and down_bias is None and takes_grad(*tensors)


def apply(step: Step, name: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
          top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
          activation: str) -> torch.Tensor:
    """The output [T, H] of backend ``name``'s training ``step``: as training graphs where they are wanted, else as
    one autograd node."""
    if graphs.training_wanted(name, activation, hidden_states, top_k_index, gate_up_proj, down_proj):
        return _GraphedTrainingStep.apply(hidden_states, top_k_weights, gate_up_proj, down_proj, top_k_index,
                                          activation, step, name)
    slots, empty = _slots(top_k_index, down_proj.shape[0])
    return _TrainingStep.apply(hidden_states, top_k_weights, gate_up_proj, down_proj, slots.safe_ids, empty,
                               activation, slots.T, slots.k, step)


def _slots(top_k_index: torch.Tensor, num_experts: int) -> tuple[Slots, torch.Tensor | None]:
    """The call's slots and their empty mask as [T, k] (None where no slot is empty)."""
    slots = Slots(top_k_index, num_experts)
    return slots, None if slots.empty is None else slots.empty.view(slots.T, slots.k)


def _weight_grad(step: Step, operands) -> torch.Tensor | None:
    return None if operands is None else step.weight_grad(*operands)


class _TrainingStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, top_k_weights, gate_up_proj, down_proj, ids, empty, activation, T, k, step):
        x = as_dtype(hidden_states, gate_up_proj.dtype)
        out, kept = step.forward(x, top_k_weights, gate_up_proj, down_proj, ids, empty, activation, T, k,
                                 tuple(ctx.needs_input_grad[:4]))
        ctx.save_for_backward(x, gate_up_proj, down_proj, ids, empty, *kept)
        ctx.step = (step, activation, T, k, hidden_states.dtype, top_k_weights.shape)
        return out.to(hidden_states.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, gate_up_proj, down_proj, ids, empty, *kept = ctx.saved_tensors
        step, activation, T, k, hidden_dtype, weights_shape = ctx.step
        grad_x, grad_weights, gate_up_operands, down_operands = step.backward(
            grad, x, gate_up_proj, down_proj, ids, empty, kept, activation, T, k, tuple(ctx.needs_input_grad[:4]),
            hidden_dtype)
        if grad_weights is not None:
            grad_weights = grad_weights.reshape(weights_shape)
        return (grad_x, grad_weights, _weight_grad(step, gate_up_operands), _weight_grad(step, down_operands),
                None, None, None, None, None, None)


def _graph_forward(step, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, needs):
    """The step's forward from the call's own inputs, as a training graph captures it: ((ids, empty, x), its output,
    what its backward reads)."""
    slots, empty = _slots(top_k_index, down_proj.shape[0])
    x = as_dtype(hidden_states, gate_up_proj.dtype)
    out, kept = step.forward(x, top_k_weights, gate_up_proj, down_proj, slots.safe_ids, empty, activation, slots.T,
                             slots.k, needs)
    return (slots.safe_ids, empty, x), out.to(hidden_states.dtype), kept


def _graph_backward(step, hidden_states, top_k_index, top_k_weights, grad, gate_up_proj, down_proj, activation,
                    needs):
    """The step's forward made again, then its backward up to the weight gradients, as a training graph captures
    it: (d hidden_states, d routing weights [T, k], the rows and inputs of gate_up_proj's gradient, then of
    down_proj's, the experts' end rows), None where not needed."""
    (ids, empty, x), _, kept = _graph_forward(step, hidden_states, top_k_index, top_k_weights, gate_up_proj,
                                              down_proj, activation, needs)
    T, k = top_k_index.shape
    grad_x, grad_weights, gate_up_operands, down_operands = step.backward(
        grad, x, gate_up_proj, down_proj, ids, empty, kept, activation, T, k, needs, hidden_states.dtype)
    offs = next((operands[2] for operands in (gate_up_operands, down_operands) if operands is not None), None)
    return (grad_x, grad_weights, *(gate_up_operands or (None,) * 2)[:2], *(down_operands or (None,) * 2)[:2],
            offs)


class _GraphedTrainingStep(torch.autograd.Function):
    """``_TrainingStep`` with its forward and its backward (up to the weight gradients) replayed as CUDA graphs
    (``moe_torch.graphs.replay``): a few copies and two replays a step instead of dozens of launches. Keeps only the
    call's own inputs, no graph buffer. The same bits as ``_TrainingStep``. Each graph's signature is taken when it
    runs: weights whose memory moved between forward and backward (re-gathered, say) are a new signature, never a
    stale address."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_weights, gate_up_proj, down_proj, top_k_index, activation, step, name):
        ctx.save_for_backward(hidden_states, top_k_weights, gate_up_proj, down_proj, top_k_index)
        ctx.step = (step, activation, name)
        needs = tuple(ctx.needs_input_grad[:4])
        inputs = (hidden_states, top_k_index, top_k_weights)

        def call(hidden_states, top_k_index, top_k_weights):
            return _graph_forward(step, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                  activation, needs)[1]
        key = graphs.training_key(name, activation, inputs, (gate_up_proj, down_proj))
        return graphs.run(key + ("forward", needs), call, inputs)

    @staticmethod
    @once_differentiable  # a graph's replay is not differentiated: a second derivative raises, never silently zero
    def backward(ctx, grad):
        hidden_states, top_k_weights, gate_up_proj, down_proj, top_k_index = ctx.saved_tensors
        step, activation, name = ctx.step
        needs = tuple(ctx.needs_input_grad[:4])

        def call(hidden_states, top_k_index, top_k_weights, grad):
            return _graph_backward(step, hidden_states, top_k_index, top_k_weights, grad, gate_up_proj, down_proj,
                                   activation, needs)
        inputs = (hidden_states, top_k_index, top_k_weights, grad.contiguous())
        key = graphs.training_key(name, activation, inputs, (gate_up_proj, down_proj))
        grad_x, grad_weights, gate_up_rows, gate_up_in, down_rows, down_in, offs = graphs.replay(
            key + ("backward", needs), call, inputs)
        E = down_proj.shape[0]
        # read before the graph's next replay: launched now, on this stream
        grad_gate_up = None if gate_up_rows is None else step.weight_grad(gate_up_rows, gate_up_in, offs, E)
        grad_down = None if down_rows is None else step.weight_grad(down_rows, down_in, offs, E)
        return (None if grad_x is None else grad_x.clone(),
                None if grad_weights is None else grad_weights.reshape(top_k_weights.shape).clone(),
                grad_gate_up, grad_down, None, None, None, None)
