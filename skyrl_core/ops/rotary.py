"""Rotary helpers shared by runtimes that map another framework's rotary layer onto the ``rope`` op."""

from __future__ import annotations

import torch


def default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    """transformers' default rotary inverse frequencies (``compute_default_rope_parameters``): the
    ``inv_freq`` a ``rope`` implementation receives for an unscaled rotary embedding."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(dtype=torch.float) / rotary_dim))
