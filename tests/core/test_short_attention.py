"""Short bf16 attention on CPU written out (``skyrl_core.ops.short_attention``): the same attention as
transformers' sdpa (values and gradients within bf16 rounding), finite where a query sees no key,
and sdpa itself (the same bits) for every call it does not take."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from skyrl_core.backends.rank_setup import use_memory_efficient_attention
from skyrl_core.models import load_causal_lm
from skyrl_core.config.schema import ModelConfig
from skyrl_core.ops import short_attention
from skyrl_core.testing.backend_contract import TINY_QWEN3

MODULE = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=True)


def inputs(dtype, rows=4, heads=6, kv_heads=2, length=20, pad=(0, 3, 7, 19)):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, length, 32, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(rows, kv_heads, length, 32, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(rows, kv_heads, length, 32, generator=gen).to(dtype).requires_grad_()
    position = torch.arange(length)
    causal = position[:, None] >= position[None, :]
    real = position[None, :] >= torch.tensor(pad)[:, None]  # left padding
    visible = (causal[None] & real[:, None, :] & real[:, :, None])[:, None]  # padded queries see nothing
    return q, k, v, visible


def run(fn, q, k, v, visible):
    for t in (q, k, v):
        t.grad = None
    out = fn(MODULE, q, k, v, visible, dropout=0.0, scaling=32 ** -0.5)[0]
    out.float().square().sum().backward()
    return out, q.grad, k.grad, v.grad


def test_bf16_matches_sdpa_in_values_and_gradients_and_stays_finite_on_padding():
    q, k, v, visible = inputs(torch.bfloat16)
    assert short_attention.applies(MODULE, q, k, visible, 0.0, {})
    short = run(short_attention.sdpa_or_short, q, k, v, visible)
    stock = run(sdpa_attention_forward, q, k, v, visible)
    real_queries = visible.any(-1).squeeze(1)  # [rows, Tq]: queries that see a key
    assert short[0].shape == stock[0].shape == (4, 20, 6, 32)
    for mine, theirs in zip(short, stock):
        assert torch.isfinite(mine.float()).all()  # (-inf masking would make padded queries NaN)
    assert not short[0][~real_queries].any() and not stock[0][~real_queries].any()  # padded queries: 0, as sdpa
    assert (short[0] - stock[0]).float()[real_queries].abs().max() < 0.05
    for mine, theirs in zip(short[1:], stock[1:]):
        assert (mine - theirs).float().abs().max() <= 0.05 * theirs.float().abs().max()
    assert not torch.equal(short[0][real_queries], stock[0][real_queries])  # it did compute on its own


@pytest.mark.parametrize("case", ["float32", "dropout", "additive mask", "too long"])
def test_calls_it_does_not_take_are_sdpa_bit_for_bit(case, monkeypatch):
    q, k, v, visible = inputs(torch.float32 if case == "float32" else torch.bfloat16)
    mask, dropout = visible, 0.0
    if case == "dropout":
        dropout = 0.1
    if case == "additive mask":
        mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, torch.finfo(q.dtype).min)
    if case == "too long":
        monkeypatch.setattr(short_attention, "MAX_SCORES", q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] - 1)
    assert not short_attention.applies(MODULE, q, k, mask, dropout, {})
    if dropout:
        return  # (random: nothing to compare bit for bit)
    short = run(short_attention.sdpa_or_short, q, k, v, mask)
    stock = run(sdpa_attention_forward, q, k, v, mask)
    for mine, theirs in zip(short, stock):
        assert torch.equal(mine, theirs)


def test_a_model_is_switched_from_sdpa_and_computes_the_same_logits():
    config = ModelConfig(config=dict(TINY_QWEN3), dtype="bfloat16")
    stock, switched = load_causal_lm(config, seed=0), load_causal_lm(config, seed=0)
    stock.set_attn_implementation("sdpa")
    assert use_memory_efficient_attention(switched) == short_attention.ATTENTION_NAME
    assert switched.config._attn_implementation == short_attention.ATTENTION_NAME
    ids = torch.randint(1, 512, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    a = stock(input_ids=ids, attention_mask=mask).logits.float()
    b = switched(input_ids=ids, attention_mask=mask).logits.float()
    real = mask.bool()
    assert (a - b)[real].abs().max() < 0.1 * a[real].abs().max()
    eager = load_causal_lm(config, seed=0)
    eager.set_attn_implementation("eager")
    eager.config._attn_implementation = "flex_attention"  # another implementation is left alone
    assert use_memory_efficient_attention(eager) == "flex_attention"


def test_a_saved_model_does_not_name_the_switched_implementation(tmp_path):
    model = load_causal_lm(ModelConfig(config=dict(TINY_QWEN3)), seed=0)
    use_memory_efficient_attention(model)
    model.save_pretrained(tmp_path)
    assert short_attention.ATTENTION_NAME not in (tmp_path / "config.json").read_text()
