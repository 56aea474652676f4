"""Rows that share a prompt computed with the prompt once: one packed sequence per prompt.

GRPO samples ``n`` responses per prompt, so a training micro-batch holds the same prompt up to
``n`` times, and the prompt is most of each row (an RL step on SmolLM2: 46 prompt tokens, 22
response tokens). Here the rows of one prompt become one sequence: the prompt, then every
response, each response seeing the prompt and itself only (a boolean mask; positions continue
from the prompt's end in every response, as in the row alone). Each response token's logprob is
read from the hidden state that predicts it: the prompt's last position for a response's first
token, the response's previous token otherwise. Backward sums the responses' gradients into the
one copy of the prompt's activations, which is what it does over the row copies too.

The function a row computes is unchanged; the products' shapes are not, so the bits agree with
row-at-a-time scoring within rounding, as any other batching does with stock kernels. An
attention implementation a plugin installs may promise bits that depend on where the keys sit
(IsoExec's canonical attention reduces over a fixed key layout), so callers take this path only
under the model's own attention (``prompt_sharing_allowed``), and only for models of full causal
attention (``model_allows_sharing``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch

from skyrl_core.ops.chunked_logprobs import DEFAULT_CHUNK_TOKENS, _head_replaced, output_head, scored_positions
from skyrl_core.ops.hf import ATTENTION_NAME as OP_SITES_ATTENTION
from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.short_attention import ATTENTION_NAME as SHORT_ATTENTION
from skyrl_core.ops.stock import is_stock


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> list[list[int]]:
    """Row indices grouped by identical real prompt tokens, groups in order of first row."""
    real = attention_mask[:, :prompt_len].bool()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in range(input_ids.shape[0]):
        groups.setdefault(tuple(input_ids[row, :prompt_len][real[row]].tolist()), []).append(row)
    return list(groups.values())


def prompt_sharing_allowed(ledger: OpLedger | None, sites: tuple[str, ...]) -> bool:
    """Whether the attention installed at every one of ``sites`` is the model's own (stock)."""
    return ledger is None or all(is_stock(ledger.impl("attention", site)) for site in sites)


# How each attention implementation takes a custom 4D mask (transformers passes one on as given):
# sdpa, the short CPU attention and the op sites' dispatch a boolean "may attend", eager an
# additive float mask.
_MASK_FORMS = {"sdpa": "bool", SHORT_ATTENTION: "bool", OP_SITES_ATTENTION: "bool", "eager": "additive"}


def _mask_for(model: Any, visible: torch.Tensor) -> torch.Tensor:
    config = getattr(model.config, "text_config", None) or model.config
    if _MASK_FORMS[config._attn_implementation] == "bool":
        return visible
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)


def model_allows_sharing(model: Any) -> bool:
    """Whether every layer of ``model`` attends with full causal attention, the one kind whose
    meaning a mask over a packed sequence keeps (no sliding window, no linear-attention or recurrent
    layer: their state would run from one response into the next), through an implementation that
    takes a custom mask (sdpa, eager)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if config is None:
        return False
    if getattr(config, "_attn_implementation", None) not in _MASK_FORMS:
        return False  # (flash-attention kernels take no custom mask)
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return False
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


# Attention runs far below the products' rate (masks, softmax, eager attention's kept probabilities
# are memory-bound): a query-key pair is counted at 4 times its FLOPs. Calibrated on the Tinker
# benchmark's SmolLM2 step (4-token prompts, 32-token responses), where packing whole groups, 1.5x
# cheaper by FLOPs, trained 5-10% slower than rows.
ATTENTION_PAIR_WEIGHT = 4.0
# Sharing is taken only when the model says it saves at least this share of the rows' cost: where
# the saving is smaller, the model's error is larger than it.
MIN_SAVING = 0.1


def token_cost_in_pairs(model: Any) -> float:
    """How many attention query-key pairs cost what one token's products in a decoder layer do:
    ``(q, k, v, o projections + MLP) / (scores + weighted sum)`` in FLOPs, over
    ``ATTENTION_PAIR_WEIGHT`` (768 for SmolLM2)."""
    config = getattr(model.config, "text_config", None) or model.config
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    products = hidden * (2 * heads * head_dim + 2 * kv * head_dim) + 3 * hidden * intermediate
    return products / (2 * heads * head_dim) / ATTENTION_PAIR_WEIGHT


def _packed_cost(prefix: int, lengths: list[int], pair_cost: float) -> float:
    """Products (counted in pairs) and attention pairs of one sequence: ``prefix`` once, then each
    row's rest (``lengths``: whole rows, prefix included). A row alone: ``prefix`` its length."""
    packed = prefix + sum(n - prefix for n in lengths)
    return packed * pair_cost + packed * packed


def _cheaper(joined: float, apart: float) -> bool:
    return joined < (1.0 - MIN_SAVING) * apart


def worth_sharing(prompt_len: int, response_lens: list[int], pair_cost: float) -> bool:
    """Whether one sequence for a prompt's rows costs clearly less than the rows (by ``MIN_SAVING``):
    it saves the prompt's products for every row but one, and its attention covers the whole packed
    square (the masked pairs between responses included) where the rows cover their own squares.
    Long responses behind a short prompt are cheaper as rows."""
    lengths = [prompt_len + n for n in response_lens]
    apart = sum(_packed_cost(n, [n], pair_cost) for n in lengths)
    return len(lengths) > 1 and _cheaper(_packed_cost(prompt_len, lengths, pair_cost), apart)


def sharing_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, pair_cost: float) -> list[list[int]]:
    """``prompt_groups``, with a group that is cheaper as rows (``worth_sharing``) split into rows."""
    mask = attention_mask.bool()
    prompt_lens = mask[:, :prompt_len].sum(-1).tolist()
    response_lens = mask[:, prompt_len:].sum(-1).tolist()
    out: list[list[int]] = []
    for group in prompt_groups(input_ids, attention_mask, prompt_len):
        if worth_sharing(prompt_lens[group[0]], [response_lens[r] for r in group], pair_cost):
            out.append(group)
        else:
            out.extend([row] for row in group)
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def prefix_groups(rows: Sequence[Sequence[int]], pair_cost: float) -> list[tuple[list[int], int]]:
    """Groups of ``rows`` (token sequences, in no particular order) computed as one sequence each,
    with the length of the prefix they share: rows in lexicographic order, each joining the group
    before it where one sequence over the prefix they all share costs clearly less than the group
    and the row apart (``worth_sharing``'s costs and margin). A row alone is a group with its
    whole length as prefix. For data that do not mark their prompt (the Tinker API's datums)."""
    tokens = [list(r) for r in rows]
    order = sorted(range(len(tokens)), key=lambda i: tokens[i])
    groups: list[tuple[list[int], int]] = []
    for i in order:
        if groups:
            members, prefix = groups[-1]
            common = min(prefix, _common_prefix(tokens[members[-1]], tokens[i]))
            lengths = [len(tokens[m]) for m in members]
            joined = _packed_cost(common, lengths + [len(tokens[i])], pair_cost)
            apart = _packed_cost(prefix, lengths, pair_cost) + _packed_cost(len(tokens[i]), [len(tokens[i])], pair_cost)
            if common > 0 and _cheaper(joined, apart):
                groups[-1] = (members + [i], common)
                continue
        groups.append(([i], len(tokens[i])))
    return groups


def groups_to_share(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, where: torch.Tensor,
                    pair_cost: float) -> list[list[int]] | None:
    """The groups ``shared_prompt_logprobs`` computes (``sharing_groups``), or None where sharing
    does not apply or saves nothing: no group of two rows or more is worth one sequence, a prompt
    has no token, or a position to score is not a real response token (responses right-padded from
    the prompt's end). The caller checks ``prompt_sharing_allowed``."""
    mask = attention_mask.bool()
    response = mask[:, prompt_len:]
    if not bool(mask[:, :prompt_len].any(-1).all()) or bool((where.bool() & ~response).any()):
        return None
    lengths = response.sum(-1, keepdim=True)
    columns = torch.arange(response.shape[1], device=response.device)
    if not bool((response == (columns[None, :] < lengths)).all()):  # responses start at the prompt's end
        return None
    groups = sharing_groups(input_ids, attention_mask, prompt_len, pair_cost)
    return groups if any(len(g) > 1 for g in groups) else None


@attrs.frozen
class PackedRows:
    """Rows packed one sequence per group, each group's shared prefix once: ``input_ids`` and
    ``position_ids`` ``[G, T]``, ``visible`` ``[G, 1, T, T]`` (a suffix sees the prefix and itself;
    padding sees itself only), and ``index`` ``[B, L]``: the flat position (into ``G * T``) that
    holds token ``t`` of row ``b`` (-1 past the row's end)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    visible: torch.Tensor
    index: torch.Tensor


def pack_rows(rows: list[torch.Tensor], groups: list[list[int]], prefix_lens: list[int], pad_token_id: int = 0) -> PackedRows:
    """``rows`` (each a 1-D tensor of real tokens) packed per group of ``groups``: the group's first
    ``prefix_lens[g]`` tokens (the same in each of its rows) once, then each row's remaining tokens,
    whose positions continue from the prefix's end as in the row alone."""
    longest = max(len(r) for r in rows)
    index = torch.full((len(rows), longest), -1, dtype=torch.long)
    sequences, positions, segments = [], [], []
    for rows_of_group, prefix in zip(groups, prefix_lens):
        tokens = [rows[rows_of_group[0]][:prefix]]
        pos, seg = [torch.arange(prefix)], [torch.zeros(prefix, dtype=torch.long)]
        offset = prefix
        for i, row in enumerate(rows_of_group, start=1):
            suffix = rows[row][prefix:]
            n = len(suffix)
            tokens.append(suffix)
            pos.append(torch.arange(prefix, prefix + n))
            seg.append(torch.full((n,), i, dtype=torch.long))
            index[row, :prefix] = torch.arange(prefix)
            index[row, prefix:prefix + n] = torch.arange(offset, offset + n)
            offset += n
        sequences.append(torch.cat(tokens))
        positions.append(torch.cat(pos))
        segments.append(torch.cat(seg))
    T = max(len(s) for s in sequences)
    G = len(groups)
    packed_ids = torch.full((G, T), pad_token_id, dtype=rows[0].dtype)
    packed_pos = torch.zeros((G, T), dtype=torch.long)
    packed_seg = torch.full((G, T), -1, dtype=torch.long)
    for g, (s, p, k) in enumerate(zip(sequences, positions, segments)):
        packed_ids[g, :len(s)], packed_pos[g, :len(s)], packed_seg[g, :len(s)] = s, p, k
    for g, rows_of_group in enumerate(groups):
        for row in rows_of_group:
            real = index[row] >= 0
            index[row][real] += g * T
    query, key = packed_seg[:, :, None], packed_seg[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    visible = causal[None] & (key >= 0) & ((key == 0) | (key == query))
    visible |= torch.eye(T, dtype=torch.bool)[None] & (query < 0)  # padding sees itself (no empty row)
    return PackedRows(packed_ids, packed_pos, visible[:, None], index)


def run_packed(model: Any, packed: PackedRows, consume: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``consume(hidden)`` for the final hidden states ``[G, T, H]`` of ``packed``, run in place of
    the output embedding inside the model's forward (``chunked_logprobs.with_final_hidden``: hooks
    on the model, FSDP's among them, still wrap it)."""
    device = next(model.parameters()).device
    with _head_replaced(model, consume):
        return model(input_ids=packed.input_ids.to(device), attention_mask=_mask_for(model, packed.visible.to(device)),
                     position_ids=packed.position_ids.to(device), use_cache=False).logits


def pack_shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                        groups: list[list[int]], pad_token_id: int = 0) -> PackedRows:
    """A ``[B, P + R]`` batch (left-padded prompts, right-padded responses) packed by ``groups`` of
    rows sharing their prompt."""
    mask = attention_mask.bool()
    rows = [input_ids[b][mask[b]] for b in range(input_ids.shape[0])]
    prompt_lens = mask[:, :prompt_len].sum(-1).tolist()
    return pack_rows(rows, groups, [prompt_lens[g[0]] for g in groups], pad_token_id)


def shared_prompt_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    where: torch.Tensor,
    *,
    ledger: OpLedger | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
    groups: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``response_logprobs``'s result (logprobs ``[B, R]``, fp32, 0 where ``where`` is false; the
    entropy when asked) with each group of ``groups`` (rows sharing a prompt; default: those
    ``groups_to_share`` gives at the model's ``token_cost_in_pairs``) computed as one sequence."""
    R = response_len
    P = input_ids.shape[1] - R
    where = where.bool()
    if groups is None:
        groups = sharing_groups(input_ids, attention_mask, P, token_cost_in_pairs(model))
    packed = pack_shared_prompts(input_ids, attention_mask, P, groups)
    # response token j of row b is row token prompt_len_b + j, predicted by row token prompt_len_b + j - 1
    prompt_lens = attention_mask[:, :P].sum(-1)
    rows, columns = where.nonzero(as_tuple=True)
    index = packed.index[rows.cpu(), (prompt_lens[rows] + columns - 1).cpu()].to(input_ids.device)
    head = output_head(model)
    targets = input_ids[:, P:][where]

    def score(hidden: torch.Tensor) -> torch.Tensor:
        chosen = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
        return scored_positions(chosen, head, targets, where, ledger=ledger, temperature=temperature,
                                chunk_tokens=chunk_tokens, with_entropy=with_entropy)

    scored = run_packed(model, packed, score)
    return scored[0], (scored[1] if with_entropy else None)
