"""moe_torch backends inside transformers models: registration, every family against HF eager, generate(), the
decode switch, expert-parallel sentinels and the unsupported features."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.activations import ACT2FN
from transformers.generation.utils import GenerationMixin
from transformers.integrations import moe as hf_moe
from transformers.utils import logging as hf_logging

import moe_torch
from moe_shared.registry import UnknownBackendError
from moe_shared.spec import FrameworkSupport, Requirements
from moe_torch import ExpertsInterface
from moe_torch.integrations import transformers as integration
from support import SPEC, assert_close

hf_logging.set_verbosity_error()

BACKENDS = [n for n in SPEC.backend_names("torch") if moe_torch.available_backends("cpu").get(n) is None]
NAMES = integration.register()
GROUPED, BATCHED = integration.hf_name("grouped_mm"), integration.hf_name("batched_mm")

SMALL = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=100,
             num_local_experts=8, num_experts=8, n_routed_experts=8, num_experts_per_tok=2,
             max_position_embeddings=64, first_k_dense_replace=0, n_group=1, topk_group=1, kv_lora_rank=16,
             q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, decoder_sparse_step=1,
             mlp_only_layers=[], pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MLA = {"num_key_value_heads": 4}
FAMILIES = {
    "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {}, "gpt_oss": {}, "olmoe": {}, "granitemoe": {}, "phimoe": {},
    "deepseek_v2": MLA, "deepseek_v3": MLA, "glm4_moe_lite": MLA, "deepseek_v4": {},
    "nemotron_h": {"layers_block_type": ["full_attention", "moe"], "moe_shared_expert_intermediate_size": 32,
                   "mamba_num_heads": 4, "mamba_head_dim": 8, "use_mamba_kernels": False},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 1, "expert_layer_offset": 0,
              "use_mamba_kernels": False, "mamba_dt_rank": 8, "mamba_d_state": 8},
    "kimi_linear": {**MLA, "layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["sparse"] * 2,
                    "num_experts_per_token": 2, "linear_head_dim": 8, "linear_num_heads": 4},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 0},
    "dots1": {"n_shared_experts": 1, "max_window_layers": 2, "layer_types": ["full_attention"] * 2},
    "glm4_moe": {}, "ernie4_5_moe": {}, "hunyuan_v1_moe": {}, "flex_olmo": {}, "minimax": {}, "minimax_m2": {},
    "afmoe": {}, "cohere2_moe": {}, "exaone_moe": {}, "granitemoeshared": {}, "solar_open": {},
    "mimo_v2_flash": {}, "laguna": {}, "hy_v3": {},
}


class Call(NamedTuple):
    backend: str
    activation: object
    hidden_dtype: torch.dtype
    routing_dtype: torch.dtype
    implementation: str | None  # the watched model's experts implementation during the call


class Spy:
    """Records every call that reaches a moe_torch backend, in order."""

    def __init__(self):
        self.log: list[Call] = []
        self.model = None

    def wrap(self, name, fn):
        def backend(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, **kw):
            current = None if self.model is None else self.model.get_experts_implementation()[""]
            self.log.append(Call(name, kw["activation"], hidden_states.dtype, top_k_weights.dtype, current))
            return fn(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, **kw)
        return backend


def tiny_config(model_type: str, **overrides):
    config = AutoConfig.for_model(model_type)
    fields = config.to_dict()
    kwargs = {k: v for k, v in SMALL.items() if k in fields} | FAMILIES.get(model_type, {}) | overrides
    return type(config)(**kwargs)


def experts_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "has_gate", None), bool)]


def tiny_model(model_type: str, dtype=torch.float32, implementation="eager", **overrides):
    """A randomly initialised model whose experts weigh in: expert weights of order 1, non-zero biases."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides),
                                             experts_implementation=implementation)
    with torch.no_grad():
        for module in experts_modules(model):
            for p in module.parameters(recurse=False):
                p.normal_(0.0, 0.2 if p.dim() == 3 else 0.1)
    return model.to(dtype).eval()


def token_ids(batch=2, length=7, seed=1):
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def run(model, ids, implementation):
    """Logits and the output of every experts call, with ``implementation`` set on the model."""
    model.set_experts_implementation(implementation)
    outputs = []
    hooks = [m.register_forward_hook(lambda mod, args, out: outputs.append(out.detach().float()))
             for m in experts_modules(model)]
    try:
        with torch.no_grad():
            logits = model(ids).logits.float()
    finally:
        for hook in hooks:
            hook.remove()
    return logits, outputs


def assert_model_close(label, model, ids, implementation, reference, dtype="float32"):
    logits, experts = run(model, ids, implementation)
    ref_logits, ref_experts = reference
    assert len(experts) == len(ref_experts)
    for i, (out, ref) in enumerate(zip(experts, ref_experts)):
        assert_close(f"{label}: experts call {i}", out, ref.double().numpy(), dtype)
    assert_close(f"{label}: logits", logits, ref_logits.double().numpy(), dtype)


@pytest.fixture
def calls():
    """A Spy around every moe_torch backend, removed after the test."""
    spy = Spy()
    originals = {name: (ExpertsInterface[name], ExpertsInterface.capability(name)) for name in BACKENDS}
    for name, (fn, capability) in originals.items():
        ExpertsInterface.register(name, spy.wrap(name, fn), capability=capability)
    try:
        yield spy
    finally:
        for name, (fn, capability) in originals.items():
            ExpertsInterface.register(name, fn, capability=capability)


@pytest.fixture
def hf_registry(monkeypatch):
    """transformers' global experts mapping, restored after the test."""
    monkeypatch.setattr(hf_moe.ExpertsInterface, "_global_mapping", dict(hf_moe.ExpertsInterface._global_mapping))


# ----------------------------------------------------------------------------------------------------------- register

def test_register_names_every_available_backend():
    assert BACKENDS == ["eager", "batched_mm", "grouped_mm"]
    assert NAMES == [f"moe_torch:{b}" for b in BACKENDS]
    for backend, name in zip(BACKENDS, NAMES):
        assert hf_moe.ALL_EXPERTS_FUNCTIONS[name] is integration.experts_function(backend)


def test_register_is_idempotent():
    functions = {n: hf_moe.ALL_EXPERTS_FUNCTIONS[n] for n in NAMES}
    decode = GenerationMixin._optimize_model_for_decode
    assert integration.register() == NAMES
    assert {n: hf_moe.ALL_EXPERTS_FUNCTIONS[n] for n in NAMES} == functions
    assert GenerationMixin._optimize_model_for_decode is decode
    assert decode._moe_torch_wrapped.__name__ == "_optimize_model_for_decode"


def test_register_adds_user_backends_and_skips_unavailable_ones(hf_registry, calls):
    log = calls.log
    gpu_only = FrameworkSupport("torch", ("cuda",), ("float32",), (), Requirements())
    ExpertsInterface.register("user_batched", lambda *a, **kw: ExpertsInterface["batched_mm"](*a, **kw))
    ExpertsInterface.register("user_gpu_only", ExpertsInterface["batched_mm"], capability=gpu_only)
    try:
        names = integration.register("cpu")
        assert names == NAMES + ["moe_torch:user_batched"]
        assert "moe_torch:user_gpu_only" not in hf_moe.ALL_EXPERTS_FUNCTIONS
        model = tiny_model("qwen3_moe")
        reference = run(model, token_ids(), "eager")
        log.clear()
        assert_model_close("user backend", model, token_ids(), "moe_torch:user_batched", reference)
        assert {c.backend for c in log} == {"batched_mm"}
    finally:
        ExpertsInterface.unregister("user_batched")
        ExpertsInterface.unregister("user_gpu_only")


def test_unknown_names_raise():
    with pytest.raises(ValueError, match=r"implementation: expected one of .*'grouped_mm'.*got 'nope'"):
        integration.experts_function("nope")
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match="moe_torch:nope"):
        model.set_experts_implementation("moe_torch:nope")
    with pytest.raises(ValueError, match="moe_torch:nope"):
        AutoModelForCausalLM.from_config(tiny_config("mixtral"), experts_implementation="moe_torch:nope")


def test_backend_removed_after_registration_raises(hf_registry):
    ExpertsInterface.register("short_lived", ExpertsInterface["eager"])
    integration.register()
    model = tiny_model("mixtral", implementation="moe_torch:short_lived")
    ExpertsInterface.unregister("short_lived")
    with pytest.raises(UnknownBackendError, match="got 'short_lived'"):
        model(token_ids())


# ------------------------------------------------------------------------------------------------ numerics per family

@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_hf_eager(family, calls):
    log = calls.log
    model = tiny_model(family)
    ids = token_ids()
    reference = run(model, ids, "eager")
    n_calls = len(reference[1])
    assert n_calls > 0 and not log, "HF eager must run the model's own experts, not moe_torch"
    for backend, name in zip(BACKENDS, NAMES):
        log.clear()
        assert_model_close(f"{family} {name}", model, ids, name, reference)
        assert [c.backend for c in log] == [backend] * n_calls


def test_from_config_with_our_name(calls):
    log = calls.log
    model = tiny_model("mixtral", implementation=GROUPED)
    assert model.get_experts_implementation()[""] == GROUPED
    logits, experts = run(model, token_ids(), GROUPED)
    assert [c.backend for c in log] == ["grouped_mm"] * len(experts)
    assert_model_close("from_config", model, token_ids(), "eager", (logits, experts))


@pytest.mark.parametrize("hidden_act, expected", [("silu", "silu"), ("swish", "silu"), ("gelu", "gelu"),
                                                   ("relu", "relu"), ("gelu_pytorch_tanh", None),
                                                   ("gelu_python", None), ("relu2", None)])
def test_default_gate_passes_the_named_activation(hidden_act, expected, calls):
    log = calls.log
    model = tiny_model("mixtral", hidden_act=hidden_act)
    reference = run(model, token_ids(), "eager")
    assert_model_close(hidden_act, model, token_ids(), GROUPED, reference)
    if expected is None:
        assert log and all(getattr(c.activation, "__func__", None) is hf_moe._default_apply_gate for c in log)
    else:
        assert {c.activation for c in log} == {expected}


def test_activation_name_table():
    named = {name: integration.activation_name(ACT2FN[name]) for name in
             ("silu", "swish", "gelu", "relu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "relu2", "sigmoid")}
    assert named == {"silu": "silu", "swish": "silu", "gelu": "gelu", "relu": "relu", "gelu_python": None,
                     "gelu_new": None, "gelu_pytorch_tanh": None, "relu2": None, "sigmoid": None}
    assert integration.activation_name(torch.nn.GELU(approximate="tanh")) is None
    assert integration.activation_name(torch.nn.GELU()) == "gelu"
    assert integration.activation_name(torch.nn.functional.silu) == "silu"
    assert integration.activation_name(torch.tanh) is None


def test_transposed_biased_custom_gate_layout_gpt_oss():
    module = experts_modules(tiny_model("gpt_oss"))[0]
    E, H, I2 = module.gate_up_proj.shape
    args = integration.contract_arguments(module)
    assert args["gate_up_proj"].shape == (E, I2, H) and args["down_proj"].shape == (E, H, I2 // 2)
    assert args["gate_up_proj"].data_ptr() == module.gate_up_proj.data_ptr()  # a view, no copy
    assert args["down_proj"].data_ptr() == module.down_proj.data_ptr()
    assert args["gate_up_bias"] is module.gate_up_proj_bias and args["down_bias"] is module.down_proj_bias
    assert args["activation"] == module._apply_gate


def test_ungated_experts_nemotron_h():
    module = experts_modules(tiny_model("nemotron_h"))[0]
    args = integration.contract_arguments(module)
    assert args["gate_up_proj"] is module.up_proj and args["down_proj"] is module.down_proj
    assert args["activation"] is module.act_fn and args["gate_up_bias"] is None


def test_wrong_kernel_is_detected(hf_registry):
    """The family comparison is sensitive: a backend that drops the down-projection bias fails it."""
    ExpertsInterface.register("no_down_bias", lambda *a, down_bias=None, **kw: ExpertsInterface["eager"](*a, **kw))
    try:
        integration.register()
        model = tiny_model("gpt_oss")
        reference = run(model, token_ids(), "eager")
        with pytest.raises(AssertionError, match="relative L2"):
            assert_model_close("no bias", model, token_ids(), "moe_torch:no_down_bias", reference)
    finally:
        ExpertsInterface.unregister("no_down_bias")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_bfloat16_model_matches_hf_eager(family, calls):
    log = calls.log
    model = tiny_model(family, dtype=torch.bfloat16)
    ids = token_ids()
    reference = run(model, ids, "eager")
    for name in NAMES:
        assert_model_close(f"{family} bf16 {name}", model, ids, name, reference, dtype="bfloat16")
    assert {c.hidden_dtype for c in log} == {torch.bfloat16}
    if family == "mixtral":  # its router hands float32 weights to bfloat16 experts
        assert {c.routing_dtype for c in log} == {torch.float32}


def test_three_dimensional_hidden_states():
    module = experts_modules(tiny_model("mixtral"))[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 32, generator=g)
    idx = torch.randint(0, 8, (2, 3, 2), generator=g)
    w = torch.rand(2, 3, 2, generator=g)
    fn = integration.experts_function("grouped_mm")
    out = fn(module, x, idx, w)
    assert out.shape == x.shape
    torch.testing.assert_close(out.view(6, 32), fn(module, x.view(6, 32), idx.view(6, 2), w.view(6, 2)))


FULLGRAPH = [integration.hf_name(b) for b in BACKENDS if ExpertsInterface.capability(b).compile.fullgraph]


@pytest.mark.parametrize("name", FULLGRAPH)
def test_fullgraph_trace(name):
    """The adapter adds no graph break: torch.compile(fullgraph=True) traces a whole GPT-OSS model (dynamo only)."""
    model = tiny_model("gpt_oss")
    ids = token_ids()
    reference = run(model, ids, "eager")
    model.set_experts_implementation(name)
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
    assert_close(f"compiled {name}", logits, reference[0].double().numpy(), "float32")


# ------------------------------------------------------------------------------------------- generate and decode switch

@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_generate_matches_hf_eager(family):
    model = tiny_model(family)
    ids = token_ids(length=5)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    model.set_experts_implementation("eager")
    expected = model.generate(ids, **kwargs)
    assert expected.shape == (2, 11)
    for name in NAMES:
        model.set_experts_implementation(name)
        torch.testing.assert_close(model.generate(ids, **kwargs), expected, rtol=0, atol=0, msg=name)


def _generate_and_log(model, calls, new_tokens=4):
    calls.model = model
    ids = token_ids(length=5)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False)
    return out, calls.log


def test_decode_keeps_grouped_on_cpu(calls):
    assert integration.decode_threshold(torch.device("cpu")) == SPEC.decode_threshold("torch", "cpu") == 0
    model = tiny_model("mixtral", implementation=GROUPED)
    n = len(experts_modules(model))
    out, log = _generate_and_log(model, calls, new_tokens=4)
    assert [(c.backend, c.implementation) for c in log] == [("grouped_mm", GROUPED)] * (4 * n)
    assert model.get_experts_implementation()[""] == GROUPED


def test_decode_switches_to_batched_when_the_threshold_is_positive(calls, monkeypatch):
    model = tiny_model("mixtral")
    expected = model.generate(token_ids(length=5), attention_mask=torch.ones(2, 5, dtype=torch.long),
                              max_new_tokens=4, min_new_tokens=4, do_sample=False)
    spec = dataclasses.replace(SPEC, decode_max_gathered_mib={"torch": {"cpu": 64, "cuda": 64}})
    monkeypatch.setattr(integration, "_SPEC", spec)
    model.set_experts_implementation(GROUPED)
    n = len(experts_modules(model))
    out, log = _generate_and_log(model, calls, new_tokens=4)
    prefill, decode = log[:n], log[n:]
    assert [(c.backend, c.implementation) for c in prefill] == [("grouped_mm", GROUPED)] * n
    assert [(c.backend, c.implementation) for c in decode] == [("batched_mm", BATCHED)] * (3 * n)
    assert model.get_experts_implementation()[""] == GROUPED
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_decode_mode_leaves_other_names_and_restores_on_error(monkeypatch):
    monkeypatch.setattr(integration, "_SPEC", dataclasses.replace(SPEC, decode_max_gathered_mib={"torch": {"cpu": 8}}))
    model = tiny_model("mixtral")
    for name in ["eager", "grouped_mm", integration.hf_name("eager"), BATCHED]:
        model.set_experts_implementation(name)
        with integration.decode_mode(model):
            assert model.get_experts_implementation()[""] == name
    model.set_experts_implementation(GROUPED)
    with pytest.raises(RuntimeError, match="boom"):
        with integration.decode_mode(model):
            assert model.get_experts_implementation()[""] == BATCHED
            raise RuntimeError("boom")
    assert model.get_experts_implementation()[""] == GROUPED
    with pytest.raises(ValueError, match="model: expected a transformers PreTrainedModel"):
        with integration.decode_mode(torch.nn.Linear(2, 2)):
            pass


# ---------------------------------------------------------------------------------------------- EP and unsupported

@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_expert_parallel_sentinels_are_empty_slots(backend):
    module = experts_modules(tiny_model("mixtral"))[0]
    E = module.num_experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 32, generator=g)
    idx = torch.randint(0, E, (6, 2), generator=g)
    idx[0, 1], idx[3, 0], idx[5] = E, E + 3, E
    w = torch.rand(6, 2, generator=g) + 0.5
    fn = integration.experts_function(backend)
    with pytest.raises(ValueError, match="top_k_index"):
        fn(module, x, idx, w)
    module._is_expert_parallel = True
    out = fn(module, x, idx, w)
    reference = hf_moe.grouped_mm_experts_forward(module, x, idx, w)
    assert_close(f"EP {backend}", out, reference.double().numpy(), "float32")
    assert torch.equal(out[5], torch.zeros(32))
    valid = idx < E
    dropped = fn(module, x, torch.where(valid, idx, 0), torch.where(valid, w, 0.0))
    assert_close(f"EP {backend} vs zero weights", out, dropped.double().numpy(), "float32")


@pytest.mark.parametrize("name", NAMES)
def test_post_expert_norm_is_not_supported(name):
    from transformers.models.muse_spark.configuration_muse_spark import MuseSparkTextConfig
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

    config = MuseSparkTextConfig(num_local_experts=4, moe_hidden_size=16, moe_intermediate_size=8)
    module = MuseSparkExperts(config)
    config._experts_implementation = name
    x, idx, w = torch.randn(3, 16), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    with pytest.raises(NotImplementedError, match=r"MuseSparkExperts: .*has_post_expert_norm=True"):
        module(x, idx, w)
