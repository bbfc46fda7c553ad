"""Worker processes of the expert-parallel tests, and the launchers the tests call.

    python tests/ep_workers.py torch <suite> <rank> <world_size> <store file> <result file>
    python tests/ep_workers.py jax <suite> <result file>      (XLA_FLAGS sets the host device count)

A worker runs its suite and writes one JSON object: check name -> value (a relative L2 error against the
single-device result, a count, or the "Type: message" of an error the suite provoked). The tests compare those
values with the spec's tolerance and the expected messages; a worker that dies or hangs fails the test through
the launcher (timeouts, exit codes, the tail of stderr).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from moe_shared import load_spec, relative_l2  # noqa: E402
from support import random_case  # noqa: E402

SPEC = load_spec()
H, I, K = 16, 8, 2


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


# ------------------------------------------------------------------------------------------------------ launchers

class WorkerFailure(AssertionError):
    pass


def _wait(procs: list[subprocess.Popen], logs: list, timeout: float, label: str) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            for q in procs:
                q.wait()
            tails = "\n".join(f"--- process {i}:\n{_tail(log)}" for i, log in enumerate(logs))
            raise WorkerFailure(f"{label}: the workers did not finish within {timeout:.0f} s\n{tails}") from None
    return codes


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-3000:]


def _results(files: list[Path], codes: list[int], logs: list, label: str, expect_exit: list[int] | None):
    expected = expect_exit or [0] * len(files)
    if codes != expected:
        tails = "\n".join(f"--- process {i} (exit {c}):\n{_tail(log)}" for i, (c, log) in enumerate(zip(codes, logs)))
        raise WorkerFailure(f"{label}: exit codes {codes}, expected {expected}\n{tails}")
    return [json.loads(f.read_text()) if f.exists() else None for f in files]


def run_torch(suite: str, world_size: int, *, timeout: float = 90, expect_exit: list[int] | None = None):
    """Run a torch suite on ``world_size`` gloo processes; per-rank result dicts (None where none was written)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = [tmp / f"rank{r}.json" for r in range(world_size)]
        logs = [tempfile.TemporaryFile("w+") for _ in range(world_size)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs = [subprocess.Popen([sys.executable, __file__, "torch", suite, str(r), str(world_size),
                                   str(tmp / "store"), str(files[r])], stdout=logs[r], stderr=subprocess.STDOUT,
                                  env=env, cwd=ROOT) for r in range(world_size)]
        codes = _wait(procs, logs, timeout, f"torch {suite} on {world_size} ranks")
        return _results(files, codes, logs, f"torch {suite} on {world_size} ranks", expect_exit)


def run_jax(suites: list[str], *, devices: int = 4, timeout: float = 150) -> dict[str, dict]:
    """Run JAX suites, each in its own process (concurrently) with ``devices`` host devices; suite -> results."""
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(tmp) / f"{s}.json" for s in suites]
        logs = [tempfile.TemporaryFile("w+") for _ in suites]
        # Compilation dominates these tiny programs: LLVM's optimisation level 0 compiles them in about 2/3 of the time.
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                                         "--xla_backend_optimization_level=0",
                   JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        procs = [subprocess.Popen([sys.executable, __file__, "jax", s, str(f)], stdout=log, stderr=subprocess.STDOUT,
                                  env=env, cwd=ROOT) for s, f, log in zip(suites, files, logs)]
        codes = _wait(procs, logs, timeout, f"jax {suites}")
        return dict(zip(suites, _results(files, codes, logs, f"jax {suites}", None)))


# ------------------------------------------------------------------------------------------------------ problems

def rank_problem(case: str, rank: int, world_size: int, E: int, *, bias: bool = True):
    """The tokens of ``rank`` in scenario ``case`` (float64 NumPy): inputs and the output gradient."""
    T = 3 + 2 * rank
    if case == "no_tokens" and rank == world_size - 1:
        T = 0
    arrays, dy = random_case(100 * world_size + 10 * rank + len(case), T=T, H=H, I=I, E=E, k=K, bias=bias,
                             empty_fraction=0.25)
    idx = arrays["top_k_index"]
    if case == "skewed":  # every slot on every rank goes to rank 0's experts
        idx[:] = np.where(idx >= 0, idx % (E // world_size), -1)
        idx[:, 1] = np.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % (E // world_size), idx[:, 1])
    if case == "all_empty" and rank == 1:
        idx[:] = -1
    return arrays, dy


# ------------------------------------------------------------------------------------------------------ torch

def torch_main(suite: str, rank: int, world_size: int, store: str, out_file: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    results: dict = {}
    try:
        TORCH_SUITES[suite](rank, world_size, results)
    finally:
        Path(out_file).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _torch_tools():
    import torch

    import moe_torch
    from moe_torch.parallel import ExpertParallel

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    return torch, moe_torch, ExpertParallel, dtypes


def _torch_parity(results, label, rank, world_size, case, backend, *, dtype="float32", bias=True,
                  activation="silu", local=False, device="cpu"):
    """EP forward and gradients on this rank's tokens vs one process running every rank's tokens."""
    torch, moe_torch, ExpertParallel, dtypes = _torch_tools()
    from torch import nn

    E = 2 * world_size
    torch.manual_seed(0)
    full = moe_torch.Experts(E, H, I, activation=activation, bias=bias, experts_implementation=backend,
                             dtype=dtypes[dtype]).to(device)
    problems = [rank_problem(case, r, world_size, E, bias=bias) for r in range(world_size)]
    as_t = lambda a, name: torch.from_numpy(a).to(device) if name == "top_k_index" else \
        torch.from_numpy(a).to(device, dtypes[dtype])
    inputs = [{n: as_t(a[n], n) for n in ("hidden_states", "top_k_index", "top_k_weights")} for a, _ in problems]
    grads_out = [torch.from_numpy(dy).to(device, dtypes[dtype]) for _, dy in problems]

    if local:
        share = E // world_size
        shard = moe_torch.Experts(share, H, I, activation=activation, bias=bias, experts_implementation=backend,
                                  dtype=dtypes[dtype], device=device)
        with torch.no_grad():
            for name, p in shard.named_parameters():
                p.copy_(getattr(full, name)[rank * share:(rank + 1) * share])
        model = nn.ModuleDict({"moe": ExpertParallel(shard, num_experts=E)})
    else:
        model = nn.ModuleDict({"moe": ExpertParallel(full)})
    moe_torch.set_experts_implementation(model, backend)
    results[f"{label}/implementation"] = moe_torch.get_experts_implementation(model)

    mine = {n: t.clone().requires_grad_(n != "top_k_index") for n, t in inputs[rank].items()}
    with moe_torch.decode_mode(model):
        out = model["moe"](mine["hidden_states"], mine["top_k_index"], mine["top_k_weights"])
    (out.float() * grads_out[rank].float()).sum().backward()

    whole = {n: torch.cat([i[n] for i in inputs]).requires_grad_(n != "top_k_index") for n in inputs[0]}
    ref = full(whole["hidden_states"], whole["top_k_index"], whole["top_k_weights"])
    (ref.float() * torch.cat(grads_out).float()).sum().backward()

    lo = sum(i["hidden_states"].shape[0] for i in inputs[:rank])
    rows = slice(lo, lo + inputs[rank]["hidden_states"].shape[0])
    ep = model["moe"]
    experts = slice(ep.first_expert, ep.first_expert + ep.num_local_experts)
    err = lambda a, b: relative_l2(a.detach().double().cpu().numpy(), b.detach().double().cpu().numpy())
    results[f"{label}/out"] = err(out, ref[rows])
    grad = lambda t: t.grad if t.grad is not None else torch.zeros_like(t)  # none when no rank has tokens
    for n in ("hidden_states", "top_k_weights"):
        results[f"{label}/grad_{n}"] = err(grad(mine[n]), grad(whole[n])[rows])
    for n, p in ep.experts.named_parameters():
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        results[f"{label}/grad_{n}"] = err(got, getattr(full, n).grad[experts])


def _torch_backends():
    import moe_torch

    available = moe_torch.available_backends("cpu")
    return [n for n in SPEC.backend_names("torch") if available.get(n) is None]


def torch_parity_suite(rank, world_size, results):
    for backend in _torch_backends():
        for case in ("uniform", "skewed", "no_tokens", "all_empty"):
            _torch_parity(results, f"{case}/{backend}", rank, world_size, case, backend)
    _torch_parity(results, "local_shard/grouped_mm", rank, world_size, "uniform", "grouped_mm", local=True)
    _torch_parity(results, "gelu_no_bias/grouped_mm", rank, world_size, "uniform", "grouped_mm",
                  activation="gelu", bias=False)
    _torch_parity(results, "bfloat16/grouped_mm", rank, world_size, "uniform", "grouped_mm", dtype="bfloat16")


def _provoke(results, name, fn):
    try:
        fn()
        results[name] = "no error"
    except Exception as err:  # noqa: BLE001 - the message is the result
        results[name] = error_text(err)


def torch_errors_suite(rank, world_size, results):
    torch, moe_torch, ExpertParallel, _ = _torch_tools()
    E = 2 * world_size
    _provoke(results, "indivisible",
             lambda: ExpertParallel(moe_torch.Experts(world_size + 1, H, I)))
    _provoke(results, "layout",
             lambda: ExpertParallel(moe_torch.Experts(E, H + 4 * (rank == 1), I)))
    # A shard made for twice as many ranks as the group has.
    _provoke(results, "world_size",
             lambda: ExpertParallel(moe_torch.Experts(1, H, I), num_experts=E))
    torch.manual_seed(0)
    ep = ExpertParallel(moe_torch.Experts(E, H, I))
    arrays, _ = rank_problem("uniform", rank, world_size, E)
    x, idx, w = (torch.from_numpy(arrays[n]) for n in ("hidden_states", "top_k_index", "top_k_weights"))
    x, w = x.float(), w.float()
    _provoke(results, "bad_dtype", lambda: ep(x, idx.float() if rank == 1 else idx, w))
    _provoke(results, "bad_ids", lambda: ep(x, torch.where(idx >= 0, idx, E) if rank == 0 else idx, w))
    # The group is still usable after the rejected calls.
    _torch_parity(results, "after_errors/grouped_mm", rank, world_size, "uniform", "grouped_mm")


def torch_dead_rank_suite(rank, world_size, results):
    import torch.distributed as dist

    torch, moe_torch, ExpertParallel, _ = _torch_tools()
    dist.barrier()  # both ranks are connected; then rank 1 dies
    if rank == 1:
        os._exit(3)
    _provoke(results, "dead_rank", lambda: ExpertParallel(moe_torch.Experts(2 * world_size, H, I)))
    if results["dead_rank"] != "no error":
        Path(sys.argv[-1]).write_text(json.dumps(results))
        os._exit(0)  # the group is broken: no barrier


# transformers' own expert parallelism (its AllReduceEP hands the experts sentinel ids == num_experts for the
# routes owned elsewhere; AllToAllEP sends each rank its slots) with moe_torch backends as the experts.
HF_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=100, num_local_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False)


def _hf_model(implementation):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("mixtral", **HF_CONFIG)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=implementation)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "has_gate", None), bool):
                for p in module.parameters(recurse=False):
                    p.normal_(0.0, 0.2)
    return model.eval()


def torch_transformers_suite(rank, world_size, results):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.utils import logging as hf_logging

    from moe_torch import ExpertsInterface
    from moe_torch.integrations import transformers as moe_hf

    hf_logging.set_verbosity_error()
    moe_hf.register("cpu")
    ep_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    no_tp = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("ep", "tp"))["tp"]
    for backend in _torch_backends():
        seen_empty = []
        original, capability = ExpertsInterface[backend], ExpertsInterface.capability(backend)

        def spy(hidden_states, top_k_index, *args, **kw):
            seen_empty.append(bool((top_k_index == SPEC.empty_slot).any()))
            return original(hidden_states, top_k_index, *args, **kw)

        ExpertsInterface.register(backend, spy, capability=capability)
        try:
            for ep_implementation, tp_mesh in (("all_reduce", ep_mesh), ("all_to_all", no_tp)):
                name = moe_hf.hf_name(backend)
                model = _hf_model(name)
                config = model.config
                plan = {f"model.{key.replace('*', str(layer))}": style
                        for key, style in config.base_model_ep_plan.items()
                        for layer in range(config.num_hidden_layers)}
                apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation=ep_implementation)
                shared_batch = ep_implementation == "all_reduce"
                ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(
                    1 if shared_batch else 1 + rank))
                seen_empty.clear()
                with torch.no_grad():
                    logits = model(ids).logits
                    expected = _hf_model(name)(ids).logits
                label = f"hf/{ep_implementation}/{backend}"
                results[f"{label}/logits"] = relative_l2(logits.double().numpy(), expected.double().numpy())
                results[f"{label}/finite"] = bool(torch.isfinite(logits).all())
                results[f"{label}/local_experts"] = model.model.layers[0].mlp.experts.num_experts
                results[f"{label}/sentinels_seen_as_empty"] = any(seen_empty[:config.num_hidden_layers])
        finally:
            ExpertsInterface.register(backend, original, capability=capability)


def torch_pair_suite(rank, world_size, results):
    torch_parity_suite(rank, world_size, results)
    torch_errors_suite(rank, world_size, results)
    torch_transformers_suite(rank, world_size, results)


def torch_quad_suite(rank, world_size, results):
    torch_parity_suite(rank, world_size, results)
    torch_errors_suite(rank, world_size, results)


TORCH_SUITES = {"pair": torch_pair_suite, "quad": torch_quad_suite, "dead_rank": torch_dead_rank_suite}


# ------------------------------------------------------------------------------------------------------ JAX

def _jax_problem(case: str, W: int, E: int, *, bias=True, seed=0):
    """Global arrays: W shards of T / W = 4 tokens each, routed per ``case``."""
    rng = np.random.default_rng(seed + len(case))
    T = 4 * W if case != "no_tokens" else 0
    arrays, dy = random_case(seed + 7 * W + len(case), T=T, H=H, I=I, E=E, k=K, bias=bias, empty_fraction=0.25)
    idx = arrays["top_k_index"]
    El = E // W
    if case == "skewed":  # every device sends every slot to device 0's experts
        idx[:] = np.where(idx >= 0, idx % El, -1)
        idx[:, 1] = np.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % El, idx[:, 1])
    if case == "all_empty":  # device 1 routes nothing
        idx[4:8] = -1
    if case == "crowded":  # most slots go to device 0: over a small capacity
        idx[:] = np.where(rng.random(idx.shape) < 0.7, idx % El, idx)
        idx[:, 1] = np.where(idx[:, 1] == idx[:, 0], -1, idx[:, 1])
    return arrays, dy


def predicted_drops(idx: np.ndarray, W: int, E: int, capacity: int) -> np.ndarray:
    """The documented capacity rule, on the host: per sending device, its valid slots sorted by expert (then slot);
    of those for each receiver, the ones past the first ``capacity`` are dropped. Returns a mask [T, k]."""
    T, k = idx.shape
    El, per = E // W, T // W
    dropped = np.zeros(idx.shape, bool)
    for d in range(W):
        flat = idx[d * per:(d + 1) * per].reshape(-1)
        valid = np.nonzero(flat >= 0)[0]
        order = valid[np.argsort(flat[valid], kind="stable")]
        mask = dropped[d * per:(d + 1) * per].reshape(-1)
        for r in range(W):
            to_r = order[flat[order] // El == r]
            mask[to_r[capacity:]] = True
    return dropped


def _jax_tools():
    import jax
    import jax.numpy as jnp

    import moe_jax
    from moe_jax import parallel

    return jax, jnp, moe_jax, parallel


DIFF = ("hidden_states", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias")


_RUNS: dict = {}  # one jitted program per configuration: the scenarios of one shape share its compilation


def _loss_and_grads(key, forward, arrays, dy):
    """out, dropped and the gradients of sum(out * dy) with respect to every float argument, in one jitted call."""
    jax, jnp, _, _ = _jax_tools()
    diff = {n: jnp.asarray(a, jnp.float32) for n, a in arrays.items() if n in DIFF}
    fixed = {n: jnp.asarray(a) for n, a in arrays.items() if n not in DIFF}

    if key not in _RUNS:
        def run(diff, fixed, dy):
            def loss(diff):
                out, dropped = forward(**diff, **fixed)
                return jnp.sum(out * dy), (out, dropped)

            (_, (out, dropped)), grads = jax.value_and_grad(loss, has_aux=True)(diff)
            return out, dropped, grads

        _RUNS[key] = jax.jit(run)
    return _RUNS[key](diff, fixed, jnp.asarray(dy, jnp.float32))


def _single_device(backend):
    _, jnp, moe_jax, _ = _jax_tools()
    return lambda **a: (moe_jax.experts_forward(**a, implementation=backend), jnp.int32(0))


def _jax_parity(results, label, mesh, case, backend, *, capacity_factor=None, transport=None, E=8):
    from functools import partial

    jax, jnp, moe_jax, parallel = _jax_tools()
    from moe_shared.parallel import slot_capacity

    W = mesh.shape["expert"]
    arrays, dy = _jax_problem(case, W, E)
    forward = partial(parallel.experts_forward, mesh=mesh, implementation=backend,
                      capacity_factor=capacity_factor, transport=transport)
    out, dropped, grads = _loss_and_grads((mesh, backend, capacity_factor, transport), forward, arrays, dy)
    expected_arrays = dict(arrays)
    T = arrays["top_k_index"].shape[0]
    if T:
        drops = predicted_drops(arrays["top_k_index"], W, E, slot_capacity(T // W * K, W, capacity_factor))
        expected_arrays["top_k_index"] = np.where(drops, -1, arrays["top_k_index"]).astype(np.int32)
        results[f"{label}/predicted_dropped"] = int(drops.sum())
    single = "grouped_mm" if backend == parallel.AUTO else backend  # auto is a switch of the module layer
    ref_out, _, ref_grads = _loss_and_grads(single, _single_device(single), expected_arrays, dy)
    results[f"{label}/dropped"] = int(dropped)
    results[f"{label}/out"] = relative_l2(np.asarray(out), np.asarray(ref_out))
    for n in grads:
        results[f"{label}/grad_{n}"] = relative_l2(np.asarray(grads[n]), np.asarray(ref_grads[n]))


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """jax.lax.ragged_all_to_all's documented semantics from all_gather (XLA:CPU lacks the op), so that the
    ragged transport's offsets and sizes are checked on CPU. Sizes that disagree between a sender and its receiver
    poison the result with NaN."""
    jax, jnp, _, _ = _jax_tools()
    from jax import lax

    me = lax.axis_index(axis_name)
    W = lax.axis_size(axis_name)
    operands = lax.all_gather(operand, axis_name)
    offsets_in = lax.all_gather(input_offsets, axis_name)  # [sender, receiver]
    sizes = lax.all_gather(send_sizes, axis_name)
    offsets_out = lax.all_gather(output_offsets, axis_name)
    rows = jnp.arange(output.shape[0])
    result = output
    for j in range(W):
        start, size = offsets_out[j, me], recv_sizes[j]
        inside = (rows >= start) & (rows < start + size)
        source = jnp.clip(offsets_in[j, me] + rows - start, 0, operand.shape[0] - 1)
        shape = (-1,) + (1,) * (output.ndim - 1)
        result = jnp.where(inside.reshape(shape), operands[j][source], result)
    consistent = jnp.all(sizes[:, me] == recv_sizes)
    return jnp.where(consistent, result, jnp.nan)


def _meshes():
    jax, _, _, _ = _jax_tools()
    explicit = jax.make_mesh((4,), ("expert",))  # Explicit axis type (jax.make_mesh's default)
    auto = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("expert",))  # Auto axis type
    return explicit, auto


def jax_mesh4_suite(results):
    four, _ = _meshes()
    for case in ("uniform", "skewed", "all_empty", "no_tokens"):
        _jax_parity(results, f"four/{case}/batched_mm", four, case, "batched_mm")
    for backend in ("grouped_mm", "ragged_dot"):
        _jax_parity(results, f"four/uniform/{backend}", four, "uniform", backend)


def jax_mesh2_suite(results):
    jax, jnp, moe_jax, parallel = _jax_tools()
    four, two = _meshes()
    for case in ("uniform", "skewed"):
        _jax_parity(results, f"two/{case}/batched_mm", two, case, "batched_mm")
    _jax_parity(results, "four/crowded/capacity", four, "crowded", "batched_mm", capacity_factor=1.0)
    parallel.ragged_all_to_all = emulated_ragged_all_to_all
    try:
        _jax_parity(results, "four/skewed/ragged", four, "skewed", "batched_mm", transport="ragged_all_to_all")
        _jax_parity(results, "four/crowded/ragged_capacity", four, "crowded", "batched_mm", capacity_factor=1.0,
                    transport="ragged_all_to_all")
    finally:
        parallel.ragged_all_to_all = jax.lax.ragged_all_to_all
    _jax_flax(results, four)
    _jax_errors(results, four)


def _jax_flax(results, mesh):
    jax, jnp, moe_jax, parallel = _jax_tools()
    from flax import nnx

    from moe_jax import convert, flax_moe

    arrays, dy = _jax_problem("crowded", 4, 8)
    x, idx, w = (jnp.asarray(arrays[n]) for n in ("hidden_states", "top_k_index", "top_k_weights"))
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    sharded = flax_moe.Experts(8, H, I, bias=True, backend="batched_mm", mesh=mesh, capacity_factor=1.0,
                               rngs=nnx.Rngs(0))
    plain = flax_moe.Experts(8, H, I, bias=True, backend="auto", rngs=nnx.Rngs(0))
    flax_moe.set_backend(sharded, "auto")  # backend switching is unchanged on a sharded module
    results["flax/backend"] = flax_moe.get_backend(sharded)
    spec = sharded.gate_up_proj.get_value().sharding.spec
    results["flax/param_spec"] = [str(s) for s in spec]
    shards = sharded.down_bias.get_value().addressable_shards
    results["flax/param_shard_rows"] = sorted({s.data.shape[0] for s in shards})
    loaded = flax_moe.Experts(8, H, I, bias=True, mesh=mesh, rngs=nnx.Rngs(1))
    convert.load_state_dict(loaded, convert.module_state_dict(plain))
    results["flax/param_spec_after_load"] = [str(s) for s in loaded.gate_up_proj.get_value().sharding.spec]
    results["flax/loaded_equal"] = bool(np.array_equal(np.asarray(loaded.down_proj.get_value()),
                                                       np.asarray(plain.down_proj.get_value())))

    @nnx.jit
    def step(model, x, idx, w, dy):
        def loss(model):
            out = model(x, idx, w)
            return jnp.sum(out * dy), out
        (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return out, grads

    from moe_shared.parallel import slot_capacity

    drops = predicted_drops(arrays["top_k_index"], 4, 8, slot_capacity(4 * K, 4, 1.0))
    kept_idx = jnp.asarray(np.where(drops, -1, arrays["top_k_index"]).astype(np.int32))
    dy = jnp.asarray(dy, jnp.float32)
    out, grads = step(sharded, x, idx, w, dy)
    step(sharded, x, idx, w, dy)
    ref_out, ref_grads = step(plain, x, kept_idx, w, dy)
    results["flax/out"] = relative_l2(np.asarray(out), np.asarray(ref_out))
    for n in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
        results[f"flax/grad_{n}"] = relative_l2(np.asarray(getattr(grads, n).get_value()),
                                               np.asarray(getattr(ref_grads, n).get_value()))
    results["flax/dropped_slots_after_two_calls"] = int(sharded.dropped_slots.get_value())
    results["flax/predicted_dropped"] = int(drops.sum())


def _jax_errors(results, mesh):
    jax, jnp, moe_jax, parallel = _jax_tools()
    from flax import nnx
    from jax.sharding import PartitionSpec

    from moe_jax import flax_moe

    arrays, _ = _jax_problem("uniform", 4, 8)
    args = [jnp.asarray(arrays[n]) for n in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj",
                                              "down_proj")]
    call = lambda *a, **kw: parallel.experts_forward(*a, **({"mesh": mesh} | kw))
    _provoke(results, "error/indivisible_experts", lambda: call(*args[:3], args[3][:6], args[4][:6]))
    _provoke(results, "error/indivisible_tokens", lambda: call(args[0][:6], args[1][:6], args[2][:6], *args[3:]))
    _provoke(results, "error/axis", lambda: call(*args, axis="experts"))
    _provoke(results, "error/capacity_factor", lambda: call(*args, capacity_factor=0.0))
    _provoke(results, "error/transport", lambda: call(*args, transport="nccl"))
    _provoke(results, "error/ids", lambda: call(args[0], args[1].at[0, 0].set(8), *args[2:]))
    _provoke(results, "error/flax_indivisible",
             lambda: flax_moe.Experts(6, H, I, mesh=mesh, rngs=nnx.Rngs(0)))

    def ragged_on_this_platform():
        def body(x):
            z = jnp.zeros_like(x)
            n = jnp.ones(4, jnp.int32)
            return jax.lax.ragged_all_to_all(x, z, jnp.arange(4, dtype=jnp.int32), n, jnp.full(4, 0, jnp.int32)
                                             + jax.lax.axis_index("expert"), n, axis_name="expert")
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("expert"),
                                  out_specs=PartitionSpec("expert")))
        x = jax.reshard(jnp.ones((16, 2)), jax.sharding.NamedSharding(mesh, PartitionSpec("expert")))
        jax.block_until_ready(f(x))

    _provoke(results, "platform/ragged_all_to_all", ragged_on_this_platform)
    results["platform/transport"] = parallel.TRANSPORTS[jax.default_backend()]


JAX_SUITES = {"mesh4": jax_mesh4_suite, "mesh2": jax_mesh2_suite}


def jax_main(suite: str, out_file: str) -> None:
    results: dict = {}
    try:
        JAX_SUITES[suite](results)
    except Exception:
        results["crash"] = traceback.format_exc()
        raise
    finally:
        Path(out_file).write_text(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1] == "torch":
        torch_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    else:
        jax_main(sys.argv[2], sys.argv[3])
