"""Rows that share a prompt, computed as one sequence with the prompt once: the logprobs, entropy and
gradients of every row as computed row by row; the mask is what keeps the responses apart; the
path is taken only where it keeps the model's meaning."""

from __future__ import annotations

import attrs
import pytest
import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.ops.chunked_logprobs import response_logprobs
from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.shared_prompts import (
    groups_to_share,
    model_allows_sharing,
    pack_shared_prompts,
    prefix_groups,
    prompt_groups,
    prompt_sharing_allowed,
    shared_prompt_logprobs,
    token_cost_in_pairs,
    worth_sharing,
)
from skyrl_core.ops.stock import DEFAULT_IMPLS
from skyrl_core.testing.backend_contract import TINY_QWEN3, make_batch

VOCAB = TINY_QWEN3["vocab_size"]
COST = 48.0  # token_cost_in_pairs of TINY_QWEN3: both groups of _grouped_batch are worth sharing


def _model(attention="sdpa"):
    model = load_causal_lm(ModelConfig(config=dict(TINY_QWEN3)), seed=0).eval()
    model.set_attn_implementation(attention)
    return model


def _grouped_batch():
    """Three prompts (5, 9 and 2 tokens) with 3, 1 and 4 responses of 1-7 tokens, rows interleaved."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 2)]
    response_lengths = {0: (3, 7, 1), 1: (4,), 2: (6, 2, 5, 1)}
    rows = [(p, n) for p, lengths in response_lengths.items() for n in lengths]
    order = [0, 3, 4, 1, 5, 2, 6, 7]  # groups interleaved, as a sorted plan may leave them
    rows = [rows[i] for i in order]
    sequences = ([prompts[p] for p, _ in rows], [torch.randint(1, VOCAB, (n,), generator=g).tolist() for _, n in rows])
    return make_batch(*sequences), [p for p, _ in rows]


def test_rows_are_grouped_by_their_real_prompt_tokens():
    batch, prompt_of_row = _grouped_batch()
    groups = prompt_groups(batch.input_ids, batch.attention_mask, batch.prompt_len)
    assert groups == [[0, 3, 5], [1], [2, 4, 6, 7]]
    assert all(len({prompt_of_row[r] for r in group}) == 1 for group in groups)


# sdpa takes a boolean mask, eager an additive one; at a pair cost of 10 the 4-row group of a
# 2-token prompt is cheaper as rows: one packed sequence beside rows of their own
@pytest.mark.parametrize(("attention", "pair_cost"), [("sdpa", None), ("eager", None), ("sdpa", 10.0)])
def test_each_row_gets_the_logprobs_entropy_and_gradients_it_gets_alone(attention, pair_cost):
    batch, _ = _grouped_batch()
    where = batch.loss_mask.bool()
    where[0, 1] = False  # a response token the loss does not read stays 0
    model = _model(attention)
    assert token_cost_in_pairs(model) == COST
    groups = groups_to_share(batch.input_ids, batch.attention_mask, batch.prompt_len, where, pair_cost or COST)
    assert groups == ([[0, 3, 5], [1], [2, 4, 6, 7]] if pair_cost is None else [[0, 3, 5], [1], [2], [4], [6], [7]])

    def run(fn):
        model.zero_grad()
        extra = {"groups": groups} if fn is shared_prompt_logprobs else {}
        logprobs, entropy = fn(model, batch.input_ids, batch.attention_mask, batch.response_len, where, with_entropy=True,
                               **extra)
        ((logprobs + 0.1 * entropy) * batch.loss_mask).sum().backward()
        return logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    rows_lp, rows_ent, rows_grad = run(response_logprobs)
    shared_lp, shared_ent, shared_grad = run(shared_prompt_logprobs)
    assert torch.equal(shared_lp == 0, ~where) and torch.equal(rows_lp == 0, ~where)
    assert (shared_lp - rows_lp).abs().max().item() < 1e-5
    assert (shared_ent - rows_ent).abs().max().item() < 1e-5
    for name, grad in rows_grad.items():
        assert (shared_grad[name] - grad).norm() <= 1e-5 * grad.norm() + 1e-7, name


def test_without_the_mask_the_responses_would_read_each_other():
    """Negative control: plain causal attention over the packed sequence (each response seeing the
    responses packed before it) changes the rows after the first of a group."""
    batch, _ = _grouped_batch()
    model = _model()
    layout = pack_shared_prompts(batch.input_ids, batch.attention_mask, batch.prompt_len,
                                 prompt_groups(batch.input_ids, batch.attention_mask, batch.prompt_len))
    T = layout.input_ids.shape[1]
    real = layout.visible[:, 0].diagonal(dim1=-2, dim2=-1)  # padding sees itself only: real tokens see themselves too
    with torch.no_grad():
        masked = model(input_ids=layout.input_ids, attention_mask=layout.visible, position_ids=layout.position_ids).logits
        causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
        unmasked = model(input_ids=layout.input_ids, attention_mask=causal, position_ids=layout.position_ids).logits
    prompt_len = batch.attention_mask[0, :batch.prompt_len].sum().item()
    first_response = batch.attention_mask[0, batch.prompt_len:].sum().item()
    agree = prompt_len + first_response  # the prompt and the first response see the same keys either way
    assert torch.equal(masked[0, :agree], unmasked[0, :agree])
    assert (masked[0, agree:agree + 3] - unmasked[0, agree:agree + 3]).abs().max().item() > 1e-3


def test_every_token_of_every_row_has_one_packed_position_at_its_own_position_id():
    batch, _ = _grouped_batch()
    P = batch.prompt_len
    layout = pack_shared_prompts(batch.input_ids, batch.attention_mask, P,
                                 prompt_groups(batch.input_ids, batch.attention_mask, P))
    flat_ids, flat_pos = layout.input_ids.reshape(-1), layout.position_ids.reshape(-1)
    for row in range(len(batch)):
        tokens = batch.input_ids[row][batch.attention_mask[row].bool()]
        index = layout.index[row, :len(tokens)]
        assert flat_ids[index].tolist() == tokens.tolist()
        assert flat_pos[index].tolist() == list(range(len(tokens)))
        assert (layout.index[row, len(tokens):] == -1).all()
    # a prompt's rows read its positions, not copies: 3 groups of 5 + (3+7+1), 9 + 4 and 2 + (6+2+5+1)
    assert layout.input_ids.shape == (3, 16) and len(set(layout.index[layout.index >= 0].tolist())) == 16 + 13 + 16


def test_a_prompt_is_shared_only_where_that_costs_less_than_the_rows():
    smollm2_cost = 768.0  # SmolLM2-135M: 576 hidden, 9 heads and 3 key heads of 64, MLP 1536
    assert worth_sharing(46, [22] * 8, smollm2_cost)  # an RL step's group
    assert not worth_sharing(200, [1000] * 8, smollm2_cost)  # long responses: the packed square costs more
    assert not worth_sharing(46, [22], smollm2_cost)  # one row: nothing to share
    assert not worth_sharing(4, [32] * 8, smollm2_cost)  # the Tinker benchmark's "a+b=": too little to save
    # prefixes found without a prompt boundary: "a+b=" samples stay apart, long shared prompts join
    short = [[1, 2, 3, 4] + [10 + i] * 32 for i in range(8)]
    assert all(len(members) == 1 for members, _ in prefix_groups(short, smollm2_cost))
    long = [list(range(1, 47)) + [100 + i] * 22 for i in range(8)] + [[7] * 30]
    assert sorted((sorted(m), p) for m, p in prefix_groups(long, smollm2_cost)) == [([0, 1, 2, 3, 4, 5, 6, 7], 46), ([8], 30)]


def test_sharing_applies_only_where_it_saves_work_and_keeps_the_meaning():
    batch, _ = _grouped_batch()
    where = batch.loss_mask.bool()
    assert groups_to_share(batch.input_ids, batch.attention_mask, batch.prompt_len, where, COST) is not None
    alone = batch.select([0, 1, 2])  # one row of each prompt: nothing to share
    assert groups_to_share(alone.input_ids, alone.attention_mask, alone.prompt_len, alone.loss_mask.bool(), COST) is None
    padding_too = torch.ones_like(where)  # a filler pass scores padding positions
    assert groups_to_share(batch.input_ids, batch.attention_mask, batch.prompt_len, padding_too, COST) is None
    no_prompt = attrs.evolve(batch, attention_mask=batch.attention_mask.clone())
    no_prompt.attention_mask[:, :batch.prompt_len] = 0
    assert groups_to_share(no_prompt.input_ids, no_prompt.attention_mask, batch.prompt_len, where, COST) is None


def test_a_plugins_attention_or_a_model_of_other_layers_keeps_rows_apart():
    sites = ("trainer_score", "trainer_forward")
    ledger = OpLedger(role="trainer")
    for site in sites:
        ledger.declare("attention", site, DEFAULT_IMPLS["attention"])
    assert prompt_sharing_allowed(ledger, sites) and prompt_sharing_allowed(None, sites)
    ledger.declare("attention", "trainer_forward", attrs.evolve(DEFAULT_IMPLS["attention"], name="canonical.attention"))
    assert not prompt_sharing_allowed(ledger, sites)

    assert model_allows_sharing(_model("sdpa")) and model_allows_sharing(_model("eager"))
    flex = _model()
    flex.config._attn_implementation = "flash_attention_2"  # takes no custom mask
    assert not model_allows_sharing(flex)
    sliding = dict(TINY_QWEN3, use_sliding_window=True, sliding_window=8, max_window_layers=0,
                   layer_types=["sliding_attention", "sliding_attention"])
    assert not model_allows_sharing(load_causal_lm(ModelConfig(config=sliding), seed=0))


def test_bf16_sharing_stays_within_bf16_rounding_of_rows():
    batch, _ = _grouped_batch()
    where = batch.loss_mask.bool()
    model = _model().to(torch.bfloat16)
    with torch.no_grad():
        rows, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_len, where)
        shared, _ = shared_prompt_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_len, where)
        exact, _ = response_logprobs(model.float(), batch.input_ids, batch.attention_mask, batch.response_len, where)
    # sharing moves bf16 logprobs no further from fp32's than computing the rows in bf16 does (x2)
    assert (shared - exact).abs().max() <= 2 * (rows - exact).abs().max() + 1e-3
