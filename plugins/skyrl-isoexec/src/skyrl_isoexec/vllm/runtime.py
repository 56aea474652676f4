"""Per-process state of IsoExec inside a vLLM process: this worker's op ledger and current site.

vLLM computes one forward per scheduler step over a mix of requests; the attention metadata
builder (``attention.IsoExecMetadataBuilder``) runs before each forward and names its site:
``engine_decode`` when every request contributes one query token, ``engine_prefill`` otherwise.
Every canonical op called inside vLLM records itself at that site in the worker's ledger, which
the worker's attestation RPC returns (the fingerprint of what ran).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skyrl_core.ops import OpLedger

_ledger: OpLedger | None = None
_site: str | None = None
_model_built_active: bool = False


def active() -> bool:
    """Whether modules built now get the canonical ops (IsoExec enabled in this process)."""
    from skyrl_isoexec import state

    return state.enabled()


def ledger() -> OpLedger:
    """This process's engine ledger, declared through the ``skyrl_install_op`` hooks on first use."""
    global _ledger
    if _ledger is None:
        from skyrl_core.ops import prepare_model

        _ledger = prepare_model(None, "engine")
    return _ledger


def new_ledger() -> OpLedger:
    """Start a fresh ledger (a new model was loaded in this process)."""
    global _ledger, _site
    _ledger, _site = None, None
    return ledger()


def set_site(site: str) -> None:
    global _site
    _site = site


def current_site() -> str | None:
    return _site


def observe(op: str) -> None:
    """Record one call of the canonical ``op`` at the current site (nothing before the first step)."""
    if _site is not None and _ledger is not None:
        from skyrl_isoexec.specs import CANONICAL

        _ledger.observe(op, _site, CANONICAL[op].name)


def mark_model_built(active_now: bool) -> None:
    """Remember whether the last model loaded in this process runs the canonical ops (read by the
    sampler patch, which has no module to ask)."""
    global _model_built_active
    _model_built_active = active_now


def model_built_active() -> bool:
    return _model_built_active
