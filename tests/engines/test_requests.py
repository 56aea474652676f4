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
    with pytest.raises(ValueError, match=r"request 'n': n and max_tokens must be integers >= 1, got n=0, max_tokens=4"):
        check_request(GenerationRequest(request_id="n", prompt_token_ids=(1,), sampling=SamplingParams(n=0, max_tokens=4)))


@pytest.mark.parametrize("field, value, message", [
    ("temperature", float("nan"), "temperature must be a finite number >= 0"),
    ("temperature", float("inf"), "temperature must be a finite number >= 0"),
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("top_p", float("nan"), r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -1, "top_k must be an integer >= 0"),
    ("top_k", 2.5, "top_k must be an integer >= 0"),
    ("seed", 1 << 70, r"seed must be None or an integer in \[-2\*\*63, 2\*\*64\)"),
    ("seed", -(1 << 63) - 1, "seed must be None or an integer"),
    ("seed", "7", "seed must be None or an integer"),
    ("max_tokens", 2.0, "n and max_tokens must be integers >= 1"),
    ("stop", ("",), "stop contains an empty string"),
])
def test_sampling_values_no_engine_can_take_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message) as info:
        check_request(GenerationRequest(request_id="s", prompt_token_ids=(1,), sampling=SamplingParams(**{field: value})))
    assert "request 's'" in str(info.value)


def test_a_good_request_passes():
    check_request(GenerationRequest(request_id="ok", prompt_token_ids=(1, 2), sampling=SamplingParams(n=2, max_tokens=1)))
    edges = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=(1 << 64) - 1)  # greedy, no filters, the largest seed
    check_request(GenerationRequest(request_id="edges", prompt_token_ids=(1,), sampling=edges))
    check_request(GenerationRequest(request_id="neg", prompt_token_ids=(1,), sampling=SamplingParams(seed=-(1 << 63))))


def test_a_server_names_the_sampling_values_as_its_own_requests_do():
    request = GenerationRequest(request_id="s", prompt_token_ids=(1,), sampling=SamplingParams(temperature=float("nan")))
    with pytest.raises(ValueError) as info:
        check_request(request, sampling_field="sampling_params")
    assert str(info.value) == "sampling_params.temperature must be a finite number >= 0 (0: greedy), got nan"
    with pytest.raises(ValueError, match=r"^request 's': sampling\.temperature must be"):
        check_request(request)
