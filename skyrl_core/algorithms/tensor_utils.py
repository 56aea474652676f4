"""Small masked-tensor helpers shared by the losses and estimators."""

from __future__ import annotations

from typing import Any, Sequence

import torch


def as_float(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 when it already is (tests use float64 for exact references)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def check_shapes(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Every given tensor must have the shape of ``reference`` (a ``[B, R]`` tensor)."""
    if reference.dim() != 2:
        raise ValueError(f"{reference_name} must be a [batch, response_len] tensor, got shape {tuple(reference.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {reference_name} has {tuple(reference.shape)}; "
                "every per-token tensor must be [batch, response_len]"
            )


def zero_where_masked(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t`` with untrained positions set to 0, so garbage (inf, nan) there never reaches a result
    or a gradient (``torch.where`` routes no gradient to the unselected branch)."""
    return torch.where(mask > 0, t, torch.zeros((), dtype=t.dtype, device=t.device))


def masked_sum(t: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    masked = zero_where_masked(t, mask)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(t: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``t`` over positions where ``mask > 0`` (0 where there are none)."""
    count = (mask > 0).to(t.dtype)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(t, mask, dim) / count.clamp(min=1)


def masked_whiten(t: torch.Tensor, mask: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """``(t - mean) / (std + epsilon)`` over the masked positions (unbiased std), 0 elsewhere."""
    n = (mask > 0).sum()
    mean = masked_mean(t, mask)
    centered = zero_where_masked(t - mean, mask)
    var = (centered**2).sum() / (n - 1).clamp(min=1)
    return zero_where_masked(centered / (var.sqrt() + epsilon), mask)


def masked_scalar(t: torch.Tensor, mask: torch.Tensor, reduce: str = "mean") -> float:
    """A metric: ``mean``/``max``/``min`` of ``t`` over masked positions, as a Python float (0.0 if none)."""
    with torch.no_grad():
        selected = t.detach()[mask > 0]
        if selected.numel() == 0:
            return 0.0
        return float(getattr(selected, reduce)())


def group_index(group_ids: Sequence[Any], batch_size: int, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map group ids (any hashables, length ``batch_size``) to ``(index [B] long, number of groups)``,
    groups numbered in order of first appearance."""
    if group_ids is None:
        raise ValueError("group_ids is required here: pass one id per sample (samples of one prompt share an id)")
    ids = list(group_ids)
    if len(ids) != batch_size:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has {batch_size} samples")
    numbering: dict[Any, int] = {}
    index = [numbering.setdefault(g, len(numbering)) for g in ids]
    return torch.tensor(index, dtype=torch.long, device=device), len(numbering)
