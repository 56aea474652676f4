"""The checks an engine makes on each ``GenerationRequest`` before handing it to its library."""

from __future__ import annotations

from skyrl_core.types import GenerationRequest


def check_request(request: GenerationRequest) -> None:
    """Reject what no engine can sample, with the request named: an empty prompt, prompt ids that
    are not integers (e.g. a tokenizer's whole output dict), ``n`` or ``max_tokens`` below 1."""
    if not request.prompt_token_ids:
        raise ValueError(f"request {request.request_id!r} has an empty prompt; give at least one token id")
    bad = [t for t in request.prompt_token_ids if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        raise ValueError(f"request {request.request_id!r}: prompt_token_ids must be integers, got {bad[:3]!r}")
    if request.sampling.n < 1 or request.sampling.max_tokens < 1:
        raise ValueError(
            f"request {request.request_id!r}: n and max_tokens must be >= 1, got n={request.sampling.n}, "
            f"max_tokens={request.sampling.max_tokens}"
        )
