"""Token log-probabilities without the ``[rows, length, vocab]`` logits.

A causal LM's logits are ``rows x positions x vocabulary`` floats (16 x 1.5k x 49k is 4.8 GB per
fp32 copy) and a training step keeps several (logits, log-softmax, their gradients). Here the model
body runs to its final hidden states (``decoder_hidden``), only the positions a caller needs are
kept (``where``), and the output head, the installed ``logprobs`` op and the entropy are computed
``chunk_tokens`` positions at a time. Under autograd each chunk is checkpointed: backward recomputes
that chunk's logits instead of storing them, so at most one chunk's logits (and their gradient)
exist at once, in forward and in backward.

Chunking does not change a bit where the ops are row-invariant: the canonical ``linear`` (rows
padded to a multiple of 8) and ``logprobs`` (a row alone) compute each position's bits whatever
other positions share the call (proven by ``plugins/skyrl-isoexec/tests/test_chunked_logprobs.py``).
With stock kernels the result agrees within fp32 rounding.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from skyrl_core.ops.install import token_logprobs
from skyrl_core.ops.ledger import OpLedger
from skyrl_core.ops.vocabulary import current_site, site_scope

# 256 positions x 49k vocabulary = 50 MB per fp32 copy of a chunk's logits; the head's GEMM is
# still large enough to run at full speed.
DEFAULT_CHUNK_TOKENS = 256


class _HiddenConsumer(torch.nn.Module):
    """Stands in for the output embedding: hands the hidden states to ``consume``."""

    def __init__(self, consume: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.consume = consume

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.consume(hidden)


@contextlib.contextmanager
def _head_replaced(model: Any, consume: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    head = model.get_output_embeddings()
    # the head's parent: the model itself, or a wrapper's inner model (e.g. an adapter-injected one)
    parent, name = next((m, n) for m in model.modules() for n, child in m.named_children() if child is head)
    cap = getattr(model.config, "final_logit_softcapping", None)
    parent._modules[name] = _HiddenConsumer(consume)
    if cap:
        model.config.final_logit_softcapping = None  # ``output_head`` applies it, chunk by chunk
    try:
        yield
    finally:
        parent._modules[name] = head
        if cap:
            model.config.final_logit_softcapping = cap


def with_final_hidden(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int,
    consume: Callable[[torch.Tensor], torch.Tensor], position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run a transformers causal LM on left-padded rows and return ``consume(hidden)`` for its final
    hidden states ``[B, keep, H]`` (after the final norm) of the last ``keep`` positions.

    ``consume`` runs in place of the output embedding, inside the model's own forward: every hook on
    the model still wraps it, so under FSDP the root's parameters (the output embedding's included)
    are gathered while it runs, and again when backward recomputes a chunk.

    Packed rows come with ``position_ids`` restarting at every sequence: then no attention mask is
    passed and transformers builds the block-diagonal causal mask from the positions."""
    packed = position_ids is not None
    if not packed:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    extra = {"logits_to_keep": keep} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def last_positions(hidden: torch.Tensor) -> torch.Tensor:
        return consume(hidden[:, -keep:])

    with _head_replaced(model, last_positions):
        return model(input_ids=input_ids, attention_mask=None if packed else attention_mask, position_ids=position_ids,
                     use_cache=False, **extra).logits


def output_head(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """Hidden states -> logits as the model computes them: its output embedding (dispatched through
    the installed ``linear`` op when ops are patched), then final-logit soft-capping if it has one."""
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if not cap:
        return head

    def capped(hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(head(hidden) / cap) * cap

    return capped


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    *,
    ledger: OpLedger | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs ``[N]`` (fp32) of ``targets`` ``[N]`` under ``head(hidden) / temperature`` for hidden
    states ``[N, H]``, ``chunk_tokens`` rows at a time; and the entropy ``[N]`` when asked.

    The op site current at the call is re-entered when backward recomputes a chunk, so the
    recomputation runs the same installed implementations as the forward did."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens!r}")
    site = current_site()

    def one_chunk(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with site_scope(site) if site is not None else contextlib.nullcontext():
            logits = head(h)
            logprobs = token_logprobs(logits, t, ledger=ledger, temperature=temperature)
            if not with_entropy:
                return logprobs, logprobs.new_zeros(())
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            return logprobs, -(logp.exp() * logp).sum(-1)

    recompute = torch.is_grad_enabled()
    logprob_parts, entropy_parts = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if recompute:
            logprobs, entropy = checkpoint(one_chunk, h, t, use_reentrant=False)
        else:
            logprobs, entropy = one_chunk(h, t)
        logprob_parts.append(logprobs.float())
        entropy_parts.append(entropy)
    if not logprob_parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    logprobs = torch.cat(logprob_parts)
    return logprobs, (torch.cat(entropy_parts).float() if with_entropy else None)


def scored_positions(
    hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor, where: torch.Tensor,
    *, ledger: OpLedger | None = None, temperature: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
) -> torch.Tensor:
    """``[1, ...]`` (``[2, ...]`` with the entropy) of ``where``'s shape: the logprobs of ``targets``
    under the hidden states ``hidden`` ``[N, H]`` of the ``N`` positions where ``where`` is true
    (row-major), scattered there, 0 elsewhere (``chunked_token_logprobs``)."""
    logprobs, entropy = chunked_token_logprobs(hidden, head, targets, ledger=ledger, temperature=temperature,
                                               chunk_tokens=chunk_tokens, with_entropy=with_entropy)
    zeros = torch.zeros(where.shape, dtype=torch.float32, device=hidden.device)
    parts = [zeros.masked_scatter(where, logprobs)]
    if with_entropy:
        parts.append(zeros.masked_scatter(where, entropy))
    return torch.stack(parts)


def response_logprobs(
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
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs ``[B, R]`` (fp32) of the last ``R = response_len`` tokens of each row of
    ``input_ids`` ``[B, P + R]``, computed only where ``where`` ``[B, R]`` is true and 0 elsewhere;
    and their entropy ``[B, R]`` (0 elsewhere) when asked. Differentiable when grad is enabled."""
    R = response_len
    where = where.bool()
    head = output_head(model)

    def score(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[:, :-1]  # position i predicts token i + 1
        return scored_positions(hidden[where], head, input_ids[:, -R:][where], where, ledger=ledger,
                                temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=with_entropy)

    scored = with_final_hidden(model, input_ids, attention_mask, R + 1, score, position_ids=position_ids)
    return scored[0], (scored[1] if with_entropy else None)
