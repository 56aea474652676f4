"""Logprobs, entropy and the loss computed a chunk of positions at a time: the same numbers and
gradients as through full logits, and no tensor of ``[more than a chunk, vocab]`` in forward or
backward; activation checkpointing recomputes layers and keeps the gradients."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from skyrl_core.backends.activation_checkpointing import checkpoint_layers, decoder_layers
from skyrl_core.config.schema import ModelConfig
from skyrl_core.models import load_causal_lm
from skyrl_core.ops import token_logprobs
from skyrl_core.ops.chunked_logprobs import response_logprobs
from skyrl_core.testing.backend_contract import TINY_QWEN3

VOCAB, HIDDEN = TINY_QWEN3["vocab_size"], TINY_QWEN3["hidden_size"]
R = 12


def _model():
    return load_causal_lm(ModelConfig(config=dict(TINY_QWEN3)), seed=0).eval()


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, -3:] = 0
    return ids, mask


def _full(model, ids, mask, temperature=1.0):
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -(R + 1):-1]
    real = mask[:, -R:].bool()
    logprobs = torch.where(real, token_logprobs(logits, ids[:, -R:], temperature=temperature), torch.zeros(()))
    logp = torch.log_softmax(logits.float() / temperature, -1)
    entropy = torch.where(real, -(logp.exp() * logp).sum(-1), torch.zeros(()))
    return logprobs, entropy


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def _assert_grads_close(a, b, rel):
    for name in a:
        scale = a[name].abs().max().clamp_min(1e-12)
        assert float((a[name] - b[name]).abs().max() / scale) <= rel, name


class _LargestVocabTensor(TorchDispatchMode):
    """The most rows of any tensor ``[..., VOCAB]`` an op produces (the output embedding's weight,
    transposed ``[hidden, VOCAB]``, is not logits)."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == VOCAB and tuple(t.shape[:-1]) != (HIDDEN,):
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


def test_chunked_equals_full_logits_in_values_and_gradients():
    model = _model()
    ids, mask = _batch()
    where = mask[:, -R:].bool()
    full_lp, full_ent = _full(model, ids, mask, temperature=0.7)
    (full_lp.sum() + full_ent.sum()).backward()
    expected = _grads(model)
    for chunk in (3, 64):
        lp, ent = response_logprobs(model, ids, mask, R, where, chunk_tokens=chunk, temperature=0.7, with_entropy=True)
        assert float((lp - full_lp).abs().max().detach()) <= 1e-6
        assert float((ent - full_ent).abs().max().detach()) <= 1e-5
        assert torch.all(lp[~where] == 0) and torch.all(ent[~where] == 0)
        (lp.sum() + ent.sum()).backward()
        _assert_grads_close(_grads(model), expected, 1e-6)


def test_only_the_needed_positions_are_scored():
    model = _model()
    ids, mask = _batch()
    where = torch.zeros(3, R, dtype=torch.bool)
    where[1, 2:5] = True
    lp, _ = response_logprobs(model, ids, mask, R, where, chunk_tokens=2)
    full_lp, _ = _full(model, ids, mask)
    assert torch.count_nonzero(lp) == 3
    assert float((lp[where] - full_lp[where]).abs().max().detach()) <= 1e-6


def test_no_more_than_one_chunk_of_logits_exists_in_forward_and_backward():
    model = _model()
    ids, mask = _batch()
    real_tokens = int(mask[:, -R:].sum())
    with _LargestVocabTensor() as seen:
        lp, ent = response_logprobs(model, ids, mask, R, mask[:, -R:].bool(), chunk_tokens=4, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert seen.rows <= 4
    with _LargestVocabTensor() as full:  # negative control: full logits hold every position at once
        lp, ent = _full(model, ids, mask)
        (lp.sum() + ent.sum()).backward()
    assert full.rows >= real_tokens > 4


def _saved_bytes_and_grads(model, ids, mask):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = response_logprobs(model, ids, mask, R, mask[:, -R:].bool())
    lp.sum().backward()
    return sum(saved), _grads(model)


def test_activation_checkpointing_recomputes_layers_and_keeps_gradients():
    ids, mask = _batch()
    plain_bytes, plain = _saved_bytes_and_grads(_model(), ids, mask)
    model = _model()
    assert checkpoint_layers(decoder_layers(model)) == TINY_QWEN3["num_hidden_layers"]
    checkpointed_bytes, checkpointed = _saved_bytes_and_grads(model, ids, mask)
    assert checkpointed_bytes < plain_bytes / 2  # only layer inputs are kept
    for name in plain:
        assert torch.equal(plain[name].view(torch.int32), checkpointed[name].view(torch.int32)), name
