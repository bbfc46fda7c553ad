"""One module per backend; each exports ``experts_forward`` with the common signature and ``NAME``."""

from . import batched_mm, deepgemm, eager, grouped_mm, ragged_dot, sonicmoe, triton

ALL = (eager, batched_mm, grouped_mm, ragged_dot, triton, sonicmoe, deepgemm)
