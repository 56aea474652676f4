"""Implementations that bring their own form for an engine's layers.

A runtime that routes its framework's layers through the installed ops (skyrl-vllm for vLLM)
calls each implementation with the op's calling convention (``skyrl_core.ops.hf``). Some
implementations cannot be reached that way inside an engine: an attention over the engine's
paged KV cache, a MoE over its merged expert weights, a recurrent layer over its state cache. A
plugin declares here, per engine, that it computes an implementation's op in that engine with
its own layers; the engine's router then leaves those layers to it and calls nothing itself.

Kept per process (each engine process runs its plugins' ``skyrl_worker_init``), keyed by
``(engine, implementation name)``. Imports nothing heavy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from skyrl_core.ops.stock import is_stock
from skyrl_core.ops.vocabulary import ROLE_SITES

if TYPE_CHECKING:
    from skyrl_core.ops.ledger import OpLedger

_own_layers: dict[tuple[str, str], str] = {}


def declare_own_layers(engine: str, impl_names: list[str] | tuple[str, ...], owner: str) -> None:
    """``owner`` computes each of ``impl_names`` inside ``engine`` with its own layers."""
    for name in impl_names:
        _own_layers[(engine, name)] = owner


def own_layers_owner(engine: str, impl_name: str) -> str | None:
    """The plugin that computes ``impl_name`` inside ``engine`` itself, or None (the engine routes it)."""
    return _own_layers.get((engine, impl_name))


def forget_own_layers(engine: str, owner: str) -> None:
    """Drop ``owner``'s declarations for ``engine`` (tests, uninstall)."""
    for key in [k for k, v in _own_layers.items() if k[0] == engine and v == owner]:
        del _own_layers[key]


def routed_ops(ledger: OpLedger, engine: str) -> dict[str, list[str]]:
    """Op -> names of the non-stock implementations declared at ``ledger``'s engine sites that
    ``engine``'s layers must call (those computed by a plugin's own layers left out); empty when
    every op keeps the engine's own kernels."""
    routed: dict[str, list[str]] = {}
    for (op, site), impl in ledger.declared.items():
        if site in ROLE_SITES["engine"] and not is_stock(impl) and own_layers_owner(engine, impl.name) is None:
            names = routed.setdefault(op, [])
            if impl.name not in names:
                names.append(impl.name)
    return routed


def own_layer_impls(ledger: OpLedger, engine: str) -> list[str]:
    """Names of the implementations declared at ``ledger``'s engine sites that a plugin computes
    inside ``engine`` with its own layers (they read the engine's current site: ``site_scope``)."""
    names = {impl.name for (_, site), impl in ledger.declared.items()
             if site in ROLE_SITES["engine"] and not is_stock(impl) and own_layers_owner(engine, impl.name) is not None}
    return sorted(names)
