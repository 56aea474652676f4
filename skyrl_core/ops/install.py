"""Installing ops through the ``skyrl_install_op`` hook (``install_op``, ``prepare_model``) and the
runtimes' logprob entry point (``token_logprobs``).

Module layering inside ``skyrl_core.ops`` (no cycles; ``tests/core/test_ops_imports.py``):
``vocabulary``, ``ledger``, ``stock`` are leaves; ``dispatch`` reads ``stock``; the model patchers
(``hf``) build on ``dispatch``; this module sits on top and imports the default patcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from skyrl_core.ops.hf import patch_hf_model
from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.stock import DEFAULT_IMPLS, UNSCOPED
from skyrl_core.ops.vocabulary import OPS, ROLE_SITES, SITES, current_site
from skyrl_core.plugins.records import OpImplSpec

if TYPE_CHECKING:
    from skyrl_core.plugins.manager import SkyrlPluginManager
    import torch

__all__ = ["DEFAULT_IMPLS", "install_op", "prepare_model", "token_logprobs"]


def install_op(op: str, site: str, impl: OpImplSpec | None = None, *,
               plugin_manager: SkyrlPluginManager | None = None) -> OpImplSpec:
    """Return the implementation of ``op`` to install at ``site``, as decided by the hook."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {', '.join(OPS)}")
    if site not in SITES:
        raise ValueError(f"unknown op site {site!r}; sites are {', '.join(SITES)}")
    from skyrl_core.plugins.manager import get_plugin_manager

    pm = plugin_manager or get_plugin_manager()
    chosen = pm.hook.skyrl_install_op(op=op, site=site, impl=impl or DEFAULT_IMPLS[op])
    return chosen or impl or DEFAULT_IMPLS[op]


def prepare_model(
    model: Any, role: str, *, plugin_manager: SkyrlPluginManager | None = None, compute_dtype: Any = None, defaults: Mapping[str, OpImplSpec] | None = None,
    patcher: Callable[[Any, OpLedger], None] | None = None,
) -> OpLedger:
    """Install every op at every site of ``role`` for ``model``; return the ledger.

    With only default implementations installed the model is left untouched. When a plugin
    substitutes an implementation at any site, the model's modules are patched once
    (``skyrl_core.ops.hf.patch_hf_model``) so that each op dispatches, per call, to the
    implementation installed at the current site. ``model`` may be None (declare only, e.g. for a
    contract) or a transformers causal LM; a runtime whose model is built from other layers passes
    its own ``patcher(model, ledger)`` (built on ``skyrl_core.ops.dispatch``, e.g.
    ``skyrl_megatron.ops_sites.patch_megatron_model``). ``compute_dtype`` is the dtype the runtime computes in
    when it differs from the parameters' (e.g. bf16 compute over fp32 master weights); it is
    recorded as ``ledger.meta["dtype"]``. ``defaults`` maps ops to the runtime's own choice of
    implementation (e.g. ``{"linear": ONEDNN_LINEAR}``) where it is not the stock one; plugins
    still decide last (``skyrl_install_op`` receives it as ``impl``).
    """
    if role not in ROLE_SITES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLE_SITES)}")
    ledger = OpLedger(role=role)
    for site in ROLE_SITES[role]:
        for op in OPS:
            ledger.declare(op, site, install_op(op, site, (defaults or {}).get(op), plugin_manager=plugin_manager))
    if model is not None:
        params = getattr(model, "parameters", None)
        dtype = next((p.dtype for p in params() if p.is_floating_point()), None) if params else None
        ledger.meta.update(architecture=type(model).__name__.removeprefix("FSDP"), dtype=str(dtype).removeprefix("torch."))
        stock = all(impl.name == DEFAULT_IMPLS[impl.op].name for impl in ledger.declared.values())
        if not stock:
            (patcher or patch_hf_model)(model, ledger)
        model._skyrl_op_ledger = ledger
    if compute_dtype is not None:
        ledger.meta["dtype"] = str(compute_dtype).removeprefix("torch.")
    return ledger


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, *, ledger: OpLedger | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of ``token_ids`` under ``logits / temperature`` (``[..., V]`` -> ``[...]``), via
    the ``logprobs`` implementation installed at the current site (stock: fp32 log-softmax + gather).

    Pass raw model logits and the temperature, never pre-scaled logits: the implementation owns the
    scaling (in fp32), so that every runtime rounds the same way.
    """
    site = current_site()
    impl = ledger.impl("logprobs", site) if (ledger is not None and site is not None) else None
    stock = impl is None or impl.name == DEFAULT_IMPLS["logprobs"].name
    if ledger is not None:
        observed_site = site if impl is not None else UNSCOPED
        ledger.observe("logprobs", observed_site, DEFAULT_IMPLS["logprobs"].name if stock else impl.name)
    if stock:
        from skyrl_core.ops.defaults import logprobs

        return logprobs(logits, token_ids, temperature)
    return impl.load_factory()(logits, token_ids, temperature)
