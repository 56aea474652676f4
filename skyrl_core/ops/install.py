"""Installing ops through the ``skyrl_install_op`` hook, and the default implementations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.vocabulary import OPS, ROLE_SITES, SITES, current_site
from skyrl_core.plugins.records import OpImplSpec

if TYPE_CHECKING:
    import torch

# The stock implementation of every op: what transformers / torch do by themselves.
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


def install_op(op: str, site: str, impl: OpImplSpec | None = None, *, plugin_manager: Any = None) -> OpImplSpec:
    """Return the implementation of ``op`` to install at ``site``, as decided by the hook."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {', '.join(OPS)}")
    if site not in SITES:
        raise ValueError(f"unknown op site {site!r}; sites are {', '.join(SITES)}")
    from skyrl_core.plugins.manager import get_plugin_manager

    pm = plugin_manager or get_plugin_manager()
    chosen = pm.hook.skyrl_install_op(op=op, site=site, impl=impl or DEFAULT_IMPLS[op])
    return chosen or impl or DEFAULT_IMPLS[op]


def prepare_model(model: Any, role: str, *, plugin_manager: Any = None) -> OpLedger:
    """Install every op at every site of ``role`` for ``model``; return the ledger.

    With only default implementations installed the model is left untouched. When a plugin
    substitutes implementations, their factories are imported and each is given the chance to patch
    ``model`` (a factory's ``patch(model, ledger)`` attribute, if any) once.
    """
    if role not in ROLE_SITES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLE_SITES)}")
    ledger = OpLedger(role=role)
    for site in ROLE_SITES[role]:
        for op in OPS:
            ledger.declare(op, site, install_op(op, site, plugin_manager=plugin_manager))
    patched: set[str] = set()
    for impl in ledger.declared.values():
        if impl.name in patched or impl.name == DEFAULT_IMPLS[impl.op].name:
            continue
        patched.add(impl.name)
        patch = getattr(impl.load_factory(), "patch", None)
        if patch is not None and model is not None:
            patch(model, ledger)
    if model is not None:
        model._skyrl_op_ledger = ledger
    return ledger


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, *, ledger: OpLedger | None = None) -> torch.Tensor:
    """Log-probability of ``token_ids`` under ``logits`` (``[..., V]`` -> ``[...]``), via the
    ``logprobs`` implementation installed at the current site (stock: fp32 log-softmax + gather)."""
    site = current_site()
    impl = ledger.impl("logprobs", site) if (ledger is not None and site is not None) else None
    if impl is None or impl.name == DEFAULT_IMPLS["logprobs"].name:
        from skyrl_core.ops.defaults import logprobs

        return logprobs(logits, token_ids)
    if ledger is not None and site is not None:
        ledger.observe("logprobs", site, impl.name)
    return impl.load_factory()(logits, token_ids)
