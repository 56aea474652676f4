"""Off-policy correction for a trainer/engine mismatch, for when IsoExec is off.

The engine samples with ``pi_rollout``; the trainer's recomputed ``pi_old`` differs from it (other
kernels, batch shapes, precision). Per token, ``rho_t = pi_old(y_t) / pi_rollout(y_t)``.
``off_policy_correction`` turns an ``OffPolicyConfig`` into a per-token multiplier for the loss
weights (``token_weights * multiplier``), and measures the mismatch, every step. In this order
(upstream SkyRL's), each step seeing the tokens the previous ones kept:

1. outlier mask: drop a whole sample if any of its ``rho_t`` is outside
   ``[outlier_token_low, outlier_token_high]`` (a bound left None is open);
2. token mask: drop the tokens with ``rho_t`` outside ``[token_mask_low, token_mask_high]``;
3. truncated importance sampling (TIS): ``tis: token`` gives ``min(rho_t, token_tis_cap)``;
   ``tis: sequence`` gives every token of sample ``i`` ``min(prod_t rho_t, sequence_tis_cap)``
   (the product over the kept tokens);
4. sequence mask: ``geometric`` keeps ``i`` iff ``geo_mask_low <= exp(mean_t log rho_t) <= geo_mask_high``,
   ``product`` iff ``product_mask_low <= prod_t rho_t <= product_mask_high`` (over the kept tokens).
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
        if cfg.any_enabled():
            raise ValueError(
                "algorithm.off_policy asks for a correction (tis/sequence_mask/outlier_token_*/token_mask_*) "
                "but the batch has no rollout_logprobs: the engine must return per-token logprobs"
            )
        return mask, {}
    check_shapes("old_logprobs", old_logprobs, rollout_logprobs=rollout_logprobs, loss_mask=loss_mask)
    metrics = mismatch_metrics(old_logprobs, rollout_logprobs, loss_mask)
    with torch.no_grad():
        log_rho = zero_where_masked(as_float(old_logprobs) - as_float(rollout_logprobs), loss_mask)
        rho = log_rho.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT).exp()
        keep = mask > 0

        def outside(low: float | None, high: float | None) -> torch.Tensor:
            out = torch.zeros_like(keep)
            if low is not None:
                out = out | (rho < low)
            if high is not None:
                out = out | (rho > high)
            return out & keep

        if cfg.outlier_token_low is not None or cfg.outlier_token_high is not None:
            outlier_rows = outside(cfg.outlier_token_low, cfg.outlier_token_high).any(-1)
            metrics["mismatch/outlier_sample_frac"] = float(outlier_rows.to(mask.dtype).mean())
            keep = keep & ~outlier_rows.unsqueeze(-1)
        if cfg.token_mask_low is not None or cfg.token_mask_high is not None:
            keep = keep & ~outside(cfg.token_mask_low, cfg.token_mask_high)

        multiplier = keep.to(mask.dtype)
        if cfg.tis == "token":
            raw, cap = rho, cfg.token_tis_cap
        elif cfg.tis == "sequence":
            seq_log = masked_sum(log_rho, keep, dim=-1).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
            raw, cap = seq_log.exp().unsqueeze(-1).expand_as(log_rho), cfg.sequence_tis_cap
        if cfg.tis != "none":
            multiplier = multiplier * raw.clamp(max=cap)
            metrics["mismatch/tis_weight_mean"] = masked_scalar(raw.clamp(max=cap), keep)
            metrics["mismatch/tis_capped_frac"] = masked_scalar((raw > cap).to(mask.dtype), keep)

        if cfg.sequence_mask != "none":
            reduce = masked_mean if cfg.sequence_mask == "geometric" else masked_sum
            low, high = ((cfg.geo_mask_low, cfg.geo_mask_high) if cfg.sequence_mask == "geometric"
                         else (cfg.product_mask_low, cfg.product_mask_high))
            seq_log = reduce(log_rho, keep, dim=-1)
            # compare in log space: exp() of a long sequence's sum would overflow
            inside = (seq_log >= math.log(low)) & (seq_log <= math.log(high))
            keep = keep & inside.unsqueeze(-1)
        multiplier = torch.where(keep, multiplier, torch.zeros_like(multiplier))
        metrics["mismatch/masked_frac"] = masked_scalar((~keep).to(mask.dtype), loss_mask)
    return multiplier, metrics
