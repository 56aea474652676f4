"""Ops, sites and the op ledger: the vocabulary through which runtimes declare their numerics.

An **op** is a mathematical function (``linear``, ``attention``, ``logprobs``, ...). A **site** is
where a runtime computes it (``trainer_forward``, ``engine_decode``, ...). A runtime (training
backend or inference engine) calls ``prepare_model(model, role)`` once after building its model:
every op is installed at each of the role's sites through ``install_op``, which asks the
``skyrl_install_op`` hook (a plugin such as IsoExec may substitute its own implementation), and
records the result in the returned ``OpLedger``. The runtime then computes inside
``site_scope(site)``, so that patched modules dispatch to the implementation installed there.

The core's default implementations are stock PyTorch / transformers: installing them changes
nothing. This module imports torch lazily.
"""

from __future__ import annotations

from skyrl_core.ops.ledger import OpLedger, OpLedgerView
from skyrl_core.ops.vocabulary import OPS, ROLE_SITES, SITES, current_site, site_scope
from skyrl_core.ops.install import install_op, prepare_model, token_logprobs

__all__ = [
    "OPS",
    "ROLE_SITES",
    "SITES",
    "OpLedger",
    "OpLedgerView",
    "current_site",
    "install_op",
    "prepare_model",
    "site_scope",
    "token_logprobs",
]
