"""Request and response mapping of both engines, without starting vLLM."""

from __future__ import annotations

import pytest

from skyrl_core.types import GenerationRequest, SamplingParams
from skyrl_vllm.openai_engine import completion_body, samples_from_response

REQUEST = GenerationRequest(
    request_id="r1",
    prompt_token_ids=(5, 6, 7),
    sampling=SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, top_k=20, n=2, seed=11, stop=("\n",), stop_token_ids=(3,)),
)


def test_body_maps_every_sampling_field():
    body = completion_body("policy", REQUEST)
    assert body == {
        "model": "policy",
        "prompt": [5, 6, 7],
        "n": 2,
        "max_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 11,
        "stop": ["\n"],
        "stop_token_ids": [3],
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": True,
    }
    plain = completion_body("policy", GenerationRequest(request_id="x", prompt_token_ids=(1,)))
    assert "seed" not in plain and "stop" not in plain and "stop_token_ids" not in plain


def _choice(index, ids, logprobs, finish="length", token_ids=True):
    choice = {
        "index": index,
        "text": "ab",
        "finish_reason": finish,
        "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": logprobs},
    }
    if token_ids:
        choice["token_ids"] = ids
    return choice


def test_response_parsing_orders_choices_and_reads_token_ids_either_way():
    response = {"choices": [_choice(1, [9, 8], [-0.5, -1.5], "stop", token_ids=False), _choice(0, [4, 2], [-0.25, -2.0])]}
    s0, s1 = samples_from_response(REQUEST, response)
    assert (s0.sample_index, s0.token_ids, s0.logprobs, s0.stop_reason) == (0, (4, 2), (-0.25, -2.0), "length")
    assert (s1.sample_index, s1.token_ids, s1.logprobs, s1.stop_reason) == (1, (9, 8), (-0.5, -1.5), "stop")
    assert s0.prompt_token_ids == (5, 6, 7) and s0.request_id == "r1"


def test_response_without_token_ids_or_logprobs_is_refused():
    no_ids = {"index": 0, "text": "ab", "finish_reason": "length", "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -1.0]}}
    with pytest.raises(RuntimeError, match="request 'r1': the server returned no token ids"):
        samples_from_response(REQUEST, {"choices": [no_ids, no_ids]})
    short = _choice(0, [4, 2], [-0.25])
    with pytest.raises(RuntimeError, match="returned 1 logprobs for 2 tokens"):
        samples_from_response(REQUEST, {"choices": [short, _choice(1, [1], [-1.0])]})
    with pytest.raises(RuntimeError, match="asked for 2 samples, got 1"):
        samples_from_response(REQUEST, {"choices": [_choice(0, [4], [-1.0])]})
    with pytest.raises(RuntimeError, match="did not finish normally .*'abort'"):
        samples_from_response(REQUEST, {"choices": [_choice(0, [4], [-1.0], "abort"), _choice(1, [4], [-1.0])]})


def test_vllm_sampling_params_map_one_to_one():
    from skyrl_vllm.mapping import to_vllm_sampling_params

    p = to_vllm_sampling_params(REQUEST.sampling)
    assert (p.n, p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens) == (2, 0.7, 0.9, 20, 11, 4)
    assert (p.stop, p.stop_token_ids, p.logprobs, p.skip_special_tokens) == (["\n"], [3], 0, True)
    off = to_vllm_sampling_params(SamplingParams())
    assert off.top_k == 0 and off.seed is None and off.stop == [] and off.stop_token_ids == []


def test_greedy_requests_sample_once_and_repeat_it():
    """vLLM refuses n > 1 at temperature 0; greedy samples are all equal, so one is asked for."""
    from skyrl_vllm.mapping import to_vllm_sampling_params

    greedy = GenerationRequest(request_id="g", prompt_token_ids=(1,), sampling=SamplingParams(n=3, temperature=0.0))
    assert to_vllm_sampling_params(greedy.sampling).n == 1
    assert completion_body("p", greedy)["n"] == 1
    samples = samples_from_response(greedy, {"choices": [_choice(0, [4, 2], [-0.25, -2.0])]})
    assert [s.sample_index for s in samples] == [0, 1, 2]
    assert all(s.token_ids == (4, 2) and s.logprobs == (-0.25, -2.0) for s in samples)
