"""Per-process state of IsoExec inside a vLLM process: the op ledger of the model last loaded and
the ledger of the step being computed, for IsoExec's own layers (attention, MoE, GatedDeltaNet).

skyrl-vllm's op sites give each loaded model its ledger (``_skyrl_op_ledger``) and run each step
inside its op site (``engine_decode`` when every request contributes one query token,
``engine_prefill`` otherwise; ``skyrl_core.ops.site_scope``). The attention metadata builder of an
engine (``attention.IsoExecCPUMetadataBuilder``) runs before each forward and names the ledger
of its model; every canonical op of IsoExec's own layers called in that step records itself
there, next to the calls of the ops vLLM's op sites dispatched. The worker's attestation RPC
returns that ledger (the fingerprint of what ran). An in-process engine shares its process with
others, hence a ledger per loaded model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from skyrl_core.ops.vocabulary import current_site

if TYPE_CHECKING:
    from skyrl_core.ops import OpLedger

_ledger: OpLedger | None = None  # of the model last loaded
_step_ledger: OpLedger | None = None  # of the step being computed


def active() -> bool:
    """Whether modules built now get the canonical ops (IsoExec enabled in this process)."""
    from skyrl_isoexec import state

    return state.enabled()


def adopt_ledger(ledger: OpLedger) -> None:
    """The ledger of the model just loaded (skyrl-vllm's op sites made it)."""
    global _ledger
    _ledger = ledger


def ledger() -> OpLedger:
    """The ledger of the model last loaded in this process (declared through the
    ``skyrl_install_op`` hooks if none was loaded)."""
    global _ledger
    if _ledger is None:
        from skyrl_core.ops import prepare_model

        _ledger = prepare_model(None, "engine")
    return _ledger


def begin_step(step_ledger: OpLedger) -> None:
    """The next forward computes for the model of ``step_ledger``."""
    global _step_ledger
    _step_ledger = step_ledger


def observe(op: str, module: object = None) -> None:
    """Record one call of the canonical ``op`` in the current step, by ``module`` (its model-qualified
    name, set by ``checks.inspect_model``) if given; nothing outside a step (vLLM's dummy runs)."""
    site = current_site()
    if site is not None and _step_ledger is not None:
        from skyrl_isoexec.specs import CANONICAL

        _step_ledger.observe(op, site, CANONICAL[op].name, getattr(module, "_isoexec_name", None))


class DecidedAtBuild:
    """Mixin of IsoExec's replacements for vLLM classes: ``_isoexec`` records whether IsoExec was on
    when the module was built, which decides for the module's life (off: vLLM's own code runs)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._isoexec = active()
