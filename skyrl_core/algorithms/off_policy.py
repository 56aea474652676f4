"""Off-policy correction for a trainer/engine mismatch, for when IsoExec is off.

The engine samples with ``pi_rollout``; the trainer's recomputed ``pi_old`` differs from it (other
kernels, batch shapes, precision). Per token, ``rho_t = pi_old(y_t) / pi_rollout(y_t)``.
``off_policy_correction`` turns an ``OffPolicyConfig`` into a per-token multiplier for the loss
weights (``token_weights * multiplier``), and measures the mismatch, every step:

- truncated importance sampling (TIS): ``tis: token`` gives ``min(rho_t, tis_cap)``;
  ``tis: sequence`` gives every token of sample ``i`` ``min(prod_t rho_t, tis_cap)``;
- sequence masks drop whole samples: ``geometric`` keeps ``i`` iff
  ``mask_low <= exp(mean_t log rho_t) <= mask_high``, ``product`` iff
  ``mask_low <= prod_t rho_t <= mask_high``;
- the per-token (outlier) mask drops tokens with ``rho_t`` outside
  ``[token_mask_low, token_mask_high]`` (a bound left None is open).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from skyrl_core.algorithms.tensor_utils import (
    as_float,
    check_shapes,
    masked_mean,
    masked_scalar,
    masked_sum,
    zero_where_masked,
)

if TYPE_CHECKING:
    from skyrl_core.config.schema import OffPolicyConfig

# exp() of summed log-ratios must stay finite
_LOG_RATIO_LIMIT = 20.0


def _enabled(cfg: OffPolicyConfig) -> bool:
    return (
        cfg.tis != "none"
        or cfg.sequence_mask != "none"
        or cfg.token_mask_low is not None
        or cfg.token_mask_high is not None
    )


def mismatch_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> dict[str, float]:
    """``mismatch/abs_logprob_diff_mean`` and ``_max`` (``|log pi_old - log pi_rollout|``) and
    ``mismatch/kl``: the k3 estimate of ``KL(pi_rollout || pi_old)`` from the rollout's samples."""
    with torch.no_grad():
        log_rho = zero_where_masked(as_float(old_logprobs) - as_float(rollout_logprobs), loss_mask)
        clamped = log_rho.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        return {
            "mismatch/abs_logprob_diff_mean": masked_scalar(log_rho.abs(), loss_mask, "mean"),
            "mismatch/abs_logprob_diff_max": masked_scalar(log_rho.abs(), loss_mask, "max"),
            "mismatch/kl": masked_scalar(clamped.exp() - 1 - clamped, loss_mask, "mean"),
        }


def off_policy_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    loss_mask: torch.Tensor,
    cfg: OffPolicyConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``(multiplier [B, R], metrics)``; ``multiplier`` has no gradient and is 0 where ``loss_mask``
    is 0. With every correction off it is the (float) mask; mismatch metrics are still reported when
    ``rollout_logprobs`` is given. A correction without ``rollout_logprobs`` is an error."""
    mask = (loss_mask > 0).to(as_float(old_logprobs).dtype)
    if rollout_logprobs is None:
        if _enabled(cfg):
            raise ValueError(
                "algorithm.off_policy asks for a correction (tis/sequence_mask/token_mask_*) but the batch "
                "has no rollout_logprobs: the engine must return per-token logprobs"
            )
        return mask, {}
    check_shapes("old_logprobs", old_logprobs, rollout_logprobs=rollout_logprobs, loss_mask=loss_mask)
    metrics = mismatch_metrics(old_logprobs, rollout_logprobs, loss_mask)
    with torch.no_grad():
        log_rho = zero_where_masked(as_float(old_logprobs) - as_float(rollout_logprobs), loss_mask)
        multiplier = mask.clone()

        if cfg.tis == "token":
            raw = log_rho.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT).exp()
        elif cfg.tis == "sequence":
            seq_log = masked_sum(log_rho, loss_mask, dim=-1).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
            raw = seq_log.exp().unsqueeze(-1).expand_as(log_rho)
        if cfg.tis != "none":
            multiplier = multiplier * raw.clamp(max=cfg.tis_cap)
            metrics["mismatch/tis_weight_mean"] = masked_scalar(raw.clamp(max=cfg.tis_cap), loss_mask)
            metrics["mismatch/tis_capped_frac"] = masked_scalar((raw > cfg.tis_cap).to(mask.dtype), loss_mask)

        keep = mask > 0
        if cfg.sequence_mask != "none":
            reduce = masked_mean if cfg.sequence_mask == "geometric" else masked_sum
            seq_log = reduce(log_rho, loss_mask, dim=-1)
            # compare in log space: exp() of a long sequence's sum would overflow
            inside = (seq_log >= math.log(cfg.mask_low)) & (seq_log <= math.log(cfg.mask_high))
            keep = keep & inside.unsqueeze(-1)
        rho = log_rho.exp()
        if cfg.token_mask_low is not None:
            keep = keep & (rho >= cfg.token_mask_low)
        if cfg.token_mask_high is not None:
            keep = keep & (rho <= cfg.token_mask_high)
        multiplier = torch.where(keep, multiplier, torch.zeros_like(multiplier))
        metrics["mismatch/masked_frac"] = masked_scalar((~keep).to(mask.dtype), loss_mask)
    return multiplier, metrics
