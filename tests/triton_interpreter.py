"""The Triton interpreter, made to compute bfloat16 the way the GPU does (imported by the tests that run kernels).

triton 3.6.0's interpreter keeps bfloat16 values as their uint16 bit patterns, and
- its ``tl.dot`` multiplies those bit patterns as integers: bfloat16 operands are widened to float32 first here
  (exact: a product of two bfloat16 values fits in float32), as the interpreter already widens fp8 operands, so the
  dot is float32 sums of exact products, as in the GPU's MMA;
- its float32 -> bfloat16 cast truncates: it rounds to nearest even here (ml_dtypes), as the GPU's cvt.rn does.
"""

import ml_dtypes
import numpy as np
import triton.language as tl
from triton.runtime import interpreter

_Builder = interpreter.InterpreterBuilder
_original_dot = _Builder.create_dot
_original_cast = _Builder.cast_impl


def _widen(handle):
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    bits = handle.data.astype(np.uint32) << np.uint32(16)
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)


def exact_bfloat16_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _original_dot(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)


def rounding_cast(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bits = np.asarray(src.data, dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        return interpreter.TensorHandle(bits, tl.bfloat16)
    return _original_cast(self, src, dst_type)


_Builder.create_dot = exact_bfloat16_dot
_Builder.cast_impl = rounding_cast
_original_patch_tensor = interpreter._patch_lang_tensor


def _patch_tensor_with_scalar_index(tensor, scope):
    """A loaded scalar is a one-element array in the interpreter, which numpy 2 will not turn into an int: let
    run-time loop bounds (``range(0, count, BR)``) take it, as compiled kernels do."""
    _original_patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_tensor_with_scalar_index


def jax_interpreter_launch(kernel, step, args, out_shapes):
    """A moe_jax.backends.triton launcher that runs a plan step under the Triton interpreter on the host
    (``jax.pure_callback``): the same kernel, constants and grid as its default launcher would launch."""
    import jax
    import torch

    def to_torch(a):
        a = np.asarray(a)
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(a.copy())

    def to_numpy(t, dtype):
        if t.dtype == torch.bfloat16:
            return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy().astype(dtype, copy=False)

    positions = [i for i, a in enumerate(args) if not isinstance(a, int)]

    def host(*arrays):
        values = list(args)
        for i, a in zip(positions, arrays):
            values[i] = to_torch(a)
        outputs = [torch.zeros(s.shape, dtype=to_torch(np.zeros((), s.dtype)).dtype) for s in out_shapes]
        kernel[(step.grid,)](*values, *outputs, num_warps=step.num_warps, num_stages=step.num_stages,
                             **step.constants)
        return [to_numpy(t, s.dtype) for t, s in zip(outputs, out_shapes)]

    return jax.pure_callback(host, list(out_shapes), *[args[i] for i in positions])
