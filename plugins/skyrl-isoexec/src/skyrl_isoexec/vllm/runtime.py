"""Per-process state of IsoExec inside a vLLM process: the op ledger of the model being loaded,
and the ledger and site of the step being computed.

vLLM computes one forward per scheduler step over a mix of requests; the attention metadata
builder of the engine (``attention.IsoExecCPUMetadataBuilder``) runs before each forward and
names its ledger and site: ``engine_decode`` when every request contributes one query token,
``engine_prefill`` otherwise. Every canonical op called in that step, the sampler's included,
records itself there; the worker's attestation RPC returns that ledger (the fingerprint of what
ran). An in-process engine shares its process with others, hence a ledger per loaded model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skyrl_core.ops import OpLedger

_ledger: OpLedger | None = None  # of the model being (or last) loaded
_step: tuple[OpLedger, str] | None = None  # (ledger, site) of the step being computed


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
    """Start the ledger of a model about to be loaded in this process."""
    global _ledger
    _ledger = None
    return ledger()


def begin_step(step_ledger: OpLedger, site: str) -> None:
    """The next forward (and its sampling) computes at ``site``, for the model of ``step_ledger``."""
    global _step
    _step = (step_ledger, site)


def current_site() -> str | None:
    return None if _step is None else _step[1]


def observe(op: str, module: object = None) -> None:
    """Record one call of the canonical ``op`` in the current step, by ``module`` (its model-qualified
    name, set by ``checks.inspect_model``) if given; nothing before the first step (vLLM's warm-up)."""
    if _step is not None:
        from skyrl_isoexec.specs import CANONICAL

        step_ledger, site = _step
        step_ledger.observe(op, site, CANONICAL[op].name, getattr(module, "_isoexec_name", None))


class DecidedAtBuild:
    """Mixin of IsoExec's replacements for vLLM classes: ``_isoexec`` records whether IsoExec was on
    when the module was built, which decides for the module's life (off: vLLM's own code runs)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._isoexec = active()
