"""What "stock" means for every op: the core's default implementation records (the model's own
modules compute the op; ``skyrl_core.ops.defaults`` holds the callables) and the site name under
which calls made outside any ``site_scope`` are observed.

A leaf of ``skyrl_core.ops``: the installer (``install``), the per-call dispatch (``dispatch``) and
every model patcher read it, and it imports none of them (no torch either).
"""

from __future__ import annotations

from skyrl_core.ops.vocabulary import OPS
from skyrl_core.plugins.records import OpImplSpec

# The stock implementation of every op: what transformers / torch (or a runtime's own framework,
# e.g. vLLM's kernels) do by themselves.
DEFAULT_IMPLS: dict[str, OpImplSpec] = {
    op: OpImplSpec(
        name=f"torch.{op}",
        op=op,
        factory=f"skyrl_core.ops.defaults:{op}",
        version="1",
        description=f"stock PyTorch/transformers {op}",
    )
    for op in OPS
}

# The site recorded for op calls made outside any ``site_scope``.
UNSCOPED = "unscoped"


def is_stock(impl: OpImplSpec | None) -> bool:
    """Whether ``impl`` (None: nothing declared) leaves the op to the runtime's own code."""
    return impl is None or impl.name == DEFAULT_IMPLS[impl.op].name
