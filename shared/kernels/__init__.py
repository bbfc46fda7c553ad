"""Kernels written once for both frameworks.

``moe``: the fused MoE Triton kernels (imports triton); ``slot_pointers``: the pointer arrays of batched_mm's per-slot
cuBLAS GEMM on CUDA (imports triton; used by torch only); ``plan``: which of them a forward or backward launches, with
which tile configs (pure Python, read by both bindings); ``configs/<device>.json``: tuned tile configs per shape.
"""
