"""The critic's clipped value loss (PPO with GAE)."""

from __future__ import annotations

import torch

from skyrl_core.algorithms.reductions import reduction_weights
from skyrl_core.algorithms.tensor_utils import as_float, check_shapes, masked_scalar, masked_sum, zero_where_masked


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``0.5 * max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = V_old + clamp(V - V_old, -clip, clip)``,
    reduced by ``token_weights`` (default: token mean over ``mask``). ``clip=None`` is unclipped.

    Where the clipped error is the larger one, the token gets zero gradient.
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"value clip must be > 0 or None, got {clip!r}")
    check_shapes("values", values, old_values=old_values, returns=returns, mask=mask, token_weights=token_weights)
    values = zero_where_masked(as_float(values), mask)
    old_values = zero_where_masked(as_float(old_values).detach(), mask)
    returns = zero_where_masked(as_float(returns).detach(), mask)
    unclipped = (values - returns) ** 2
    if clip is None:
        per_token, clipped_wins = 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_values - returns) ** 2
        per_token, clipped_wins = 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
    weights = reduction_weights(mask, "token_mean") if token_weights is None else as_float(token_weights).detach()
    loss = masked_sum(per_token * weights, mask)
    return loss, {
        "vf_clip_frac": masked_scalar(clipped_wins.to(values.dtype), mask),
        "value_mean": masked_scalar(values, mask),
        "value_error": masked_scalar(unclipped, mask),
    }
