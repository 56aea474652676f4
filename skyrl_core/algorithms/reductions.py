"""Loss reductions as per-token weights.

A reduction is expressed as weights ``w [B, R]`` such that the reduced loss is
``sum(per_token_loss * w)``. Computing ``w`` once over a whole mini-batch and passing each
micro-batch its slice (``token_weights=w[rows]``) makes the micro-batch losses sum *exactly* to the
mini-batch loss, whatever the split.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from skyrl_core.algorithms.options import LOSS_REDUCTIONS
from skyrl_core.algorithms.tensor_utils import group_index


def reduction_weights(
    loss_mask: torch.Tensor,
    reduction: str,
    group_ids: Sequence[Any] | None = None,
    norm_len: int | None = None,
    micro_batch_size: int | None = None,
) -> torch.Tensor:
    """Per-token weights ``[B, R]`` (0 where ``loss_mask`` is 0) realising ``reduction``:

    - ``token_mean``: ``1 / T`` with ``T`` the number of trained tokens in the batch.
    - ``sequence_mean``: ``1 / (L_i * S)``: mean over tokens of each sequence (``L_i`` trained
      tokens), then mean over the ``S`` sequences that have at least one trained token.
    - ``seq_mean_token_sum_norm`` (Dr. GRPO): ``1 / (B * norm_len)``: token sum of each sequence
      divided by a constant length, mean over all ``B`` rows. ``norm_len`` defaults to ``R``.
    - ``prompt_mean``: ``1 / (T_g * G)``: token mean within each prompt group ``g`` (``T_g``
      trained tokens), then mean over the ``G`` groups that have trained tokens. Needs ``group_ids``.
    - ``token_mean_legacy`` (upstream SkyRL's former ``token_mean``): token mean within each
      micro-batch, then mean over the ``M`` micro-batches: ``1 / (T_m * M)``. Micro-batches are the
      contiguous slices of ``micro_batch_size`` rows (the last may be shorter), as upstream slices
      them, whatever micro-batches a backend actually runs. Without ``micro_batch_size`` it is
      ``token_mean``.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, response_len], got shape {tuple(loss_mask.shape)}")
    mask = (loss_mask > 0).to(loss_mask.dtype if loss_mask.is_floating_point() else torch.float32)
    batch, response_len = mask.shape
    if reduction == "token_mean":
        return mask / mask.sum().clamp(min=1)
    if reduction == "sequence_mean":
        lengths = mask.sum(-1, keepdim=True)
        sequences = (lengths > 0).sum().clamp(min=1)
        return mask / lengths.clamp(min=1) / sequences
    if reduction == "seq_mean_token_sum_norm":
        if norm_len is not None and (isinstance(norm_len, bool) or not isinstance(norm_len, int) or norm_len <= 0):
            raise ValueError(f"norm_len must be a positive integer or None, got {norm_len!r}")
        return mask / (batch * (norm_len or response_len))
    if reduction == "prompt_mean":
        index, n_groups = group_index(group_ids, batch, device=mask.device)
        group_tokens = torch.zeros(n_groups, dtype=mask.dtype, device=mask.device).index_add(0, index, mask.sum(-1))
        groups = (group_tokens > 0).sum().clamp(min=1)
        return mask / group_tokens[index].clamp(min=1).unsqueeze(-1) / groups
    if reduction == "token_mean_legacy":
        size = batch if micro_batch_size is None else micro_batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"micro_batch_size must be a positive integer or None, got {micro_batch_size!r}")
        slices = mask.split(size)
        return torch.cat([part / part.sum().clamp(min=1) / len(slices) for part in slices])
    raise ValueError(f"unknown loss reduction {reduction!r}; allowed: {', '.join(LOSS_REDUCTIONS)}")
