"""Backends ``deepgemm`` (torch, JAX) and ``deepgemm_megamoe`` (torch) on CPU: the contiguous layout in both
frameworks against the NumPy reference, every requirement error with the GPU absent or faked, and the whole
forward in both frameworks with a fake ``deep_gemm`` whose grouped GEMM is a per-expert torch matmul that fills
padding rows with NaN (so any read of them would reach the output). On the GPU: tests/device_deepgemm_check.py.
"""

from __future__ import annotations

import stat
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import moe_jax
import moe_torch
from moe_jax.backends import deepgemm as jax_deepgemm
from moe_shared import reference, registry, relative_l2, requirements
from moe_shared.contiguous_layout import contiguous_layout, padded_rows
from moe_torch import base as torch_base
from moe_torch.backends import deepgemm as torch_deepgemm
from moe_torch.backends import deepgemm_megamoe
from support import CASES, SPEC, case_id, padded_arrays, random_case

SUPPORT = SPEC.backends["deepgemm"].support("torch")
REQUIRES = SUPPORT.requires
ALIGNMENT = SUPPORT.details["layout"]["group_alignment"]


def to_torch(arrays, dtype=torch.bfloat16, requires_grad=False):
    return {n: torch.from_numpy(np.ascontiguousarray(a)) if n == "top_k_index" else
            torch.from_numpy(np.ascontiguousarray(a)).to(dtype).requires_grad_(requires_grad)
            for n, a in arrays.items()}


def to_jax(arrays, dtype=jnp.bfloat16):
    return {n: jnp.asarray(a) if n == "top_k_index" else jnp.asarray(a).astype(dtype) for n, a in arrays.items()}


# --- the layout ---------------------------------------------------------------------------------------------------

def _ids(seed, T, k, E, empty=0.2, stray=0.05):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, E, size=(T, k))
    ids[:, 0] = np.where(rng.random(T) < 0.5, E // 2, ids[:, 0])  # skewed towards one expert
    ids[rng.random((T, k)) < empty] = -1
    strays = rng.random((T, k)) < stray
    ids[strays] = rng.choice([-7, E, E + 3], size=int(strays.sum()))
    return ids


LAYOUT_CASES = [(0, 1, 1, 4, 4), (1, 1, 8, 256, 128), (2, 37, 3, 5, 4), (3, 300, 2, 8, 128), (4, 64, 8, 16, 8),
                (5, 0, 2, 4, 128), (6, 20, 2, 3, 1), (7, 130, 1, 1, 128)]
LAYOUT_IDS = [f"T{T}-k{k}-E{E}-align{a}" for _, T, k, E, a in LAYOUT_CASES]


@pytest.mark.parametrize("seed, T, k, E, alignment", LAYOUT_CASES, ids=LAYOUT_IDS)
def test_reference_layout_is_sorted_aligned_padded_and_inverts(seed, T, k, E, alignment):
    ids = _ids(seed, T, k, E)
    layout = contiguous_layout(ids, E, alignment)
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    M = padded_rows(flat.size, E, alignment)
    assert layout.grouped_layout.shape == (M,) and layout.grouped_layout.dtype == np.int32
    assert np.all(layout.starts % alignment == 0)
    np.testing.assert_array_equal(layout.slot_rows[~valid], M)  # empty slots get no row
    rows = layout.slot_rows[valid]
    assert len(set(rows.tolist())) == rows.size  # one row per slot
    np.testing.assert_array_equal(layout.grouped_layout[rows], flat[valid])  # the inverse map
    assert np.sum(layout.grouped_layout >= 0) == valid.sum()  # every other row is padding (-1)
    for e in range(E):
        mine = layout.slot_rows[valid & (flat == e)]  # in slot order
        np.testing.assert_array_equal(mine, layout.starts[e] + np.arange(mine.size))  # sorted, stable, contiguous


@pytest.mark.parametrize("E, alignment", [(8, 128), (256, 128), (5, 4), (3, 1)])
def test_padded_rows_bound_every_routing(E, alignment):
    for S in (0, 1, 7, 64, 300, 2048):
        for counts in (np.bincount(np.arange(S) % E, minlength=E), np.eye(E, dtype=int)[0] * S,
                       np.bincount(np.minimum(np.arange(S), E - 1), minlength=E)):  # one slot each, rest on one
            used = int(np.sum(-(-counts // alignment) * alignment))
            assert used <= padded_rows(S, E, alignment), (S, counts)


@pytest.mark.parametrize("seed, T, k, E, alignment", LAYOUT_CASES, ids=LAYOUT_IDS)
def test_torch_layout_matches_the_reference(seed, T, k, E, alignment):
    ids = _ids(seed, T, k, E)
    want = contiguous_layout(ids, E, alignment)
    for dtype in (torch.int32, torch.int64):
        got = torch_deepgemm.Layout(torch.from_numpy(ids).to(dtype), E, alignment)
        assert got.rows == want.grouped_layout.size and got.grouped_layout.dtype == torch.int32
        np.testing.assert_array_equal(got.grouped_layout.numpy(), want.grouped_layout)
        np.testing.assert_array_equal(got.slot_rows.numpy(), want.slot_rows)
        np.testing.assert_array_equal(got.starts.numpy(), want.starts)


@pytest.mark.parametrize("seed, T, k, E, alignment", LAYOUT_CASES, ids=LAYOUT_IDS)
def test_jax_layout_matches_the_reference(seed, T, k, E, alignment):
    ids = _ids(seed, T, k, E)
    want = contiguous_layout(ids, E, alignment)
    for dtype in (jnp.int32, np.int64):
        got = jax.jit(lambda i: (lambda g: (g.slot_rows, g.grouped_layout, g.starts))(
            jax_deepgemm.Layout(i, E, alignment)))(np.asarray(ids, dtype))
        assert got[1].dtype == jnp.int32
        for name, ours, theirs in zip(("slot_rows", "grouped_layout", "starts"), got, want):
            np.testing.assert_array_equal(np.asarray(ours), theirs, err_msg=name)


def test_torch_layout_traces_fullgraph_without_host_sync():
    ids = torch.from_numpy(_ids(8, 50, 4, 6))
    compiled = torch.compile(lambda i: torch_deepgemm.Layout(i, 6, 8).grouped_layout, fullgraph=True,
                             backend="aot_eager")
    np.testing.assert_array_equal(compiled(ids).numpy(), contiguous_layout(ids.numpy(), 6, 8).grouped_layout)


# --- a fake deep_gemm ---------------------------------------------------------------------------------------------

class FakeDeepGEMM(types.ModuleType):
    """deep_gemm's m-grouped bf16 GEMMs as per-expert torch matmuls, checking what DeepGEMM needs of its inputs;
    padding rows (-1) of the output are NaN."""

    def __init__(self, alignment=128):
        super().__init__("deep_gemm")
        self.alignment = alignment
        self.calls = []

    def get_mk_alignment_for_contiguous_layout(self):
        return self.alignment

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, grouped_layout, **kwargs):
        self._run("nt", a, b, d, grouped_layout)

    def m_grouped_bf16_gemm_nn_contiguous(self, a, b, d, grouped_layout, **kwargs):
        assert b.is_contiguous()  # [E, K, N] row-major: N-major weights in place
        self._run("nn", a, b.mT, d, grouped_layout)

    def _run(self, kind, a, w, d, layout):
        M, K = a.shape
        assert a.dtype == w.dtype == d.dtype == torch.bfloat16 and layout.dtype == torch.int32
        assert a.is_contiguous() and d.is_contiguous() and layout.shape == (M,) and d.shape == (M, w.shape[1])
        assert K % 64 == 0 and M % self.alignment == 0
        group_start = (layout >= 0) & torch.cat([torch.ones(1, dtype=torch.bool), layout[1:] != layout[:-1]])
        assert torch.all(torch.nonzero(group_start).flatten() % self.alignment == 0)
        self.calls.append((kind, tuple(a.shape), tuple(w.shape)))
        d.fill_(float("nan"))
        for e in range(w.shape[0]):
            rows = layout == e
            d[rows] = (a[rows].float() @ w[e].float().T).to(d.dtype)


@pytest.fixture
def fake(monkeypatch):
    module = FakeDeepGEMM()
    monkeypatch.setattr(torch_deepgemm, "runtime", lambda device: module)
    monkeypatch.setattr(jax_deepgemm, "runtime", lambda platform: module)
    return module


def torch_forward(arrays, activation="silu", **weights):
    with torch.no_grad():
        return torch_deepgemm.experts_forward(**(to_torch(arrays) | weights), activation=activation)


def jax_forward(arrays, activation="silu"):
    return jax.jit(lambda v: jax_deepgemm.experts_forward(**v, activation=activation))(to_jax(arrays))


RANDOM = [dict(T=0, k=2, E=4), dict(T=1, k=2, E=8), dict(T=37, k=3, E=5), dict(T=300, k=2, E=8),
          dict(T=64, k=8, E=16), dict(T=20, k=1, E=3)]


@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
@pytest.mark.parametrize("shape", RANDOM, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_forward_matches_reference_in_both_frameworks(fake, shape, activation):
    arrays, _ = random_case(shape["T"] * 7 + len(activation), H=128, I=64, bias=shape["T"] % 2 == 0,
                            empty_fraction=0.15, **shape)
    arrays["top_k_index"][::7, 0] = shape["E"] + 2  # unchecked out-of-range ids: empty slots
    cleaned = dict(arrays, top_k_index=np.where(arrays["top_k_index"] >= shape["E"], -1, arrays["top_k_index"]))
    expected = reference.experts_forward(**cleaned, activation=activation)
    ours = torch_forward(arrays, activation)
    theirs = jax_forward(arrays, activation)
    tol = SPEC.tolerance_for("bfloat16")
    assert ours.dtype == torch.bfloat16 and theirs.dtype == jnp.bfloat16
    assert relative_l2(ours.double().numpy(), expected) <= tol
    assert relative_l2(np.asarray(theirs.astype(jnp.float32), np.float64), expected) <= tol
    np.testing.assert_array_equal(np.asarray(theirs.astype(jnp.float32)), ours.float().numpy())  # same bits
    rows = padded_rows(shape["T"] * shape["k"], shape["E"], ALIGNMENT)
    assert all(call[1][0] == rows for call in fake.calls)  # a static upper bound: no host sync


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "bfloat16"], ids=case_id)
def test_shared_vectors(fake, case):
    """No bf16 vector has H and I multiples of 64: each raises ValueError naming the argument; zero-padded to
    multiples of 64 (the same problem) it matches the vector's expected output in both frameworks."""
    E, H, I = case.inputs["down_proj"].shape
    arg = "gate_up_proj" if H % 64 else "down_proj"
    if H % 64 or I % 64:
        with pytest.raises(ValueError, match=rf"{arg}: expected [HI] a multiple of 64 for implementation 'deepgemm'"):
            torch_forward(case.inputs, case.activation)
        with pytest.raises(ValueError, match=rf"{arg}: expected [HI] a multiple of 64 for implementation 'deepgemm'"):
            jax_forward(case.inputs, case.activation)
    padded = padded_arrays(case.inputs, 64)
    ours = torch_forward(padded, case.activation).double().numpy()[:, :H]
    theirs = np.asarray(jax_forward(padded, case.activation).astype(jnp.float32), np.float64)[:, :H]
    assert relative_l2(ours, case.expected["out"]) <= SPEC.tolerance_for("bfloat16")
    np.testing.assert_array_equal(theirs, ours)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vectorized", [True, False], ids=["one-sum", "k-steps"])
def test_empty_slots_are_zero_whatever_the_extra_row_holds(fake, monkeypatch, bias, vectorized):
    """Empty and out-of-range slots read the GEMMs' extra last row, undefined as DeepGEMM leaves it (NaN here):
    the output is still the reference's, in both combine forms."""
    gemm = torch_deepgemm.deepgemm_grouped_gemm

    def undefined_extra_row(a, w, grouped_layout):
        d = gemm(a, w, grouped_layout)
        d[-1] = float("nan")
        return d

    monkeypatch.setattr(torch_deepgemm, "deepgemm_grouped_gemm", undefined_extra_row)
    if not vectorized:
        monkeypatch.setitem(torch_base.VECTORIZED_COMBINE_MAX, "cpu", 0)
    arrays, _ = random_case(21, T=33, H=64, I=64, E=5, k=3, bias=bias, empty_fraction=0.3)
    arrays["top_k_index"][::5, 1] = 7  # unchecked out of range
    cleaned = dict(arrays, top_k_index=np.where(arrays["top_k_index"] >= 5, -1, arrays["top_k_index"]))
    ours = torch_forward(arrays).double().numpy()
    assert np.isfinite(ours).all()
    assert relative_l2(ours, reference.experts_forward(**cleaned)) <= SPEC.tolerance_for("bfloat16")


def test_n_major_weights_run_in_place_through_the_nn_kernel(fake):
    arrays, _ = random_case(3, T=40, H=128, I=64, E=4, k=2, bias=False)
    ts = to_torch(arrays)
    strided = {n: ts[n].mT.contiguous().mT for n in ("gate_up_proj", "down_proj")}
    plain = torch_forward(arrays)
    assert [c[0] for c in fake.calls] == ["nt", "nt"]
    np.testing.assert_array_equal(torch_forward(arrays, **strided).float().numpy(), plain.float().numpy())
    assert [c[0] for c in fake.calls[2:]] == ["nn", "nn"]


def test_torch_compile_fullgraph_through_the_custom_op(fake):
    arrays, _ = random_case(4, T=30, H=64, I=64, E=4, k=2, bias=True, empty_fraction=0.2)
    ts = to_torch(arrays)
    with torch.no_grad():
        got = torch.compile(lambda **kw: torch_deepgemm.experts_forward(**kw), fullgraph=True,
                            backend="aot_eager")(**ts)
    assert len(fake.calls) == 2  # run, not traced: the fake implementation stood in while tracing
    np.testing.assert_array_equal(got.float().numpy(), torch_forward(arrays).float().numpy())


def test_custom_op_schema_and_fake(fake):
    a = torch.randn(257, 64).to(torch.bfloat16)
    w = torch.randn(3, 32, 64).to(torch.bfloat16)
    layout = torch.tensor([2] * 100 + [-1] * 28 + [0] * 128, dtype=torch.int32)
    torch.library.opcheck(torch.ops.moe_torch.deepgemm_grouped_gemm.default, (a, w, layout),
                          test_utils=("test_schema", "test_faketensor"))


# --- requirement errors -------------------------------------------------------------------------------------------

def test_unavailable_on_cpu_with_reasons(monkeypatch):
    needs = "needs the package 'deep_gemm': pip install 'moe-experts\\[deepgemm\\]'"
    assert moe_torch.available_backends("cpu")["deepgemm"] == (
        "implementation 'deepgemm' needs the package 'deep_gemm': pip install 'moe-experts[deepgemm]'; or put the "
        "hub build kernels-community/deep-gemm (v2) in the local kernel cache (pip install kernels, then once, "
        "online: python -c \"import kernels; kernels.get_kernel('kernels-community/deep-gemm', version=2)\"): it is "
        "loaded from there, never downloaded at run time")
    assert "deep_gemm" in moe_jax.available_backends("cpu")["deepgemm"]
    arrays = to_torch(random_case(5, T=4, H=64, I=64, E=3, k=2, bias=False)[0])
    with pytest.raises(ImportError, match=needs):
        moe_torch.experts_forward(**arrays, implementation="deepgemm")
    monkeypatch.setitem(registry.PACKAGES_PRESENT, "deep_gemm", True)
    assert moe_torch.available_backends("cpu")["deepgemm"] == (
        "implementation 'deepgemm' runs on ['cuda'], got a tensor on cpu")
    with pytest.raises(RuntimeError, match=r"implementation 'deepgemm' runs on \['cuda'\], got a tensor on cpu"):
        moe_torch.experts_forward(**arrays, implementation="deepgemm")
    with pytest.raises(RuntimeError, match=r"runs on \['cuda'\], got a tensor on cpu"):
        torch_deepgemm.runtime(torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"runs on \['cuda'\], got the cpu platform"):
        jax_deepgemm.runtime("cpu")


def test_a_cached_hub_build_counts_as_installed(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    folder = tmp_path / "kernels--kernels-community--deep-gemm"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "v2").write_text("c0ffee")
    (folder / "snapshots" / "c0ffee").mkdir(parents=True)
    assert moe_torch.available_backends("cpu")["deepgemm"] == (
        "implementation 'deepgemm' runs on ['cuda'], got a tensor on cpu")


def test_jax_backend_never_imports_torch_until_called():
    import subprocess
    code = "import sys, moe_jax.backends.deepgemm; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device of a chosen compute capability for the checks (no kernel runs), with fresh caches."""
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setitem(registry.PACKAGES_PRESENT, "deep_gemm", True)
    monkeypatch.setattr(torch_deepgemm, "_READY", {})
    monkeypatch.setattr(requirements, "_LOADED", {})
    return capability


def test_compute_capability_below_hopper(fake_cuda):
    fake_cuda[0] = (8, 9)
    with pytest.raises(RuntimeError, match=r"'deepgemm' needs CUDA compute capability >= 9.0, got 8.9 on a tensor "
                                           r"on cuda:0"):
        torch_deepgemm.runtime(torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"needs CUDA compute capability >= 9.0, got 8.9"):
        moe_torch.api.check_requirements("deepgemm", torch.device("cuda", 0), torch.bfloat16)


def _nvcc(root, release: str | None):
    """A fake toolkit at ``root``: bin/nvcc printing ``release`` (None: a runtime-only install, no nvcc)."""
    (root / "lib64").mkdir(parents=True)
    if release is not None:
        (root / "bin").mkdir()
        nvcc = root / "bin" / "nvcc"
        nvcc.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                        f"echo 'Cuda compilation tools, release {release}, V{release}.1'\n")
        nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return root


def test_toolkit_search_order(tmp_path, monkeypatch):
    home, path, on_path, default = (_nvcc(tmp_path / n, r) for n, r in
                                    (("home", "12.4"), ("path", "12.8"), ("onpath", "13.0"), ("default", "12.3")))
    monkeypatch.setattr(requirements, "DEFAULT_CUDA_ROOT", str(default))
    env = {"CUDA_HOME": str(home), "CUDA_PATH": str(path), "PATH": f"/nonexistent:{on_path / 'bin'}"}
    found = []
    for unset in (None, "CUDA_HOME", "CUDA_PATH", "PATH"):
        env.pop(unset, None)
        toolkit = requirements.check_toolkit("deepgemm", REQUIRES.nvcc, (9, 0), env)
        found.append((toolkit.found_by, toolkit.root, requirements.nvcc_version(toolkit.nvcc)))
    assert found == [("CUDA_HOME", str(home), (12, 4)), ("CUDA_PATH", str(path), (12, 8)),
                     ("nvcc on PATH", str(on_path), (13, 0)), (str(default), str(default), (12, 3))]
    monkeypatch.setattr(requirements, "DEFAULT_CUDA_ROOT", str(tmp_path / "absent"))
    with pytest.raises(RuntimeError, match=r"'deepgemm' needs a CUDA toolkit with nvcc .*got none: CUDA_HOME and "
                                           r"CUDA_PATH are unset, no nvcc on PATH"):
        requirements.check_toolkit("deepgemm", REQUIRES.nvcc, (9, 0), env)


def test_runtime_only_install_is_refused(tmp_path):
    runtime_only = _nvcc(tmp_path / "cuda", None)
    with pytest.raises(RuntimeError, match=rf"needs a full CUDA toolkit with nvcc >= 12.3 .*got {runtime_only} "
                                           r"\(from CUDA_HOME\) without bin/nvcc, a runtime-only install"):
        requirements.check_toolkit("deepgemm", REQUIRES.nvcc, (9, 0), {"CUDA_HOME": str(runtime_only)})


@pytest.mark.parametrize("release, capability, needed", [("12.2", (9, 0), "12.3"), ("12.8", (10, 0), "12.9"),
                                                         ("12.8", (12, 0), "12.9")])
def test_nvcc_version_minimum_per_compute_capability(tmp_path, release, capability, needed):
    env = {"CUDA_HOME": str(_nvcc(tmp_path / "cuda", release))}
    with pytest.raises(RuntimeError, match=rf"needs nvcc >= {needed} on compute capability "
                                           rf"{capability[0]}.{capability[1]}, got nvcc {release} at .*CUDA_HOME"):
        requirements.check_toolkit("deepgemm", REQUIRES.nvcc, capability, env)


def test_nvcc_without_a_release_line(tmp_path):
    root = _nvcc(tmp_path / "cuda", "12.4")
    (root / "bin" / "nvcc").write_text("#!/bin/sh\necho nonsense\n")
    with pytest.raises(RuntimeError, match=r"--version printed no 'release X.Y'"):
        requirements.check_toolkit("deepgemm", REQUIRES.nvcc, (9, 0), {"CUDA_HOME": str(root)})


def _versions(monkeypatch, **installed):
    names = {"sgl_deep_gemm": "sgl-deep-gemm"}
    table = {names.get(k, k): v for k, v in installed.items()}
    monkeypatch.setattr(requirements, "installed_version", lambda dist: table.get(dist))


@pytest.mark.parametrize("build, torch_version, message", [
    ("0.2.0", "2.11.0+cu130", r"the sgl-deep-gemm build for the installed torch 2.11.0\+cu130: sgl-deep-gemm "
                              r"0.2.0 is built against torch 2.13; pip install 'sgl-deep-gemm==0.1.4.post1'"),
    ("0.2.5", "2.13.0", r"sgl-deep-gemm 0.2.5 is built against torch 2.14; pip install 'sgl-deep-gemm==0.2.0'"),
    ("0.1.7", "2.12.1", r"sgl-deep-gemm 0.1.7 is a build whose torch ABI is not recorded \(recorded: 0.1.4.post1 "
                        r"for torch 2.11, 2.12; .*pip install 'sgl-deep-gemm==0.1.4.post1'"),
    ("0.1.4.post1", "2.10.0", r"no recorded sgl-deep-gemm build is for it: install torch 2.11 or 2.12 or 2.13 or "
                              r"2.14"),
])
def test_abi_mismatch_names_the_build_to_install(monkeypatch, build, torch_version, message):
    _versions(monkeypatch, sgl_deep_gemm=build, torch=torch_version)
    with pytest.raises(ImportError, match=rf"implementation 'deepgemm' needs .*{message}"):
        requirements.check_abi("deepgemm", REQUIRES.abi)


@pytest.mark.parametrize("build, torch_version", [("0.1.4.post1", "2.11.0+cu130"), ("0.1.4.post1", "2.12.0"),
                                                  ("0.2.0", "2.13.0"), (None, "2.11.0")])
def test_abi_match_or_source_build_passes(monkeypatch, build, torch_version):
    _versions(monkeypatch, sgl_deep_gemm=build, torch=torch_version)
    requirements.check_abi("deepgemm", REQUIRES.abi)


def test_first_call_checks_in_order_then_imports(fake_cuda, tmp_path, monkeypatch):
    """Compute capability, ABI (before any import), toolkit, then the import naming the extra; once all hold, the
    module, checked for its layout alignment."""
    monkeypatch.setenv("CUDA_HOME", str(_nvcc(tmp_path / "cuda", "12.2")))
    _versions(monkeypatch, sgl_deep_gemm="0.2.0", torch="2.11.0")
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # not importable
    device = torch.device("cuda", 0)
    with pytest.raises(ImportError, match=r"sgl-deep-gemm 0.2.0 is built against torch 2.13"):
        torch_deepgemm.runtime(device)
    _versions(monkeypatch, sgl_deep_gemm="0.1.4.post1", torch="2.11.0")
    with pytest.raises(RuntimeError, match=r"needs nvcc >= 12.3 on compute capability 9.0, got nvcc 12.2"):
        torch_deepgemm.runtime(device)
    monkeypatch.setenv("CUDA_HOME", str(_nvcc(tmp_path / "cuda-12.4", "12.4")))
    with pytest.raises(ImportError, match=r"'deepgemm' needs the package 'deep_gemm': pip install "
                                          r"'moe-experts\[deepgemm\]'"):
        torch_deepgemm.runtime(device)
    monkeypatch.setitem(sys.modules, "deep_gemm", FakeDeepGEMM(alignment=256))
    with pytest.raises(RuntimeError, match=r"multiples of 128 rows, which the kernel's contiguous-layout alignment "
                                           r"256 does not divide"):
        torch_deepgemm.runtime(device)
    module = FakeDeepGEMM(alignment=64)
    monkeypatch.setitem(sys.modules, "deep_gemm", module)
    monkeypatch.setattr(requirements, "_LOADED", {})
    assert torch_deepgemm.runtime(device) is module and torch_deepgemm.runtime(device) is module


def test_hub_build_from_the_local_cache_where_deep_gemm_is_not_installed(fake_cuda, tmp_path, monkeypatch):
    """No sgl-deep-gemm: kernels-community/deep-gemm (version 2) from the local kernel cache, by path (nothing to
    download; the kernels package picks the build for the installed torch, so no ABI table applies); the toolkit is
    still checked (the hub build JIT-compiles with nvcc too). Not cached: ImportError naming both ways."""
    monkeypatch.setenv("CUDA_HOME", str(_nvcc(tmp_path / "cuda", "12.4")))
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "cache"))
    _versions(monkeypatch)  # no distribution installed
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    device = torch.device("cuda", 0)
    with pytest.raises(ImportError, match=r"'deepgemm' needs the package 'deep_gemm': pip install "
                                          r"'moe-experts\[deepgemm\]'; or put the hub build kernels-community/"
                                          r"deep-gemm \(v2\) in the local kernel cache \(pip install kernels, "
                                          r"then once, online: python -c \"import kernels; kernels.get_kernel\("
                                          r"'kernels-community/deep-gemm', version=2\)\"\)"):
        torch_deepgemm.runtime(device)
    folder = tmp_path / "cache" / "kernels--kernels-community--deep-gemm"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "v2").write_text("c0ffee")
    (folder / "snapshots" / "c0ffee").mkdir(parents=True)
    with pytest.raises(ImportError, match=r"in the local cache .*needs the kernels package: pip install kernels"):
        torch_deepgemm.runtime(device)
    def no_variant(path):
        raise FileNotFoundError(f"no build variant in {path}")

    monkeypatch.setitem(sys.modules, "kernels", types.SimpleNamespace(get_local_kernel=no_variant))
    with pytest.raises(ImportError, match=r"has no variant for this torch and CUDA \(no build variant in "):
        torch_deepgemm.runtime(device)
    module, asked = FakeDeepGEMM(alignment=64), []
    monkeypatch.setitem(sys.modules, "kernels", types.SimpleNamespace(
        get_local_kernel=lambda path: asked.append(path) or module))
    assert torch_deepgemm.runtime(device) is module and asked == [folder / "snapshots" / "c0ffee"]
    monkeypatch.setattr(torch_deepgemm, "_READY", {})
    monkeypatch.setattr(requirements, "_LOADED", {})
    monkeypatch.setenv("CUDA_HOME", str(_nvcc(tmp_path / "cuda-12.2", "12.2")))
    with pytest.raises(RuntimeError, match=r"needs nvcc >= 12.3 on compute capability 9.0, got nvcc 12.2"):
        torch_deepgemm.runtime(device)


def test_shapes_and_dtypes_the_kernels_cannot_take(fake):
    arrays, _ = random_case(6, T=8, H=64, I=64, E=3, k=2, bias=False)
    for H, I, arg, dim, size in ((96, 64, "gate_up_proj", "H", 96), (64, 32, "down_proj", "I", 32)):
        bad, _ = random_case(6, T=8, H=H, I=I, E=3, k=2, bias=False)
        message = rf"{arg}: expected {dim} a multiple of 64 for implementation 'deepgemm' .*{dim} = {size}"
        with pytest.raises(ValueError, match=message):
            torch_forward(bad)
        with pytest.raises(ValueError, match=message):
            jax_forward(bad)
    dtype_message = r"gate_up_proj: implementation 'deepgemm' supports dtypes \['bfloat16'\], got dtype float32"
    with pytest.raises(ValueError, match=dtype_message), torch.no_grad():
        torch_deepgemm.experts_forward(**to_torch(arrays, torch.float32))
    with pytest.raises(ValueError, match=dtype_message):
        jax_deepgemm.experts_forward(**to_jax(arrays, jnp.float32))
    with pytest.raises(ValueError, match=r"activation: implementation 'deepgemm' takes one of"):
        torch_forward(arrays, activation=lambda h: h[:, :64])
    assert not fake.calls


def test_inference_only_refuses_autograd(fake):
    arrays, _ = random_case(7, T=8, H=64, I=64, E=3, k=2, bias=False)
    message = r"'deepgemm' is inference only \(the spec's training = false\), got a differentiated call"
    with pytest.raises(RuntimeError, match=message + r": call it under torch.no_grad\(\)"):
        torch_deepgemm.experts_forward(**to_torch(arrays, requires_grad=True))
    values = to_jax(arrays)
    with pytest.raises(RuntimeError, match=message + r": call it outside jax.grad"):
        jax.grad(lambda x: jax_deepgemm.experts_forward(**(values | {"hidden_states": x})).astype(
            jnp.float32).sum())(values["hidden_states"])
    assert not fake.calls
    assert not SUPPORT.training and "deepgemm" not in SPEC.trainers("torch")


def test_megamoe_names_everything_missing(monkeypatch):
    arrays = to_torch(random_case(8, T=4, H=64, I=64, E=4, k=2, bias=False)[0])
    with pytest.raises(RuntimeError, match=r"'deepgemm_megamoe' cannot run here; it needs a CUDA device of compute "
                                           r"capability >= 10.0 \(got a tensor on cpu\); FP4 experts with UE8M0 "
                                           r"scales \(got bfloat16 experts\); an expert-parallel torch.distributed "
                                           r"process group"):
        deepgemm_megamoe.experts_forward(**arrays)
    monkeypatch.setitem(registry.PACKAGES_PRESENT, "deep_gemm", True)
    also = r"; it also needs FP4 experts with UE8M0 scales; an expert-parallel torch.distributed process group$"
    with pytest.raises(RuntimeError, match=r"'deepgemm_megamoe' runs on \['cuda'\], got a tensor on cpu" + also):
        moe_torch.experts_forward(**arrays, implementation="deepgemm_megamoe")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    hopper = deepgemm_megamoe.missing(torch.device("cuda", 0), torch.bfloat16)
    assert hopper[0] == "a CUDA device of compute capability >= 10.0 (got 9.0)" and len(hopper) == 3
    with pytest.raises(RuntimeError, match=r"needs CUDA compute capability >= 10.0, got 9.0 on a tensor on cuda:0"
                                           + also):
        moe_torch.api.check_requirements("deepgemm_megamoe", torch.device("cuda", 0), torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert [m.split(" (")[0] for m in deepgemm_megamoe.missing(torch.device("cuda", 0), torch.bfloat16)] == [
        "FP4 experts with UE8M0 scales", "an expert-parallel torch.distributed process group"]


@pytest.mark.parametrize("capability, scales, ok", [((9, 0), "float32", True), ((9, 0), "ue8m0", True),
                                                    ((10, 0), "ue8m0", True), ((10, 0), "float32", False),
                                                    ((12, 0), "float32", False)])
def test_blackwell_float32_scales_rule(capability, scales, ok):
    rules = SUPPORT.details["quantized_scales"]
    if ok:
        requirements.check_scales("deepgemm", rules, capability, scales)
        return
    with pytest.raises(ValueError, match=r"scales: implementation 'deepgemm' reads \['ue8m0'\] scales on compute "
                                         rf"capability {capability[0]}.0, got float32"):
        requirements.check_scales("deepgemm", rules, capability, scales)


def test_benchmark_skips_training_points_of_inference_only_backends():
    from bench import sweep
    assert sweep._inference_only("torch", "deepgemm") and sweep._inference_only("jax", "deepgemm")
    assert not sweep._inference_only("torch", "grouped_mm") and not sweep._inference_only("torch", "unknown")
