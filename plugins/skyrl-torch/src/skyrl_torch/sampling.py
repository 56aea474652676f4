"""Choosing the next token of every row from its logits, each row with its own settings and RNG.

Sampling is inverse-CDF: each row draws one uniform number from its own ``torch.Generator`` and
picks the first token whose cumulative probability exceeds it. The draw depends only on the
sample's seed and how many tokens it has drawn, so a sample's tokens do not depend on which other
rows share the batch.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def sample_seed(request_seed: int, sample_index: int) -> int:
    """A well-mixed 63-bit seed for sample ``sample_index`` of a request seeded ``request_seed``
    (SplitMix64 finaliser, so neighbouring seeds and indices give unrelated streams)."""
    z = (request_seed * 0x9E3779B97F4A7C15 + sample_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class RowSampling:
    """The per-row settings of the rows being sampled, as tensors, built once per batch layout."""

    def __init__(self, temperatures: list[float], top_ps: list[float], top_ks: list[int], device: torch.device):
        self.greedy = torch.tensor([t == 0.0 for t in temperatures], device=device)
        self.all_greedy = bool(self.greedy.all())
        self.any_greedy = bool(self.greedy.any())
        self.temperature = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=device).unsqueeze(1)
        self.top_p = torch.tensor(top_ps, dtype=torch.float64, device=device).unsqueeze(1)
        self.top_k = torch.tensor(top_ks, device=device).unsqueeze(1)
        self.filtered = any(p < 1.0 for p in top_ps) or any(k > 0 for k in top_ks)


def choose_tokens(logits: torch.Tensor, rows: RowSampling, uniforms: torch.Tensor) -> torch.Tensor:
    """Next token per row of ``logits [n, V]``: argmax for greedy rows, otherwise a draw from
    softmax(logits / temperature) restricted to the top-k tokens and the top-p nucleus, using the
    row's uniform number in ``uniforms [n]`` (float64 in [0, 1))."""
    argmax = logits.argmax(dim=-1)
    if rows.all_greedy:
        return argmax
    probs = torch.softmax(logits.float() / rows.temperature, dim=-1)
    if rows.filtered:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        cdf = probs.double().cumsum(dim=-1)
        # Keep a token while the mass strictly before it is below top_p (the first always stays).
        keep = (cdf - probs.double()) < rows.top_p
        rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        keep &= (rows.top_k <= 0) | (rank < rows.top_k)
        cdf = (probs.double() * keep).cumsum(dim=-1)
    else:
        order = None
        cdf = probs.double().cumsum(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Rounding can put the target at the very top of the CDF; fall back to the likeliest token.
    overflow = picked >= cdf.shape[-1]
    picked = picked.clamp(max=cdf.shape[-1] - 1)
    if order is not None:
        picked = order.gather(1, picked.unsqueeze(1)).squeeze(1)
        picked = torch.where(overflow, order[:, 0], picked)
    else:
        picked = torch.where(overflow, argmax, picked)
    return torch.where(rows.greedy, argmax, picked) if rows.any_greedy else picked
