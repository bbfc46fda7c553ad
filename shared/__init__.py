"""moe_shared: the framework-neutral contract of the MoE experts backends (imports neither torch nor JAX)."""

from .contract import ArrayInfo, Dims, check_activation, check_arguments, check_expert_ids
from .metrics import relative_l2
from .spec import DEVICE_CLASSES, FRAMEWORKS, BackendSpec, Spec, load_spec

__all__ = [
    "ArrayInfo", "Dims", "check_activation", "check_arguments", "check_expert_ids", "relative_l2",
    "DEVICE_CLASSES", "FRAMEWORKS", "BackendSpec", "Spec", "load_spec",
]
