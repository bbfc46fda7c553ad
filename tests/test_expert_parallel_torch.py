"""moe_torch.ExpertParallel on torch.distributed with gloo: 2 and 4 rank processes spawned by the tests
(tests/ep_workers.py, with timeouts), forward and gradients equal to one process running every rank's tokens;
transformers' own expert parallelism with moe_torch backends; errors that reach every rank instead of a hang."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import moe_torch
from ep_workers import run_torch
from moe_torch.parallel import ExpertParallel
from support import SPEC

BACKENDS = [n for n in SPEC.backend_names("torch") if moe_torch.available_backends("cpu").get(n) is None]
CASES = ["uniform", "skewed", "no_tokens", "all_empty"]
WEIGHT_GRADS = ["grad_gate_up_proj", "grad_down_proj"]
TOKEN_CHECKS = ["out", "grad_hidden_states", "grad_top_k_weights"]


@pytest.fixture(scope="module")
def pair():
    return run_torch("pair", 2)


@pytest.fixture(scope="module")
def quad():
    return run_torch("quad", 4)


def ranks(request, world_size):
    return request.getfixturevalue({2: "pair", 4: "quad"}[world_size])


def assert_parity(results, label, backend, *, dtype="float32", bias=True):
    tol = SPEC.tolerance_for(dtype)
    checks = TOKEN_CHECKS + WEIGHT_GRADS + (["grad_gate_up_bias", "grad_down_bias"] if bias else [])
    for rank, res in enumerate(results):
        assert res[f"{label}/implementation"] == {"": backend, "moe.experts": backend}
        for check in checks:
            err = res[f"{label}/{check}"]
            assert err <= tol, f"rank {rank}: {label} {check}: relative L2 error {err:.3e} > {tol:.0e}"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_matches_one_process(request, world_size, case, backend):
    """uniform: random routing with empty slots; skewed: every rank routes everything to rank 0's experts (the
    others receive nothing); no_tokens: T = 0 on the last rank; all_empty: rank 1 routes only -1 slots."""
    assert_parity(ranks(request, world_size), f"{case}/{backend}", backend)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("label, kw", [("local_shard", {}), ("gelu_no_bias", {"bias": False}),
                                       ("bfloat16", {"dtype": "bfloat16"})])
def test_variants_match_one_process(request, world_size, label, kw):
    """local_shard: built from this rank's experts only (num_experts=E); gelu without biases; bfloat16."""
    assert_parity(ranks(request, world_size), f"{label}/grouped_mm", "grouped_mm", **kw)


@pytest.mark.parametrize("world_size", [2, 4])
def test_indivisible_experts_raise_on_every_rank(request, world_size):
    for res in ranks(request, world_size):
        assert res["indivisible"] == (f"ValueError: num_experts: expected a multiple of the world size {world_size} "
                                      f"(the experts are split evenly over the ranks), got {world_size + 1}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_different_layouts_raise_on_every_rank(request, world_size):
    for res in ranks(request, world_size):
        message = res["layout"]
        assert message.startswith("ValueError: experts: expected the same experts layout on every rank")
        assert "rank 0: num_experts=" in message and "rank 1: num_experts=" in message
        assert "hidden_size=20" in message and "hidden_size=16" in message


@pytest.mark.parametrize("world_size", [2, 4])
def test_shard_for_another_world_size_raises(request, world_size):
    for res in ranks(request, world_size):
        assert res["world_size"] == (f"ValueError: num_experts: expected experts.num_experts * world size = 1 * "
                                     f"{world_size} = {world_size} (experts holds this rank's share), "
                                     f"got {2 * world_size}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_rejected_inputs_fail_every_rank(request, world_size):
    results = ranks(request, world_size)
    others = ("RuntimeError: expert parallel forward: rank(s) [{}] of the process group rejected their inputs "
              "(see the ValueError there); no slots were exchanged")
    assert results[1]["bad_dtype"] == ("ValueError: top_k_index: expected dtype in ['int32', 'int64'], "
                                       "got dtype float32")
    assert results[0]["bad_ids"].startswith(f"ValueError: top_k_index: expected expert ids in [-1, {2 * world_size})")
    for rank, res in enumerate(results):
        if rank != 1:
            assert res["bad_dtype"] == others.format(1)
        if rank != 0:
            assert res["bad_ids"] == others.format(0)
    assert_parity(results, "after_errors/grouped_mm", "grouped_mm")


def test_dead_rank_gives_an_error_not_a_hang():
    """Rank 1 exits before the collective construction; rank 0 gets gloo's error at once."""
    results = run_torch("dead_rank", 2, timeout=60, expect_exit=[0, 3])
    assert results[1] is None
    assert results[0]["dead_rank"].startswith("RuntimeError: "), results[0]["dead_rank"]


@pytest.mark.parametrize("ep_implementation", ["all_reduce", "all_to_all"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_transformers_expert_parallelism(pair, ep_implementation, backend):
    """transformers' apply_expert_parallelism with moe_torch:<backend> experts: logits equal the single-process
    model's. all_reduce hands the experts sentinel ids (== the local num_experts): they must arrive as -1."""
    tol = SPEC.tolerance_for("float32")
    label = f"hf/{ep_implementation}/{backend}"
    for res in pair:
        assert res[f"{label}/logits"] <= tol
        assert res[f"{label}/finite"] is True
        assert res[f"{label}/local_experts"] == 4
        assert res[f"{label}/sentinels_seen_as_empty"] is (ep_implementation == "all_reduce")


# ------------------------------------------------------------------------------------------- in this process

def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        ExpertParallel(moe_torch.Experts(2, 4, 2))


@pytest.fixture
def group_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_group_of_one_sends_only_routed_slots(group_of_one, monkeypatch):
    torch.manual_seed(0)
    full = moe_torch.Experts(4, 8, 4, bias=True)
    with pytest.raises(ValueError, match="experts: expected a moe_torch.Experts module, got Linear"):
        ExpertParallel(torch.nn.Linear(2, 2))
    ep = ExpertParallel(full)
    assert (ep.num_experts, ep.num_local_experts, ep.first_expert) == (4, 4, 0)
    sizes = []
    original = dist.all_to_all_single

    def spy(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        sizes.append((output_split_sizes, input_split_sizes))
        return original(output, input, output_split_sizes, input_split_sizes, **kw)

    monkeypatch.setattr(dist, "all_to_all_single", spy)
    x = torch.randn(5, 8, requires_grad=True)
    idx = torch.tensor([[0, -1], [3, 1], [-1, -1], [2, 2], [1, -1]])
    w = torch.rand(5, 2, requires_grad=True)
    out = ep(x, idx, w)
    expected = full(x, idx, w)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    routed = int((idx >= 0).sum())
    assert sizes[1:] == [([routed], [routed]), ([routed], [routed])]  # counts first, then the two row exchanges
    out.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    expected.sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=0, atol=1e-6)
