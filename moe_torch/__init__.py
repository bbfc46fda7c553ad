"""moe_torch: MoE expert backends for PyTorch on the shared moe_shared contract."""

from . import graphs
from .api import ExpertsInterface, available_backends, experts_forward
from .modules import Experts, decode_mode, get_experts_implementation, set_experts_implementation
from .parallel import ExpertParallel

__all__ = ["ExpertsInterface", "available_backends", "experts_forward", "Experts", "decode_mode",
           "get_experts_implementation", "set_experts_implementation", "ExpertParallel", "graphs"]
