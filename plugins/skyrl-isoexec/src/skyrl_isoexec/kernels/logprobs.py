"""Canonical token log-probabilities: fp32 log-softmax with a tree-ordered normaliser."""

from __future__ import annotations

import torch

from skyrl_isoexec.kernels.reduce import tree_sum


def logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)[token_ids]`` over the last dim, in fp32; differentiable.

    The max is exact in any order; the sum of exponentials is a ``tree_sum``, so a row's value does
    not depend on how many rows are computed together or on the thread split of the vocabulary.
    """
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    top = x.amax(-1, keepdim=True).detach()
    shifted = x - top
    total = tree_sum(torch.exp(shifted))
    chosen = shifted.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    return chosen - torch.log(total)
