"""The training-backend contract suite on one in-process rank (gloo, CPU), for a tied-embedding
Qwen3 and an untied Llama."""

import pytest

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.backend_contract import TINY_QWEN3, BackendContract
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("model_config", [TINY_QWEN3, TINY_LLAMA], ids=["qwen3-tied", "llama-untied"], indirect=True, scope="class")
class TestFSDPWorldSize1(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def model_config(cls, request):
        return ModelConfig(config=dict(request.param))

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):
        return lambda model, trainer, seed: FSDPBackend(model, FSDPOptions(world_size=1, device="cpu"), seed=seed, trainer=trainer)
