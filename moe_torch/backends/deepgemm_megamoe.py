"""deepgemm_megamoe: DeepGEMM's Mega MoE kernel (expert-parallel dispatch, the gated MLP and the EP combine in one
kernel; Blackwell, FP4 experts with UE8M0 scales, an expert-parallel process group with symmetric memory).

Registered with its requirements (the spec's ``backends.deepgemm_megamoe``). The contract's experts are bf16 and
come without a process group, so no call can run it yet: each raises a RuntimeError listing everything missing,
never running another backend instead.
"""

from __future__ import annotations

import torch

from moe_shared import load_spec

NAME = "deepgemm_megamoe"
SUPPORT = load_spec().backends[NAME].support("torch")


def missing(device: torch.device, weights_dtype: torch.dtype) -> list[str]:
    """What a call on ``device`` with weights of ``weights_dtype`` lacks, in the spec's words."""
    needed = SUPPORT.requires.compute_capability
    have = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    gaps = []
    if have is None or tuple(have) < tuple(needed):
        got = f"{have[0]}.{have[1]}" if have else f"a tensor on {device}"
        gaps.append(f"a CUDA device of compute capability >= {needed[0]}.{needed[1]} (got {got})")
    gaps.append(f"{SUPPORT.requires.other['experts']} (got {str(weights_dtype).removeprefix('torch.')} experts)")
    gaps.append(f"{SUPPORT.requires.other['process_group']} (experts_forward takes none)")
    return gaps


def experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    activation="silu", gate_up_bias=None, down_bias=None):
    raise RuntimeError(f"implementation {NAME!r} cannot run here; it needs " +
                       "; ".join(missing(gate_up_proj.device, gate_up_proj.dtype)))
