"""Stock implementations. Most ops are "whatever the model's own modules do" (markers only);
``logprobs`` is computed by runtimes through ``skyrl_core.ops.token_logprobs``."""

from __future__ import annotations

import torch


def logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-softmax of ``logits / temperature`` over the vocabulary, gathered at ``token_ids``."""
    scaled = logits.float() if temperature == 1.0 else logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def _stock(*args, **kwargs):  # pragma: no cover - markers are never called
    raise RuntimeError("stock op marker: the model's own module computes this op")


embedding = linear = rms_norm = rope = attention = silu_mul = _stock
gdn_conv = gdn_core = moe_router = moe_experts = moe_combine = _stock
