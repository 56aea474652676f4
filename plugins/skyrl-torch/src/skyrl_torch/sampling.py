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
        self.unit_temperature = all(t in (0.0, 1.0) for t in temperatures)
        self.top_p = torch.tensor(top_ps, dtype=torch.float64, device=device).unsqueeze(1)
        self.top_k = torch.tensor(top_ks, device=device).unsqueeze(1)
        self.filtered = any(p < 1.0 for p in top_ps) or any(k > 0 for k in top_ks)


def choose_tokens(logits: torch.Tensor, rows: RowSampling, uniforms: torch.Tensor) -> torch.Tensor:
    """Next token per row of ``logits [n, V]``: argmax for greedy rows, otherwise a draw from
    softmax(logits / temperature) restricted to the top-k tokens and the top-p nucleus, using the
    row's uniform number in ``uniforms [n]`` (float64 in [0, 1))."""
    if rows.all_greedy:
        return logits.argmax(dim=-1)
    scaled = logits.float() if rows.unit_temperature else logits.float() / rows.temperature
    probs = torch.softmax(scaled, dim=-1)
    if rows.filtered:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        mass_before = probs.double().cumsum(dim=-1) - probs.double()
        # Keep a token while the mass strictly before it is below top_p (the first always stays).
        keep = mass_before < rows.top_p
        rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
        keep &= (rows.top_k <= 0) | (rank < rows.top_k)
        picked = order.gather(1, inverse_cdf(probs * keep, uniforms).unsqueeze(1)).squeeze(1)
    else:
        picked = inverse_cdf(probs, uniforms)
    return torch.where(rows.greedy, logits.argmax(dim=-1), picked) if rows.any_greedy else picked


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Per row of ``weights [n, V]`` (non-negative, any total), the first index whose cumulative
    weight exceeds ``uniforms * total``; never an index of zero weight.

    Two levels (block sums, then one block) so that the sequential scan covers V/block + block
    entries per row instead of V.
    """
    n, vocab = weights.shape
    if vocab % block:
        weights = torch.nn.functional.pad(weights, (0, block - vocab % block))
    blocks = weights.view(n, -1, block)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    target = (uniforms.to(torch.float64) * block_cdf[:, -1]).unsqueeze(1)
    # right=True: a block (or token) of zero weight never holds the first cdf value > target.
    chosen = torch.searchsorted(block_cdf, target, right=True).clamp(max=block_cdf.shape[1] - 1)
    before = torch.where(chosen > 0, block_cdf.gather(1, (chosen - 1).clamp(min=0)), 0.0)
    inner = blocks.gather(1, chosen.unsqueeze(-1).expand(n, 1, block)).squeeze(1)
    within = torch.searchsorted(inner.double().cumsum(dim=-1), target - before, right=True)
    # Rounding can leave the target just above the block's own sum: take its heaviest entry.
    within = torch.where(within >= block, inner.argmax(dim=-1, keepdim=True), within)
    return (chosen * block + within).squeeze(1)
