"""A Flax author reusing a transformers checkpoint's experts: HF experts state dict -> flax_moe.Experts, same outputs
as the HF layer (tiny random models built from configs; nothing downloaded)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from moe_jax import convert, flax_moe, gates
from moe_shared import relative_l2
from support import SPEC, cpu_backends


def _routing(T, E, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, idx = torch.topk(torch.randn(T, E, generator=g).softmax(-1), k)
    return w, idx


def _hf_experts(family: str):
    torch.manual_seed(0)
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
        config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2)
        return Qwen3MoeExperts, config, dict(num_experts=6, hidden=32, inter=16, k=2, layout={}, gate="silu")
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
        config = MixtralConfig(hidden_size=24, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)
        return MixtralExperts, config, dict(num_experts=4, hidden=24, inter=40, k=2, layout={}, gate="silu")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    config = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    return GptOssExperts, config, dict(num_experts=4, hidden=32, inter=16, k=2,
                                       layout={"is_transposed": True, "interleaved": True},
                                       gate=gates.clamped_swiglu(config.swiglu_alpha, config.swiglu_limit))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_hf_experts_state_dict_into_flax_gives_the_hf_outputs(family):
    cls, config, d = _hf_experts(family)
    config._experts_implementation = "eager"
    hf = cls(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(13, d["hidden"])
    w, idx = _routing(13, d["num_experts"], d["k"])
    with torch.no_grad():
        expected = hf(x, idx, w).numpy()
    bias = any(n.endswith("_bias") for n in hf.state_dict())
    experts = flax_moe.Experts(d["num_experts"], d["hidden"], d["inter"], activation=d["gate"], bias=bias,
                               rngs=nnx.Rngs(0))
    convert.load_state_dict(experts, hf.state_dict(), **d["layout"])  # torch tensors straight in (DLPack)
    for backend in cpu_backends("jax"):
        experts.set_backend(backend)
        out = experts(jnp.asarray(x.numpy()), jnp.asarray(idx.numpy().astype(np.int32)), jnp.asarray(w.numpy()))
        assert relative_l2(np.asarray(out), expected) <= SPEC.tolerance_for("float32"), backend
    back = convert.module_state_dict(experts, names="transformers", **d["layout"])
    for name, value in hf.state_dict().items():
        np.testing.assert_array_equal(back[name], value.numpy())


def test_bfloat16_torch_tensors_convert_without_torch_in_moe_jax():
    from moe_torch import Experts
    torch_experts = Experts(3, 16, 8, bias=True, dtype=torch.bfloat16)
    flax_experts = flax_moe.Experts(3, 16, 8, bias=True, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    convert.load_state_dict(flax_experts, torch_experts.state_dict())
    x = torch.randn(9, 16, dtype=torch.bfloat16)
    w, idx = _routing(9, 3, 2, seed=1)
    expected = torch_experts(x, idx, w).detach().float().numpy()
    out = flax_experts(jnp.asarray(x.float().numpy()).astype(jnp.bfloat16), jnp.asarray(idx.numpy().astype(np.int32)),
                       jnp.asarray(w.numpy()))
    assert relative_l2(np.asarray(out.astype(jnp.float32)), expected) <= SPEC.tolerance_for("bfloat16")
    round_trip = Experts(3, 16, 8, bias=True, dtype=torch.bfloat16)
    round_trip.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float32)).bfloat16()
                                for k, v in convert.module_state_dict(flax_experts).items()})
    for k, v in torch_experts.state_dict().items():
        assert torch.equal(round_trip.state_dict()[k], v), k
