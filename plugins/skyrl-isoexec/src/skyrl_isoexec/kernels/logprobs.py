"""Canonical token log-probabilities: fp32 ``torch.log_softmax`` over the vocabulary.

PyTorch's CPU log-softmax over the last dim computes each row on its own (one thread per row,
vectorised over the vocabulary in an order fixed by the vocabulary size), so a row's bits do not
depend on the other rows or on the thread count: measured for vocabularies of 1000 to 151936 and
asserted by ``test_kernels.py``. (Version 1 summed the exponentials with ``tree_sum`` for the same
property at 2.6x the cost.)
"""

from __future__ import annotations

import torch


def full_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` over the last dim in fp32: the matrix every canonical
    logprob is gathered from (an engine that returns a full log-softmax uses this)."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    return torch.log_softmax(x, dim=-1)


def logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)[token_ids]`` over the last dim, in fp32; differentiable."""
    return full_log_softmax(logits, temperature).gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


# The full matrix form, for an engine that gathers every logprob it returns itself (vLLM's sampler).
logprobs.full_log_softmax = full_log_softmax
