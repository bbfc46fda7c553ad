"""Session set-up shared by every test module.

The Triton kernels run under the Triton interpreter on this CPU-only machine: TRITON_INTERPRET must be set before
``moe_shared.kernels.moe`` is imported (its kernels are wrapped when they are defined).

XLA's CPU compiler runs LLVM without its optimisation passes here (``--xla_backend_optimization_level=0``, unless
XLA_FLAGS is set): the suite compiles hundreds of small programs, each run once or twice, and a third of its JAX
time went into LLVM. The HLO passes, and so what each program computes, are XLA's defaults; LLVM reorders no
floating-point arithmetic at any level without fast-math, which XLA leaves off.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
