"""Order-fixed reductions and elementwise functions whose bits do not depend on tensor layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` as a halving tree of elementwise adds over a zero-padded power-of-two length.

    The result for each output element depends only on the values summed, in their order along
    ``dim``: appending zeros (up to any power of two) leaves it unchanged bit for bit, because the
    first halving steps then add exact zeros. Elementwise adds are exactly rounded whatever the
    vectorisation or thread split, so the result is also thread-count invariant.

    Differentiable, with the gradient of any sum (the output's gradient broadcast over ``dim``):
    autograd through the halving steps would allocate a zero-filled copy of ``x`` per level.
    """
    if dim != -1 and dim != x.dim() - 1:
        x = x.movedim(dim, -1)
    if torch.is_grad_enabled() and x.requires_grad:
        return _TreeSum.apply(x)
    return _tree_sum_last(x)


def _tree_sum_last(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    width = next_power_of_two(n)
    if width != n:
        x = F.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


class _TreeSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return _tree_sum_last(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.unsqueeze(-1).expand(ctx.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) from exactly rounded ops (``torch.sigmoid``'s vector tail differs)."""
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) from exactly rounded ops (``F.silu``'s vector tail differs)."""
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log1p(exp(x)), linear above 20 like ``F.softplus``, from layout-independent ops."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))
