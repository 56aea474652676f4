"""The loss the trainer hands to ``TrainingBackend.forward_backward``: policy loss, optional KL
term and entropy bonus, all reduced with the micro-batch's ``token_weights`` so that micro-batches
(and ranks) sum exactly to the mini-batch's loss.

A module-level class (not a closure) so that it pickles to Ray ranks.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from skyrl_core.algorithms.entropy import entropy_bonus
from skyrl_core.algorithms.kl import kl_loss
from skyrl_core.algorithms.off_policy import mismatch_metrics
from skyrl_core.algorithms.tensor_utils import masked_scalar
from skyrl_core.types import TrainingBatch


@attrs.frozen(kw_only=True)
class RLLoss:
    """``(logprobs, micro_batch, entropy=None) -> (loss, metrics)``.

    A micro-batch without ``old_logprobs`` is its own old policy (a single update per rollout):
    the old logprobs are ``logprobs`` detached, and the trainer/engine mismatch is measured here.

    ``kl_coef > 0`` adds ``kl_coef * KL(pi || pi_ref)`` (needs ``ref_logprobs`` in the batch);
    ``entropy_coef`` adds ``-entropy_coef * entropy`` (the entropy is reported either way).
    """

    policy_loss: Any
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __call__(self, logprobs: torch.Tensor, batch: TrainingBatch, entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        old_logprobs = batch.old_logprobs
        mismatch: dict[str, float] = {}
        if old_logprobs is None:
            old_logprobs = logprobs.detach()
            if batch.rollout_logprobs is not None:
                mismatch = mismatch_metrics(old_logprobs, batch.rollout_logprobs, batch.loss_mask)
        loss, policy_metrics = self.policy_loss(
            logprobs, old_logprobs, batch.advantages, batch.loss_mask, batch.rollout_logprobs,
            token_weights=batch.token_weights, group_ids=batch.group_ids,
        )
        metrics = {**mismatch, **{f"policy/{k}": float(v) for k, v in policy_metrics.items()}}
        if self.kl_coef > 0:
            kl_term, kl_metrics = kl_loss(logprobs, batch.ref_logprobs, batch.loss_mask, self.kl_estimator,
                                          token_weights=batch.token_weights)
            loss = loss + self.kl_coef * kl_term
            metrics["kl"] = kl_metrics["kl"]
        if entropy is not None:
            if self.entropy_coef:
                bonus, entropy_metrics = entropy_bonus(entropy, batch.loss_mask, self.entropy_coef,
                                                       token_weights=batch.token_weights)
                loss = loss + bonus
                metrics["entropy"] = entropy_metrics["entropy"]
            else:
                metrics["entropy"] = masked_scalar(entropy.detach(), batch.loss_mask)
        return loss, metrics
