"""One module per backend; each exports ``experts_forward`` with the common signature and ``NAME``."""

from . import batched_mm, deepgemm, deepgemm_megamoe, eager, grouped_mm, sonicmoe, triton

ALL = (eager, batched_mm, grouped_mm, triton, sonicmoe, deepgemm, deepgemm_megamoe)
