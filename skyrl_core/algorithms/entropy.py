"""Token entropy of the policy, and the entropy bonus term."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from skyrl_core.algorithms.reductions import reduction_weights
from skyrl_core.algorithms.tensor_utils import as_float, check_shapes, masked_scalar, masked_sum


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(z) - sum(softmax(z) * z)`` over the last (vocabulary) dimension."""
    logits = as_float(logits)
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def entropy_bonus(
    entropy: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
    *,
    token_weights: torch.Tensor | None = None,
    reduction: str = "token_mean",
    group_ids: Sequence[Any] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss term ``-coef * sum(entropy * w)`` (adding it to the loss rewards entropy), with
    ``w`` = ``token_weights`` or the ``reduction``; metric ``entropy`` is the token mean."""
    check_shapes("entropy", entropy, loss_mask=loss_mask, token_weights=token_weights)
    entropy = as_float(entropy)
    weights = reduction_weights(loss_mask, reduction, group_ids) if token_weights is None else as_float(token_weights)
    return -coef * masked_sum(entropy * weights.detach(), loss_mask), {"entropy": masked_scalar(entropy, loss_mask)}
