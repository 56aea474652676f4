"""The checks an engine makes on each ``GenerationRequest`` before handing it to its library: one
place for what no engine can sample, so that a NaN temperature or a seed no generator takes is
refused the same way by skyrl-torch, vLLM, SGLang and every server in front of them (the Tinker
API takes these values from the network)."""

from __future__ import annotations

from skyrl_core.config.validators import is_finite_number, is_integer
from skyrl_core.types import GenerationRequest

# The seeds ``torch.Generator.manual_seed`` (and so vLLM's and SGLang's samplers) accept.
SEED_RANGE = (-(1 << 63), 1 << 64)


def check_request(request: GenerationRequest, *, sampling_field: str | None = None) -> None:
    """Reject what no engine can sample, with the request and the field named: an empty prompt,
    prompt ids that are not integers (e.g. a tokenizer's whole output dict), ``n`` or ``max_tokens``
    below 1, a temperature that is not a finite number >= 0, ``top_p`` outside (0, 1], a negative
    ``top_k``, a seed outside ``SEED_RANGE``, an empty stop string. (Vocabulary and length limits
    are each engine's own.) ``sampling_field``: how a server names the sampling values in its own
    requests (the Tinker API's ``sampling_params``); the messages then name them so, without the
    request id."""
    where = f"request {request.request_id!r}"
    sampling = f"{where}: sampling" if sampling_field is None else sampling_field
    if not request.prompt_token_ids:
        raise ValueError(f"{where} has an empty prompt; give at least one token id")
    bad = [t for t in request.prompt_token_ids if not is_integer(t)]
    if bad:
        raise ValueError(f"{where}: prompt_token_ids must be integers, got {bad[:3]!r}")
    sp = request.sampling
    if not (is_integer(sp.n) and is_integer(sp.max_tokens)) or sp.n < 1 or sp.max_tokens < 1:
        raise ValueError(f"{where}: n and max_tokens must be integers >= 1, got n={sp.n!r}, max_tokens={sp.max_tokens!r}")
    if not is_finite_number(sp.temperature) or sp.temperature < 0:
        raise ValueError(f"{sampling}.temperature must be a finite number >= 0 (0: greedy), got {sp.temperature!r}")
    if not is_finite_number(sp.top_p) or not 0 < sp.top_p <= 1:
        raise ValueError(f"{sampling}.top_p must be in (0, 1], got {sp.top_p!r}")
    if not is_integer(sp.top_k) or sp.top_k < 0:
        raise ValueError(f"{sampling}.top_k must be an integer >= 0 (0: off), got {sp.top_k!r}")
    if sp.seed is not None and not (is_integer(sp.seed) and SEED_RANGE[0] <= sp.seed < SEED_RANGE[1]):
        raise ValueError(f"{sampling}.seed must be None or an integer in [-2**63, 2**64), got {sp.seed!r}")
    if any(not s for s in sp.stop):
        raise ValueError(f"{sampling}.stop contains an empty string")
