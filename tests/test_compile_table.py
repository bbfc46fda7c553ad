"""The torch.compile table of the spec (modes, dtypes, fullgraph), verified entry by entry on CPU for the backends
that run there (the CUDA-only ones are verified on the device: tests/device_triton_check.py)."""

from __future__ import annotations

import pytest
import torch

from moe_shared import relative_l2
from moe_torch import experts_forward
from support import SPEC, random_case
from test_torch import to_torch

ENTRIES = [(name, mode, dtype, b.frameworks["torch"].compile.fullgraph)
           for name, b in SPEC.backends.items() if "torch" in b.frameworks and b.frameworks["torch"].compile
           and "cpu" in b.frameworks["torch"].devices
           for mode in b.frameworks["torch"].compile.modes for dtype in b.frameworks["torch"].compile.dtypes]


@pytest.mark.parametrize("backend, mode, dtype, fullgraph", ENTRIES, ids=["-".join(map(str, e)) for e in ENTRIES])
def test_declared_compile_entry_works(backend, mode, dtype, fullgraph):
    torch._dynamo.reset()
    tensors = to_torch(random_case(11, T=6, H=16, I=8, E=4, k=2, bias=True, empty_fraction=0.2)[0], dtype)
    fn = torch.compile(lambda **kw: experts_forward(**kw, implementation=backend), fullgraph=fullgraph,
                       mode=None if mode == "default" else mode)
    out = fn(**tensors)
    expected = experts_forward(**tensors, implementation=backend)
    assert out.dtype == expected.dtype
    assert relative_l2(out.float(), expected.float()) <= SPEC.tolerance_for(dtype)


@pytest.mark.parametrize("backend", [n for n, b in SPEC.backends.items() if "torch" in b.frameworks
                                     and b.frameworks["torch"].compile and not b.frameworks["torch"].compile.fullgraph])
def test_backends_declared_without_fullgraph_break_the_graph(backend):
    torch._dynamo.reset()
    tensors = to_torch(random_case(11, T=6, H=16, I=8, E=4, k=2, bias=False)[0], "float32")
    with pytest.raises(Exception, match="(?i)data.dependent|graph break|nonzero|tolist|item"):
        torch.compile(lambda **kw: experts_forward(**kw, implementation=backend), fullgraph=True)(**tensors)
