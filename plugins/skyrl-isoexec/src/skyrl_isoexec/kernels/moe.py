"""Canonical mixture-of-experts (Qwen3-MoE, Qwen3-Next): router, experts, combine.

A token's result depends only on that token: router logits come from the row-block GEMM, the
softmax normaliser and the top-k renormalisation are tree sums, each expert's GEMMs are row-block
GEMMs over exactly the tokens routed to it (so neither how many tokens an expert gets nor which
ones change a row), and the combine adds the top-k slots in slot order, in fp32.
"""

from __future__ import annotations

import torch

from skyrl_isoexec.kernels.elementwise import silu_mul
from skyrl_isoexec.kernels.linear import linear
from skyrl_isoexec.kernels.reduce import sigmoid, tree_sum


def router(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, K] in x.dtype, experts [T, K])`` from fp32 softmax over ``linear(x, weight)``."""
    logits = linear(x, weight).float()
    shifted = logits - logits.amax(-1, keepdim=True).detach()
    exps = torch.exp(shifted)
    probs = exps / tree_sum(exps).unsqueeze(-1)
    top, chosen = torch.topk(probs, top_k, dim=-1, sorted=True)
    if normalize:
        top = top / tree_sum(top).unsqueeze(-1)
    return top.to(x.dtype), chosen


def experts(x: torch.Tensor, chosen: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """``[T, K, H]``: slot ``(t, k)`` holds expert ``chosen[t, k]`` applied to token ``t``."""
    tokens, top_k = chosen.shape
    if tokens == 0:
        return x.new_zeros(0, top_k, down_proj.shape[1])
    slots = chosen.reshape(-1)
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots, minlength=gate_up_proj.shape[0]).tolist()
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        gate, up = linear(x[rows // top_k], gate_up_proj[expert]).chunk(2, dim=-1)
        outputs.append(linear(silu_mul(gate, up), down_proj[expert]))
    stacked = torch.cat(outputs)  # slots in `order`
    return stacked[torch.argsort(order)].view(tokens, top_k, -1)


def combine(
    expert_out: torch.Tensor,
    weights: torch.Tensor,
    shared_out: torch.Tensor | None = None,
    shared_gate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_k weights[:, k] * expert_out[:, k]`` in slot order (+ ``sigmoid(gate) * shared``), fp32,
    rounded once to the experts' dtype."""
    w = weights.float()
    acc = expert_out[:, 0].float() * w[:, :1]
    for k in range(1, expert_out.shape[1]):
        acc = acc + expert_out[:, k].float() * w[:, k : k + 1]
    if shared_out is not None:
        acc = acc + sigmoid(shared_gate_logits.float()) * shared_out.float()
    return acc.to(expert_out.dtype)
