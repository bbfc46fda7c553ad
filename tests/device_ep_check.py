"""Expert parallelism on GPUs (issue 12), both frameworks, one command (not collected by pytest):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python3 -m torch.distributed.run --nproc_per_node=N tests/device_ep_check.py [--out FILE]

N = 1 runs a one-GPU NCCL group and a one-device JAX mesh. torch: every rank runs moe_torch.ExpertParallel over
NCCL; JAX: rank 0, after the torch ranks have finished, runs moe_jax.parallel over a mesh of the N GPUs (one
process, XLA's NCCL collectives), with both transports (ragged_all_to_all, all_to_all).

- Parity: the scenarios of the CPU tests (tests/ep_workers.py: uniform, skewed onto one rank, T = 0 on one rank,
  a rank of -1 slots, capacity drops) on the GPUs, forward and gradients against the single-GPU result of the
  whole problem (the spec's tolerance).
- Throughput: tokens per second per GPU of the expert-parallel layer on N GPUs (E / N experts and ``--tokens``
  tokens on each) against one GPU running all E experts on the same ``--tokens``, forward and forward+backward,
  bfloat16, for ``--config`` (JAX with capacity_factor 2.0, its dropped slots recorded).

Rank 0 writes one JSON file (default tests/device_results/expert-parallel-<N>gpu.json) and prints a summary; the
exit code is 1 if any parity check failed.
"""

from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "false")):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
try:
    import moe_shared  # noqa: F401
except ImportError:  # a plain checkout, not pip-installed: moe_shared is the shared/ folder
    import shared as _shared

    sys.modules["moe_shared"] = _shared

import ep_workers  # noqa: E402
from moe_shared import load_spec  # noqa: E402

SPEC = load_spec()
CONFIGS = {  # H, I, E, k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "tiny": (256, 128, 16, 2),
}


def _record(results: dict, name: str, fn) -> None:
    try:
        results[name] = fn()
    except Exception as err:  # recorded, not raised: one run collects every outcome
        results[name] = {"error": ep_workers.error_text(err)[:800], "trace": traceback.format_exc()[-1500:]}


def _routing(rng, T, E, k):
    logits = rng.standard_normal((T, E)).astype(np.float32)
    idx = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
    top = np.take_along_axis(logits, idx, 1)
    w = np.exp(top) / np.exp(top).sum(1, keepdims=True)
    return idx, w.astype(np.float32)


def _weights(rng, E, H, I):
    return ((rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32),
            (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32))


# ------------------------------------------------------------------------------------------------------ torch

def _timed_torch(sync, step, iters, barrier=None):
    for _ in range(2):
        step()
    sync()
    times = []
    for _ in range(iters):
        if barrier is not None:
            barrier()
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def torch_part(args, rank, world_size) -> dict:
    import torch
    import torch.distributed as dist

    import moe_torch
    from moe_torch.parallel import ExpertParallel

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results: dict = {}
    available = moe_torch.available_backends(device.type)
    backends = [n for n in SPEC.backend_names("torch") if available.get(n) is None  # float32 training parity
                and SPEC.backends[n].frameworks["torch"].training
                and "float32" in SPEC.backends[n].frameworks["torch"].dtypes]
    for backend in backends:
        for case in ("uniform", "skewed", "no_tokens", "all_empty"):
            _record(results, f"parity/{case}/{backend}", lambda: ep_workers._torch_parity(
                results, f"{case}/{backend}", rank, world_size, case, backend, device=device))
    _record(results, "parity/bfloat16/grouped_mm", lambda: ep_workers._torch_parity(
        results, "bfloat16/grouped_mm", rank, world_size, "uniform", "grouped_mm", dtype="bfloat16",
        device=device))

    H, I, E, k = CONFIGS[args.config]
    T = args.tokens
    rng = np.random.default_rng(1000 + rank)
    idx, w = _routing(rng, T, E, k)
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(device, torch.bfloat16)
    idx, w = torch.from_numpy(idx).to(device), torch.from_numpy(w).to(device, torch.bfloat16)
    dy = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    share = E // world_size
    gate_up, down = (torch.from_numpy(a).to(device, torch.bfloat16)
                     for a in _weights(np.random.default_rng(7), E, H, I))

    def step(module, mode):
        def fwd():
            with torch.no_grad():
                module(x, idx, w)

        def fwd_bwd():
            module(x.detach().requires_grad_(), idx, w).backward(dy)
            module.zero_grad(set_to_none=True)
        return fwd if mode == "fwd" else fwd_bwd

    local = moe_torch.Experts(share, H, I, dtype=torch.bfloat16, device=device)
    whole = moe_torch.Experts(E, H, I, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        local.gate_up_proj.copy_(gate_up[rank * share:(rank + 1) * share])
        local.down_proj.copy_(down[rank * share:(rank + 1) * share])
        whole.gate_up_proj.copy_(gate_up)
        whole.down_proj.copy_(down)
    ep = ExpertParallel(local, num_experts=E)
    for mode in ("fwd", "fwd+bwd"):
        def measure(mode=mode):
            return {"ep_ms": _timed_torch(sync, step(ep, mode), args.iters, dist.barrier),
                    "one_gpu_ms": _timed_torch(sync, step(whole, mode), args.iters)}
        _record(results, f"throughput/{mode}", measure)
    return results


def _summarize_torch(per_rank: list[dict], world_size: int, tokens: int) -> dict:
    tol = SPEC.tolerance_for("float32")
    summary = {"parity_failures": [], "throughput": {}}
    for rank, res in enumerate(per_rank):
        for key, value in res.items():
            if key.startswith("parity/") and isinstance(value, dict) and "error" in value:
                summary["parity_failures"].append(f"rank {rank}: {key}: {value['error']}")
            elif key.startswith("parity/") or key.startswith("throughput/") or key.endswith("/implementation"):
                continue
            elif isinstance(value, float):
                limit = SPEC.tolerance_for("bfloat16") if key.startswith("bfloat16/") else tol
                if not value <= limit:
                    summary["parity_failures"].append(f"rank {rank}: {key}: {value:.3e} > {limit:.0e}")
    for mode in ("fwd", "fwd+bwd"):
        rows = [res.get(f"throughput/{mode}") for res in per_rank]
        if any(r is None or "error" in r for r in rows):
            summary["throughput"][mode] = [r for r in rows if r is None or "error" in r][:1]
            continue
        ep_ms = max(r["ep_ms"] for r in rows)  # the slowest rank sets the step
        one_ms = statistics.median(r["one_gpu_ms"] for r in rows)
        summary["throughput"][mode] = {
            "ep_ms_slowest_rank": ep_ms, "one_gpu_ms": one_ms,
            "tokens_per_s_per_gpu": tokens / ep_ms * 1e3, "one_gpu_tokens_per_s": tokens / one_ms * 1e3,
            "per_gpu_vs_one_gpu": one_ms / ep_ms, "world_size": world_size}
    return summary


# ------------------------------------------------------------------------------------------------------ JAX

def jax_part(args, world_size) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import moe_jax
    from moe_jax import parallel

    results: dict = {"devices": [str(d) for d in jax.devices()]}
    mesh = jax.make_mesh((world_size,), ("expert",), devices=jax.devices()[:world_size])
    for transport in ("ragged_all_to_all", "all_to_all"):
        for case in ("uniform", "skewed", "all_empty", "no_tokens"):
            for backend in ("grouped_mm", "batched_mm"):
                label = f"{transport}/{case}/{backend}"
                _record(results, f"parity/{label}", lambda: ep_workers._jax_parity(
                    results, label, mesh, case, backend, transport=transport))
        label = f"{transport}/crowded/capacity"
        _record(results, f"parity/{label}", lambda: ep_workers._jax_parity(
            results, label, mesh, "crowded", "batched_mm", capacity_factor=1.0, transport=transport))

    H, I, E, k = CONFIGS[args.config]
    T = args.tokens
    rng = np.random.default_rng(5)
    idx, w = _routing(rng, world_size * T, E, k)
    x = rng.standard_normal((world_size * T, H)).astype(np.float32)
    gate_up, down = _weights(np.random.default_rng(7), E, H, I)
    dy = rng.standard_normal((world_size * T, H)).astype(np.float32)
    bf16 = jnp.bfloat16
    on_mesh = lambda a, dtype=None: jax.device_put(a if dtype is None else a.astype(dtype),
                                                   NamedSharding(mesh, PartitionSpec("expert")))
    one = jax.devices()[0]
    on_one = lambda a, dtype=None: jax.device_put(a if dtype is None else a.astype(dtype), one)
    sharded = [on_mesh(x, bf16), on_mesh(idx), on_mesh(w, bf16), on_mesh(gate_up, bf16), on_mesh(down, bf16),
               on_mesh(dy, bf16)]
    single = [on_one(x[:T], bf16), on_one(idx[:T]), on_one(w[:T], bf16), on_one(gate_up, bf16),
              on_one(down, bf16), on_one(dy[:T], bf16)]

    for transport in ("ragged_all_to_all", "all_to_all"):
        ep = partial(parallel.experts_forward, mesh=mesh, implementation="grouped_mm", capacity_factor=2.0,
                     transport=transport)
        one_gpu = lambda *a: (moe_jax.experts_forward(*a, implementation="grouped_mm"), jnp.int32(0))
        for mode in ("fwd", "fwd+bwd"):
            def measure(mode=mode, ep=ep):
                out = {}
                for name, fn, arrays in (("ep", ep, sharded), ("one_gpu", one_gpu, single)):
                    step = _jax_step(jax, jnp, fn, mode)
                    dropped = _timed_jax(jax, step, arrays, args.iters, out, name)
                    if name == "ep":
                        out["dropped_slots"] = int(dropped)
                out["tokens_per_s_per_gpu"] = T / out["ep_ms"] * 1e3
                out["per_gpu_vs_one_gpu"] = out["one_gpu_ms"] / out["ep_ms"]
                return out
            _record(results, f"throughput/{transport}/{mode}", measure)
    return results


def _jax_step(jax, jnp, fn, mode):
    if mode == "fwd":
        return jax.jit(lambda x, i, w, g, d, dy: fn(x, i, w, g, d))  # (out, dropped): out keeps the work

    def loss(x, w, g, d, i, dy):
        out, dropped = fn(x, i, w, g, d)
        return jnp.sum(out.astype(jnp.float32) * dy), dropped

    grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    return jax.jit(lambda x, i, w, g, d, dy: grad(x, w, g, d, i, dy))


def _timed_jax(jax, step, arrays, iters, out, name):
    result = None
    for _ in range(2):
        result = jax.block_until_ready(step(*arrays))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        result = jax.block_until_ready(step(*arrays))
        times.append((time.perf_counter() - start) * 1e3)
    out[f"{name}_ms"] = statistics.median(times)
    return result if not isinstance(result, tuple) else result[1]


def _summarize_jax(res: dict) -> dict:
    tol = SPEC.tolerance_for("float32")
    failures = []
    for key, value in res.items():
        if key.startswith("parity/") and isinstance(value, dict) and "error" in value:
            failures.append(f"{key}: {value['error']}")
        elif key.endswith("/dropped") and value != res.get(key.replace("/dropped", "/predicted_dropped"), 0):
            predicted = res.get(key.replace("/dropped", "/predicted_dropped"), 0)
            failures.append(f"{key}: {value} dropped, predicted {predicted}")
        elif isinstance(value, float) and not key.startswith("throughput/") and not value <= tol:
            failures.append(f"{key}: {value:.3e} > {tol:.0e}")
    return {"parity_failures": failures,
            "throughput": {k: v for k, v in res.items() if k.startswith("throughput/")}}


# ------------------------------------------------------------------------------------------------------ main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per GPU for the throughput")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a dry run of this script with gloo (and XLA_FLAGS host devices for JAX)")
    args = parser.parse_args()
    frameworks = set(args.frameworks.split(","))

    import torch
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {"world_size": world_size, "device": device_name, "torch": torch.__version__,
              "config": args.config, "tokens_per_gpu": args.tokens, "env": {
                  n: os.environ.get(n) for n in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                 "NVSHMEM_DISABLE_NVLS")}}
    per_rank = torch_part(args, rank, world_size) if "torch" in frameworks else {}
    gathered = [None] * world_size
    dist.gather_object(per_rank, gathered if rank == 0 else None, dst=0)
    dist.destroy_process_group()
    if rank != 0:
        return 0
    failures = []
    if "torch" in frameworks:
        report["torch_ranks"] = gathered
        report["torch_summary"] = _summarize_torch(gathered, world_size, args.tokens)
        failures += report["torch_summary"]["parity_failures"]
    if "jax" in frameworks:
        if args.device == "cuda":
            torch.cuda.empty_cache()
        import jax

        report["jax"] = jax_part(args, world_size)
        report["jax_version"] = jax.__version__
        report["jax_summary"] = _summarize_jax(report["jax"])
        failures += report["jax_summary"]["parity_failures"]
    out = args.out or ROOT / "tests" / "device_results" / f"expert-parallel-{world_size}gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({"parity_failures": failures,
                      "torch": report.get("torch_summary", {}).get("throughput"),
                      "jax": report.get("jax_summary", {}).get("throughput")}, indent=1, default=str))
    print(f"wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
