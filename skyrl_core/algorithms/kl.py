"""KL between the policy and a reference: estimators, the loss term, the reward penalty and the
coefficient controllers.

The estimators (Schulman, "Approximating KL divergence", 2020) use samples from the policy ``pi``
and ``log_r = log(pi_ref / pi)`` per token:

- ``k1 = -log_r`` (unbiased, high variance, can be negative)
- ``k2 = 0.5 * log_r ** 2``
- ``k3 = (exp(log_r) - 1) - log_r`` (unbiased, low variance, >= 0)
- ``abs = |log_r|``
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from skyrl_core.algorithms.reductions import reduction_weights
from skyrl_core.algorithms.tensor_utils import as_float, check_shapes, masked_scalar, masked_sum, zero_where_masked

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
# exp(log_r) in k3 must stay finite for garbage or extreme log-ratios
_K3_LOG_RATIO_LIMIT = 20.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` of the given ``kind`` (elementwise, any shape)."""
    log_r = as_float(ref_logprobs) - as_float(logprobs)
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        log_r = log_r.clamp(-_K3_LOG_RATIO_LIMIT, _K3_LOG_RATIO_LIMIT)
        return log_r.exp() - 1 - log_r
    if kind == "abs":
        return log_r.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; allowed: {', '.join(KL_ESTIMATORS)}")


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    kind: str = "k3",
    *,
    token_weights: torch.Tensor | None = None,
    reduction: str = "token_mean",
    group_ids: Sequence[Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL as a loss term: ``sum(kl_estimate * w)`` (``w`` = ``token_weights`` or the ``reduction``).
    Multiply by the coefficient and add to the policy loss. Gradient flows through ``logprobs``."""
    check_shapes("logprobs", logprobs, ref_logprobs=ref_logprobs, loss_mask=loss_mask, token_weights=token_weights)
    logprobs = zero_where_masked(as_float(logprobs), loss_mask)
    ref_logprobs = zero_where_masked(as_float(ref_logprobs).detach(), loss_mask)
    kl = kl_estimate(logprobs, ref_logprobs, kind)
    weights = reduction_weights(loss_mask, reduction, group_ids) if token_weights is None else as_float(token_weights)
    return masked_sum(kl * weights.detach(), loss_mask), {"kl": masked_scalar(kl, loss_mask)}


def apply_kl_penalty(
    token_rewards: torch.Tensor, kl: torch.Tensor, coef: float, response_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """KL as a reward penalty: ``token_rewards - coef * kl`` (per token; 0 where ``response_mask`` is 0)."""
    check_shapes("token_rewards", token_rewards, kl=kl, response_mask=response_mask)
    penalised = as_float(token_rewards) - coef * as_float(kl).detach()
    return penalised if response_mask is None else zero_where_masked(penalised, response_mask)


class FixedKLController:
    """A constant KL coefficient (``update`` does nothing)."""

    def __init__(self, coef: float) -> None:
        if not coef >= 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef!r}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """The adaptive coefficient of Ziegler et al. 2019 (arXiv:1909.08593):
    ``e = clip(current_kl / target - 1, -0.2, 0.2)``; ``value *= 1 + e * n_steps / horizon``."""

    def __init__(self, init: float, target: float, horizon: int) -> None:
        if not init >= 0:
            raise ValueError(f"initial KL coefficient must be >= 0, got {init!r}")
        if not target > 0:
            raise ValueError(f"target KL must be > 0, got {target!r}")
        if not horizon > 0:
            raise ValueError(f"KL controller horizon must be > 0, got {horizon!r}")
        self.value = float(init)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt to ``current_kl`` measured over ``n_steps`` samples; return the new coefficient."""
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon
        return self.value
