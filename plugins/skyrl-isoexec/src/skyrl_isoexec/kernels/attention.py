"""Canonical attention: each query reduces over exactly its visible keys, in a fixed block order.

Keys are re-indexed so that index 0 is the first key the sequence's last query sees (the start of
the sequence: left padding is skipped; a KV cache indexed by position needs no shift). Every query
must then see a prefix ``[0, n)`` of the keys (causal attention over padded batches and KV caches;
anything else is refused). In that frame:

- scores come from one GEMM per kv head, ``[rows, D] @ [D, slots]``, with the query rows padded
  to a multiple of 8 (4 in practice: same bits, see ``QUERY_ROW_PAD``) and the key slots to a
  power-of-two number of ``KEY_BLOCK`` blocks: measured (and tested), such a GEMM gives every
  (row, key) the bits it gets in an 8 x 64 GEMM, so a score depends only on its query and key, in
  fp32;
- softmax is torch's fp32 softmax over the key slots, masked slots at -inf (version 3; version 2
  summed exponentials with ``tree_sum``). It computes each row alone, vectorised in an order fixed
  by the row length, and appending whole 64-slot blocks of -inf leaves a row's bits unchanged:
  measured, and asserted by ``test_kernels.py``, so keys a query cannot see never change its
  weights; rows that see no key get zero weights;
- the weighted sum of values is one GEMM per key block (``[rows, KEY_BLOCK] @ [KEY_BLOCK, D]``: the
  reduction length is fixed), the block partials combined by a halving tree over the
  power-of-two block count.

So a query's output depends only on its query vector and its visible keys/values: identical for
a full forward over a padded batch and for one decode step against a KV cache of any length.

Only the forward is canonical. The backward is the textbook one (recompute the probabilities with
one masked softmax, then four batched products), not autograd through the blocked forward: the
padding, tree sums and per-block products would cost the trainer several times the forward again,
and no claim rests on the gradient's bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from skyrl_isoexec.kernels.reduce import next_power_of_two

from skyrl_isoexec.constants import ATTENTION_KEY_BLOCK as KEY_BLOCK
from skyrl_isoexec.constants import ATTENTION_ROW_ALIGN as ROW_ALIGN

# Query rows are padded to a multiple of this for the GEMMs. The definition is the bits of 8-row
# GEMMs (ROW_ALIGN); torch.bmm gives every row of any multiple of 4 rows those same bits (measured,
# asserted by ``test_score_gemm_property_the_attention_relies_on``), and a decode step's 3 or 4
# query rows per kv head then pay for 4 rows, not 8.
QUERY_ROW_PAD = 4


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
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _CanonicalAttention.apply(query, key, value, visible, scaling)
    return canonical_forward(query, key, value, visible, scaling)


class _CanonicalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, visible, scaling):
        out = canonical_forward(query, key, value, visible, scaling)
        ctx.save_for_backward(query, key, value, visible, out)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, visible, out = ctx.saved_tensors
        grads = attention_grads(grad, query, key, value, visible, out, ctx.scaling)
        wanted = ctx.needs_input_grad
        return (*(g if w else None for g, w in zip(grads, wanted)), None, None)


def attention_grads(
    grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
    out: torch.Tensor, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``attention`` w.r.t. query, key and value (in their dtypes), computed in fp32 with
    the query heads of each kv head stacked as rows, so keys/values are never repeated."""
    batch, heads, tq, dim = query.shape
    kv_heads, tk = key.shape[1], key.shape[2]
    rows = heads // kv_heads * tq
    visible = _as_visible(visible)[:, :1].expand(batch, 1, tq, tk)
    visible = visible.repeat(1, 1, heads // kv_heads, 1)  # [B, 1, rows, Tk]: row = (head in group, query)
    q = query.float().reshape(batch, kv_heads, rows, dim)
    k, v = key.float(), value.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scaling).masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # rows that see nothing: zeros, as forward
    d_out = grad.float().transpose(1, 2).reshape(batch, kv_heads, rows, dim)
    o = out.float().transpose(1, 2).reshape(batch, kv_heads, rows, dim)
    d_value = torch.matmul(probs.transpose(-1, -2), d_out)
    d_probs = torch.matmul(d_out, v.transpose(-1, -2))
    d_scores = probs.mul_(d_probs.sub_((d_out * o).sum(-1, keepdim=True))).mul_(scaling)
    d_query = torch.matmul(d_scores, k).reshape(batch, heads, tq, dim)
    d_key = torch.matmul(d_scores.transpose(-1, -2), q)
    return d_query.to(query.dtype), d_key.to(key.dtype), d_value.to(value.dtype)


def scores_to_weights(scores: torch.Tensor, rows: int, hidden: torch.Tensor, empty: torch.Tensor | None) -> torch.Tensor:
    """Canonical attention weights from fp32 scaled ``scores`` ``[B, Hkv, padded rows, slots]`` (slots
    a multiple of ``KEY_BLOCK``; overwritten): torch's softmax over the slots of the ``rows`` real
    rows, ``hidden`` ``[B, Hkv, rows, slots]`` slots at -inf; rows that see no key (``empty``
    ``[B, 1, rows, 1]``, or None when there are none) and padding rows weigh 0."""
    weights = torch.softmax(scores[:, :, :rows].masked_fill_(hidden, float("-inf")), dim=-1)
    if empty is not None:
        weights.masked_fill_(empty, 0.0)
    padded_rows = scores.shape[2]
    return weights if padded_rows == rows else F.pad(weights, (0, 0, 0, padded_rows - rows))


def weighted_values(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Canonical ``weights @ values`` for ``[N, rows, slots]`` x ``[N, slots, D]`` fp32 (rows a multiple
    of ``QUERY_ROW_PAD``, slots of ``KEY_BLOCK``): one GEMM per key block, the block partials combined
    by a halving tree over the power-of-two number of blocks the definition pads to. A block past
    the keys would add an exact +0 partial: ``x + 0.0`` keeps every bit of x but turns -0 into +0."""
    used = weights.shape[-1] // KEY_BLOCK
    partials: list[torch.Tensor | None] = [
        torch.bmm(weights[:, :, j * KEY_BLOCK : (j + 1) * KEY_BLOCK], values[:, j * KEY_BLOCK : (j + 1) * KEY_BLOCK])
        for j in range(used)
    ]
    partials += [None] * (next_power_of_two(used) - used)
    while len(partials) > 1:
        half = len(partials) // 2
        partials = [a + b if b is not None else a + 0.0 for a, b in zip(partials[:half], partials[half:])]
    return partials[0]


class _MaskPlan:
    """What a mask decides for one call shape, shared by every layer of a forward (they pass the
    same mask tensor): the key re-indexing, and which slots each query row sees."""

    def __init__(self, visible: torch.Tensor, batch: int, tq: int, tk: int, rep: int, kv_heads: int, device) -> None:
        visible = _as_visible(visible)
        if visible.shape[1] != 1:
            visible = visible[:, :1]  # per-head masks are identical for causal/padding masks
        visible = visible.expand(batch, 1, tq, tk)[:, 0]  # [B, Tq, Tk]
        start = torch.where(visible[:, -1].any(-1), visible[:, -1].float().argmax(-1), 0)  # [B]
        counts = visible.sum(-1)  # [B, Tq]
        self.index = None
        if bool((start > 0).any()):
            self.index = (torch.arange(tk, device=device)[None, :] + start[:, None]).clamp(max=tk - 1)  # [B, Tk]
            visible = visible.gather(2, self.index[:, None, :].expand(batch, tq, tk)) & (
                torch.arange(tk, device=device)[None, None, :] < (tk - start)[:, None, None]
            )
        prefix = torch.arange(tk, device=device)[None, None, :] < counts[..., None]
        if not bool((prefix == visible).all()):
            raise ValueError(
                "canonical attention needs every query to see a contiguous run of keys starting at its sequence "
                "start (causal attention with padding or a KV cache); got another mask"
            )
        # The definition pads keys to a power-of-two number of KEY_BLOCK blocks; only the blocks
        # that hold keys are computed: the score GEMM's bits per (row, key) do not depend on the
        # slot count, the softmax ignores appended masked blocks, and a missing block's partial is
        # an exact zero in the combine.
        self.slots = -(-tk // KEY_BLOCK) * KEY_BLOCK
        self.rows = rep * tq
        self.padded_rows = -(-self.rows // QUERY_ROW_PAD) * QUERY_ROW_PAD
        # Visible slots per row: rows are (rep, Tq) flattened; counts are per (B, Tq).
        row_counts = counts[:, None, :].expand(batch, rep, tq).reshape(batch, 1, self.rows)
        hidden = torch.arange(self.slots, device=device)[None, None, None, :] >= row_counts[..., None]
        self.hidden = hidden.expand(batch, kv_heads, self.rows, self.slots).contiguous()  # (masked_fill is slow to broadcast)
        empty = (row_counts == 0)[..., None]  # [B, 1, rows, 1]
        self.empty = empty if bool(empty.any()) else None


# The last small plan, with the mask it was made from (held, so its id cannot be reused) and the
# mask's version (inference tensors have none: callers do not modify a mask between layers). Large
# plans (long training sequences) are not kept past their call.
_last_plan: list[tuple | None] = [None]
_CACHED_PLAN_SLOTS = 1 << 22


def _mask_plan(visible: torch.Tensor, batch: int, tq: int, tk: int, rep: int, kv_heads: int, device) -> _MaskPlan:
    shape = (batch, tq, tk, rep, kv_heads, str(device))
    version = None if visible.is_inference() else visible._version
    last = _last_plan[0]
    if last is not None and last[0] is visible and last[1] == version and last[2] == shape:
        return last[3]
    plan = _MaskPlan(visible, batch, tq, tk, rep, kv_heads, device)
    _last_plan[0] = (visible, version, shape, plan) if plan.hidden.numel() <= _CACHED_PLAN_SLOTS else None
    return plan


def canonical_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The canonical forward of ``attention`` (no autograd graph of its own steps needed)."""
    batch, heads, tq, dim = query.shape
    kv_heads, tk = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"canonical attention: {heads} query heads are not a multiple of {kv_heads} kv heads")
    rep = heads // kv_heads
    plan = _mask_plan(visible, batch, tq, tk, rep, kv_heads, key.device)
    if plan.index is not None:  # re-index keys so that key 0 is the first key the last query sees
        gather = plan.index[:, None, :, None].expand(batch, kv_heads, tk, dim)
        key = key.gather(2, gather)
        value = value.gather(2, gather)
    slots = plan.slots
    rows, padded_rows = plan.rows, plan.padded_rows
    # Query rows per kv head: [B*Hkv, rows, D], rows padded to a multiple of QUERY_ROW_PAD.
    q = _pad_dim(query.float().reshape(batch * kv_heads, rows, dim), 1, padded_rows)
    # Contiguous copies: a strided view (a KV cache read in place) runs the batched products slower.
    k = _pad_dim(key.float().reshape(batch * kv_heads, tk, dim).contiguous(), 1, slots)
    v = _pad_dim(value.float().reshape(batch * kv_heads, tk, dim).contiguous(), 1, slots)

    # Scores: one GEMM per kv head, [rows, D] @ [D, slots]; rows a multiple of 8, slots of 64.
    scores = torch.bmm(q, k.transpose(1, 2)).view(batch, kv_heads, padded_rows, slots).mul_(scaling)

    # The softmax runs on the real rows only; the padding rows (they see no key) get zero weights.
    weights = scores_to_weights(scores, rows, plan.hidden, plan.empty)
    out = weighted_values(weights.view(batch * kv_heads, padded_rows, slots), v)[:, :rows]  # [B*Hkv, rows, D]
    out = out.reshape(batch, heads, tq, dim).transpose(1, 2)
    return out.to(query.dtype).contiguous()
