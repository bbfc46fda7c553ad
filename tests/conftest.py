"""Session set-up shared by every test module.

The Triton kernels run under the Triton interpreter on this CPU-only machine: TRITON_INTERPRET must be set before
``moe_shared.kernels.moe`` is imported (its kernels are wrapped when they are defined).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
