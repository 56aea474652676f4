"""The request checks every engine makes before sampling (``skyrl_core.engines.requests``)."""

from __future__ import annotations

import pytest

from skyrl_core.engines.requests import check_request
from skyrl_core.types import GenerationRequest, SamplingParams


def test_bad_prompts_are_refused_naming_the_request():
    with pytest.raises(ValueError, match="request 'e' has an empty prompt"):
        check_request(GenerationRequest(request_id="e", prompt_token_ids=()))
    with pytest.raises(ValueError, match=r"request 'k': prompt_token_ids must be integers, got \['input_ids'"):
        check_request(GenerationRequest(request_id="k", prompt_token_ids={"input_ids": [1], "attention_mask": [1]}))
    with pytest.raises(ValueError, match=r"request 'b': prompt_token_ids must be integers, got \[True\]"):
        check_request(GenerationRequest(request_id="b", prompt_token_ids=(1, True)))
    with pytest.raises(ValueError, match=r"request 'n': n and max_tokens must be >= 1, got n=0, max_tokens=4"):
        check_request(GenerationRequest(request_id="n", prompt_token_ids=(1,), sampling=SamplingParams(n=0, max_tokens=4)))


def test_a_good_request_passes():
    check_request(GenerationRequest(request_id="ok", prompt_token_ids=(1, 2), sampling=SamplingParams(n=2, max_tokens=1)))
