"""Attention of short bf16 sequences on CPU as two batched products and an fp32 softmax.

PyTorch's CPU flash-attention kernel (what ``sdpa`` runs there) is fast forward, but its bf16
backward is not: at an RL micro-batch's shapes (16 rows x 9 heads x 78 positions x 64) forward and
backward took 29-37 ms against 10.4 ms for ``softmax(q k^T) v`` written out (bf16 products, fp32
softmax), 2 threads, AMD EPYC with AVX512-BF16 (2026-12-03). In fp32 both took 11-14 ms. Written out,
the ``[rows, heads, Tq, Tk]`` probabilities are kept for backward, so it is taken only while they
are small (``MAX_SCORES``); longer sequences keep the flash kernel, whose memory grows linearly.

Numerics: the scores and softmax are fp32 (the kernel accumulates in fp32 too); masked positions
get the most negative fp32 number, not -inf (-inf would make a query that sees no key, a padding
position, NaN, which reaches the gradients through ``0 * NaN``), and such a query's output is 0,
as the kernel gives it, so no gradient flows from it.
"""

from __future__ import annotations

from typing import Any

import torch

from skyrl_core.ops.hf import _causal_visible

# Scores of one call: B x heads x Tq x Tk elements (4M: 16 MiB of fp32 scores, 8 MiB of bf16
# probabilities kept per layer for backward). An RL micro-batch of 16 x 78 positions is 0.9M.
MAX_SCORES = 4 * 1024 * 1024


def applies(module: Any, query: torch.Tensor, key: torch.Tensor, mask: Any, dropout: float, kwargs: dict[str, Any]) -> bool:
    """Whether a call of transformers' ``sdpa`` attention can be computed here with its meaning
    unchanged: bf16 on CPU, a boolean mask (or none, causal), no dropout, nothing sdpa would add
    (position bias, a paged cache, attention weights asked for), and small enough scores."""
    if query.device.type != "cpu" or query.dtype != torch.bfloat16 or (dropout and module.training):
        return False
    if any(kwargs.get(name) is not None for name in ("position_bias", "cache")) or kwargs.get("output_attentions"):
        return False
    if mask is None and query.shape[2] != key.shape[2]:
        return False  # (sdpa aligns an unmasked causal query block its own way)
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4):
        return False
    if key.shape[-1] != query.shape[-1] or query.shape[1] % key.shape[1]:
        return False
    return query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2] <= MAX_SCORES


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor | None,
              scaling: float, is_causal: bool = True) -> torch.Tensor:
    """``softmax(q k^T * scaling, masked) v`` for ``query`` ``[B, H, Tq, D]`` and ``key``/``value``
    ``[B, KV, Tk, D]`` (KV divides H: query head h reads key head h // (H / KV)); ``visible``:
    boolean ``[B or 1, 1, Tq, Tk]``, or None for causal (``is_causal``) or full attention. Returns
    ``[B, Tq, H, D]`` contiguous, as transformers' attention functions do."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    if visible is None and is_causal and query.shape[2] > 1:  # (Tq == Tk: ``applies``)
        visible = _causal_visible(query.shape[2], key.shape[2], query.device)
    probs = torch.softmax(scores if visible is None else scores.masked_fill(~visible, torch.finfo(torch.float32).min), dim=-1)
    if visible is not None:  # a query that sees no key attends to nothing (0), as sdpa's CPU kernel has it
        probs = probs * visible.any(-1, keepdim=True)
    probs = probs.to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


# The name a model's config points at (``use_short_attention``): sdpa, with the calls ``applies``
# accepts computed here.
ATTENTION_NAME = "skyrl_sdpa_short"


def sdpa_or_short(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention function, except that the calls ``applies`` accepts are
    computed by ``attention``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if applies(module, query, key, attention_mask, dropout, kwargs):
        is_causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return attention(query, key, value, attention_mask, scale, causal), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def use_short_attention(model: Any) -> bool:
    """Point a transformers model that attends with ``sdpa`` (its config and sub-configs) at
    ``sdpa_or_short``, with sdpa's own masks; True if it did. Other implementations are left alone."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    config = getattr(model, "config", None)
    configs = [config, *(getattr(config, key, None) for key in (getattr(config, "sub_configs", {}) or {}))]
    configs = [c for c in configs if c is not None and getattr(c, "_attn_implementation", None) == "sdpa"]
    if not configs:
        return False
    AttentionInterface.register(ATTENTION_NAME, sdpa_or_short)
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    for c in configs:
        c._attn_implementation = ATTENTION_NAME
    return True
