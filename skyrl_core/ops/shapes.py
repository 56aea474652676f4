"""Reshaping an op's fresh result without making it a view.

A GEMM on ``[..., K]`` inputs is computed on a 2-D ``[M, K]`` view and its ``[M, N]`` result is
reshaped back: with ``Tensor.reshape`` that result is a *view* of the 2-D buffer. When it is what
an FSDP2-wrapped module returns (the ``lm_head`` logits of the root module), FSDP2 warns on every
step that an in-place op on that view would skip its pre-backward hook. Nothing else holds the 2-D
buffer, so the result need not be a view at all: ``aten._unsafe_view`` gives the same storage as
a plain (base) tensor, exactly as ``torch.matmul`` and ``F.linear`` return theirs; autograd
differentiates it as a reshape.
"""

from __future__ import annotations

from typing import Sequence

import torch


def reshape_fresh(result: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``result.view(shape)`` that is not a view; only for a ``result`` no one else holds."""
    return torch.ops.aten._unsafe_view(result, tuple(shape))
