"""skyrl-isoexec: IsoExec: bitwise-identical logprobs between trainer and engine.

Light to import (no torch): the public helpers below import what they need when called.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def handshake(trainer_contract: dict[str, Any], engine_contract: dict[str, Any]) -> None:
    """Raise ``skyrl_isoexec.contract.ContractMismatch`` (listing every differing (op, site) pair and
    fingerprint problem) unless the two runtime contracts declare and ran the same numerics."""
    from skyrl_isoexec.contract import handshake as _handshake

    _handshake(trainer_contract, engine_contract)


def mismatch_metrics(logprobs: Any, rollout_logprobs: Any, mask: Any) -> dict[str, float]:
    """Trainer-vs-rollout mismatch over the tokens where ``mask`` is set, for the per-step log.

    ``isoexec/mismatch_tokens``: tokens whose fp32 logprob bits differ (0 under a verified
    contract, before the first optimizer step of the batch); ``isoexec/max_abs_logprob_diff``.
    """
    import torch

    chosen = mask.bool()
    a = logprobs.detach().float()[chosen].contiguous()
    b = rollout_logprobs.detach().float()[chosen].contiguous()
    differing = int((a.view(torch.int32) != b.view(torch.int32)).sum())
    worst = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    return {"isoexec/mismatch_tokens": float(differing), "isoexec/max_abs_logprob_diff": worst}
