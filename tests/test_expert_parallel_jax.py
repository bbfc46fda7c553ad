"""moe_jax.parallel under jax.shard_map on 4 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4, in
subprocesses run by tests/ep_workers.py, so that this process keeps one device): forward and gradients under
jax.jit equal to one device, the capacity rule and its dropped-slot count, the ragged transport's offsets (through
an emulation of jax.lax.ragged_all_to_all, which XLA:CPU lacks), the sharded Flax module, and the errors."""

from __future__ import annotations

import numpy as np
import pytest

from ep_workers import predicted_drops, run_jax
from moe_shared.parallel import experts_per_rank, slot_capacity
from support import SPEC

DIFF = ["hidden_states", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias"]


@pytest.fixture(scope="module")
def jax_results():
    suites = run_jax(["mesh4", "mesh2"])
    return suites["mesh4"] | suites["mesh2"]


def assert_parity(results, label, *, dropped=0):
    tol = SPEC.tolerance_for("float32")
    assert "crash" not in results, results.get("crash")
    for check in ["out"] + [f"grad_{n}" for n in DIFF]:
        err = results[f"{label}/{check}"]
        assert err <= tol, f"{label} {check}: relative L2 error {err:.3e} > {tol:.0e}"
    assert results[f"{label}/dropped"] == dropped


@pytest.mark.parametrize("label", [
    "four/uniform/batched_mm", "four/skewed/batched_mm", "four/all_empty/batched_mm", "four/no_tokens/batched_mm",
    "four/uniform/grouped_mm", "four/uniform/ragged_dot", "two/uniform/batched_mm", "two/skewed/batched_mm",
])
def test_matches_one_device(jax_results, label):
    """four: an Explicit mesh of 4 devices; two: an Auto mesh of 2. skewed: every device routes everything to
    device 0's experts (the others receive nothing); all_empty: device 1 routes only -1 slots; no_tokens: T = 0."""
    assert_parity(jax_results, label)


@pytest.mark.parametrize("label", ["four/crowded/capacity", "four/crowded/ragged_capacity"])
def test_capacity_drops_are_counted_and_exact(jax_results, label):
    """capacity_factor=1.0 on a routing crowded onto device 0: the dropped count is the host-side rule's, and the
    result equals one device with exactly those slots emptied."""
    assert jax_results[f"{label}/predicted_dropped"] > 0
    assert_parity(jax_results, label, dropped=jax_results[f"{label}/predicted_dropped"])


def test_ragged_transport_offsets(jax_results):
    assert_parity(jax_results, "four/skewed/ragged")


def test_flax_module_sharded_on_experts(jax_results):
    tol = SPEC.tolerance_for("float32")
    assert jax_results["flax/param_spec"] == ["expert", "None", "None"]
    assert jax_results["flax/param_shard_rows"] == [2]  # 8 experts over 4 devices
    assert jax_results["flax/param_spec_after_load"] == ["expert", "None", "None"]  # convert.load_state_dict
    assert jax_results["flax/loaded_equal"] is True
    assert jax_results["flax/backend"] == {"": "auto"}
    for check in ("out", "grad_gate_up_proj", "grad_down_proj", "grad_gate_up_bias", "grad_down_bias"):
        assert jax_results[f"flax/{check}"] <= tol, check
    assert jax_results["flax/predicted_dropped"] > 0
    assert jax_results["flax/dropped_slots_after_two_calls"] == 2 * jax_results["flax/predicted_dropped"]


@pytest.mark.parametrize("name, message", [
    ("indivisible_experts", "ValueError: num_experts: expected a multiple of the world size 4 (the experts are split "
                            "evenly over the ranks), got 6"),
    ("indivisible_tokens", "ValueError: hidden_states: expected a number of tokens divisible by the size 4 of mesh "
                           "axis 'expert' (the tokens are split evenly over it), got T = 6"),
    ("axis", "ValueError: axis: expected one of the mesh axes ['expert'], got 'experts'"),
    ("capacity_factor", "ValueError: capacity_factor: expected None or a positive finite number, got 0.0"),
    ("transport", "ValueError: transport: expected one of ['all_to_all', 'ragged_all_to_all'] or None, got 'nccl'"),
    ("ids", "ValueError: top_k_index: expected expert ids in [-1, 8) (-1 = empty slot), got ids from -1 to 8"),
    ("flax_indivisible", "ValueError: num_experts: expected a multiple of the world size 4 (the experts are split "
                         "evenly over the ranks), got 6"),
])
def test_errors(jax_results, name, message):
    assert jax_results[f"error/{name}"] == message


def test_cpu_transport_is_all_to_all_because_xla_cpu_lacks_ragged(jax_results):
    """The fact behind TRANSPORTS["cpu"]: if a jaxlib gains ragged-all-to-all on CPU, this fails as a reminder."""
    assert jax_results["platform/transport"] == "all_to_all"
    assert jax_results["platform/ragged_all_to_all"].startswith("JaxRuntimeError: UNIMPLEMENTED")
    assert "ragged-all-to-all" in jax_results["platform/ragged_all_to_all"]


# ------------------------------------------------------------------------------------------- in this process

def test_capacity_rule():
    assert slot_capacity(12, 4) == 12
    assert slot_capacity(12, 4, 1.0) == 3
    assert slot_capacity(10, 4, 1.0) == 3
    assert slot_capacity(10, 4, 1.25) == 4
    assert slot_capacity(8, 2, 10.0) == 8
    assert slot_capacity(0, 4, 1.0) == 0
    for bad in (0, -1.0, float("inf"), "1", True):
        with pytest.raises(ValueError, match="capacity_factor: expected None or a positive finite number"):
            slot_capacity(8, 2, bad)


def test_even_split():
    assert experts_per_rank(8, 4) == 2
    with pytest.raises(ValueError, match="num_experts: expected a multiple of the world size 3"):
        experts_per_rank(8, 3)
    with pytest.raises(ValueError, match="world_size: expected a positive int"):
        experts_per_rank(8, 0)


def test_predicted_drops_follow_expert_then_slot_order():
    """The host-side rule the workers compare with: 2 devices, 2 experts each, capacity 2."""
    idx = np.array([[1, 0], [0, 3], [-1, 2], [1, 2]])  # device 0: tokens 0, 1; device 1: tokens 2, 3
    dropped = predicted_drops(idx, 2, 4, 2)
    # device 0 sends to device 0: slots (0,1)=e0, (1,0)=e0, (0,0)=e1 -> the e1 slot is third and dropped.
    assert dropped.tolist() == [[True, False], [False, False], [False, False], [False, False]]
