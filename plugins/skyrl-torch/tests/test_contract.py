"""The inference-engine contract suite on skyrl-torch, for a tied-embedding Qwen3, an untied Llama
and a hybrid Qwen3-Next (GatedDeltaNet linear-attention layers around an attention layer, MoE)."""

import pytest

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.engine_contract import TINY_LLAMA, TINY_QWEN3, TINY_QWEN3_NEXT, EngineContract
from skyrl_torch.engine import TorchEngine
from skyrl_torch.options import TorchEngineOptions


@pytest.mark.parametrize(
    "model_config",
    [TINY_QWEN3, TINY_LLAMA, TINY_QWEN3_NEXT],
    ids=["qwen3-tied", "llama-untied", "qwen3-next-hybrid"],
    indirect=True,
    scope="class",
)
class TestTorchEngineContract(EngineContract):
    @pytest.fixture(scope="class")
    @classmethod
    def model_config(cls, request):
        return ModelConfig(config=dict(request.param))

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):
        # Few slots, so the suite also exercises waiting samples joining as others finish.
        return lambda model, seed: TorchEngine(model, TorchEngineOptions(max_num_seqs=4), seed=seed)


class TestTorchEngineContractTransformers(EngineContract):
    """The same contract through the model's own transformers modules (eager attention), the path
    taken for architectures the native decoder does not cover and when an op plugin installs ops."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):
        options = TorchEngineOptions(implementation="transformers", attention="eager")
        return lambda model, seed: TorchEngine(model, options, seed=seed)
