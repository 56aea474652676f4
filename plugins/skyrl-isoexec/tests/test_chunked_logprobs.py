"""Chunked logprobs (``skyrl_core.ops.chunked_logprobs``: the output head and the logprobs op run a
few positions at a time, only where needed) give the unchunked bits under IsoExec.

Why the bits are equal by construction: the canonical ``linear`` pads its rows to a multiple of 8,
so a position's logits do not depend on how many positions share the GEMM, and the canonical
``logprobs`` computes each position's log-softmax alone. Stock kernels pick other GEMM paths for
other row counts: the negative control shows they do change bits.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_core.ops import site_scope, token_logprobs
from skyrl_core.ops.chunked_logprobs import response_logprobs
from skyrl_isoexec.parity import bits, build_model


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 512, (3, 23), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left-padded prompt
    mask[2, -4:] = 0  # right-padded response
    return ids, mask


def _unchunked(model, ledger, ids, mask, R, site):
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with site_scope(site):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -(R + 1):-1]
        logprobs = token_logprobs(logits, ids[:, -R:], ledger=ledger)
    return torch.where(mask[:, -R:].bool(), logprobs, torch.zeros(()))


def _chunked(model, ledger, ids, mask, R, site, chunk_tokens):
    with site_scope(site):
        logprobs, _ = response_logprobs(model, ids, mask, R, mask[:, -R:].bool(), ledger=ledger, chunk_tokens=chunk_tokens)
    return logprobs


def _differing(enabled: bool, dtype: str, site: str) -> int:
    model, ledger = build_model("qwen3", dtype, enabled=enabled)
    ids, mask = _batch()
    R = 17
    with torch.set_grad_enabled(site == "trainer_forward"):
        whole = _unchunked(model, ledger, ids, mask, R, site)
        differing = 0
        for chunk_tokens in (1, 3, 8, 29):
            differing += int((bits(_chunked(model, ledger, ids, mask, R, site, chunk_tokens)) != bits(whole.float())).sum())
    return differing


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("site", ["trainer_score", "trainer_forward"])
def test_chunking_keeps_every_bit_with_isoexec(dtype, site):
    assert _differing(True, dtype, site) == 0


def test_negative_control_stock_kernels_change_bits_when_chunked():
    assert _differing(False, "float32", "trainer_score") > 0


def test_recomputed_chunks_use_the_canonical_ops_and_gradients_agree():
    """Backward recomputes each chunk's logits at the forward's site (with IsoExec's ops); the
    gradients equal the unchunked ones within fp32 rounding (1e-6 of each tensor's largest entry):
    the output head's weight gradient is summed chunk by chunk, in another order than one GEMM
    over every position, so chunking keeps the logprobs' bits but not the gradients' (one chunk
    over every position keeps those too)."""
    model, ledger = build_model("qwen3", "float32", enabled=True)
    ids, mask = _batch()
    R = 17
    whole = _unchunked(model, ledger, ids, mask, R, "trainer_forward")
    whole.sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    chunked = _chunked(model, ledger, ids, mask, R, "trainer_forward", 5)
    assert torch.equal(bits(chunked), bits(whole))
    chunked.sum().backward()
    for name, p in model.named_parameters():
        scale = expected[name].abs().max().clamp_min(1e-12)
        assert float((p.grad - expected[name]).abs().max() / scale) <= 1e-6, name
    model.zero_grad()
    _chunked(model, ledger, ids, mask, R, "trainer_forward", 64).sum().backward()
    assert all(torch.equal(bits(p.grad), bits(expected[n])) for n, p in model.named_parameters())


def test_negative_control_breaking_row_alignment_breaks_the_bits(monkeypatch):
    """The equality rests on the canonical linear's row padding: without it, chunks of other sizes
    take other GEMM paths and change bits."""
    from skyrl_isoexec.kernels import linear

    monkeypatch.setattr(linear, "aligned_rows", lambda rows: rows)
    assert _differing(True, "float32", "trainer_score") > 0
