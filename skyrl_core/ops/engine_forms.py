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
