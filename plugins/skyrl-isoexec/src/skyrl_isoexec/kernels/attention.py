"""Canonical attention: each query reduces over exactly its visible keys, in a fixed block order.

Keys are re-indexed so that index 0 is the first key the sequence's last query sees (the start of
the sequence: left padding is skipped; a KV cache indexed by position needs no shift). Every query
must then see a prefix ``[0, n)`` of the keys (causal attention over padded batches and KV caches;
anything else is refused). In that frame:

- scores come from one GEMM per kv head, ``[rows, D] @ [D, slots]``, with the query rows padded
  to a multiple of 8 and the key slots to a power-of-two number of ``KEY_BLOCK`` blocks: measured
  (and tested), such a GEMM gives every (row, key) the bits it gets in an 8 x 64 GEMM, so a
  score depends only on its query and key, in fp32;
- softmax subtracts the exact max, exponentiates, and sums with ``tree_sum`` over the key slots
  padded to a power of two, so keys a query cannot see (masked: exact zeros) never change the sum;
- the weighted sum of values is one GEMM per key block (``[rows, KEY_BLOCK] @ [KEY_BLOCK, D]``: the
  reduction length is fixed), the block partials combined by ``tree_sum``.

So a query's output depends only on its query vector and its visible keys/values: identical for
a full forward over a padded batch and for one decode step against a KV cache of any length.
"""

from __future__ import annotations

import torch

from skyrl_isoexec.kernels.reduce import next_power_of_two, tree_sum

from skyrl_isoexec.constants import ATTENTION_KEY_BLOCK as KEY_BLOCK
from skyrl_isoexec.constants import ATTENTION_ROW_ALIGN as ROW_ALIGN


def _as_visible(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    # An additive mask: 0 where visible, the dtype's min (or -inf) where not.
    visible = mask == 0
    if not bool((visible | (mask <= torch.finfo(mask.dtype).min)).all()):
        raise ValueError("canonical attention accepts boolean masks or additive masks of 0 and -inf/min only")
    return visible


def _pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if x.shape[dim] == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat((x, x.new_zeros(shape)), dim=dim)


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``softmax(q k^T * scaling) v`` over visible keys; ``[B, H, Tq, D]`` x ``[B, Hkv, Tk, D]`` ->
    ``[B, Tq, H, D]`` in the query's dtype. Rows that see no key get zeros. Differentiable."""
    batch, heads, tq, dim = query.shape
    kv_heads, tk = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"canonical attention: {heads} query heads are not a multiple of {kv_heads} kv heads")
    rep = heads // kv_heads
    visible = _as_visible(visible)
    if visible.shape[1] != 1:
        visible = visible[:, :1]  # per-head masks are identical for causal/padding masks
    visible = visible.expand(batch, 1, tq, tk)[:, 0]  # [B, Tq, Tk]

    # Re-index keys so that key 0 is the first key the last query sees.
    start = torch.where(visible[:, -1].any(-1), visible[:, -1].float().argmax(-1), 0)  # [B]
    counts = visible.sum(-1)  # [B, Tq]
    if bool((start > 0).any()):
        index = (torch.arange(tk, device=key.device)[None, :] + start[:, None]).clamp(max=tk - 1)  # [B, Tk]
        gather = index[:, None, :, None].expand(batch, kv_heads, tk, dim)
        key = key.gather(2, gather)
        value = value.gather(2, gather)
        visible = visible.gather(2, index[:, None, :].expand(batch, tq, tk)) & (
            torch.arange(tk, device=key.device)[None, None, :] < (tk - start)[:, None, None]
        )
    prefix = torch.arange(tk, device=key.device)[None, None, :] < counts[..., None]
    if not bool((prefix == visible).all()):
        raise ValueError(
            "canonical attention needs every query to see a contiguous run of keys starting at its sequence start "
            "(causal attention with padding or a KV cache); got another mask"
        )

    kv_blocks = next_power_of_two(-(-tk // KEY_BLOCK))
    slots = kv_blocks * KEY_BLOCK
    # Query rows per kv head: [B*Hkv, rows, D], rows padded to a multiple of ROW_ALIGN.
    rows = rep * tq
    padded_rows = -(-rows // ROW_ALIGN) * ROW_ALIGN
    q = _pad_dim(query.float().reshape(batch * kv_heads, rows, dim), 1, padded_rows)
    k = _pad_dim(key.float().reshape(batch * kv_heads, tk, dim), 1, slots)
    v = _pad_dim(value.float().reshape(batch * kv_heads, tk, dim), 1, slots)

    # Scores: one GEMM per kv head, [rows, D] @ [D, slots]; rows a multiple of 8, slots of 64.
    scores = torch.bmm(q, k.transpose(1, 2)).view(batch, kv_heads, padded_rows, slots) * scaling

    # Visible slots per row: rows are (rep, Tq) flattened; counts are per (B, Tq).
    row_counts = counts[:, None, :].expand(batch, rep, tq).reshape(batch, 1, rows)
    row_counts = _pad_dim(row_counts, 2, padded_rows)
    seen = torch.arange(slots, device=scores.device)[None, None, None, :] < row_counts[..., None]
    scores = scores.masked_fill(~seen, float("-inf"))
    top = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)  # finite for empty rows
    weights = torch.exp(scores - top)
    total = tree_sum(weights)
    weights = weights / torch.where(total > 0, total, 1.0).unsqueeze(-1)

    # Weighted values: one GEMM per key block, [rows, KEY_BLOCK] @ [KEY_BLOCK, D], block partials
    # combined by a halving tree.
    blocks = weights.view(batch * kv_heads, padded_rows, kv_blocks, KEY_BLOCK).transpose(1, 2)
    partial = torch.bmm(
        blocks.reshape(-1, padded_rows, KEY_BLOCK), v.view(batch * kv_heads * kv_blocks, KEY_BLOCK, dim)
    ).view(batch * kv_heads, kv_blocks, padded_rows, dim)
    out = tree_sum(partial, dim=1)[:, :rows]  # [B*Hkv, rows, D]
    out = out.reshape(batch, heads, tq, dim).transpose(1, 2)
    return out.to(query.dtype).contiguous()
