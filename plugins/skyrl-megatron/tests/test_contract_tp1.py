"""The training-backend contract suite on one in-process rank (tensor parallel 1, gloo, CPU), for a
tied-embedding Qwen3 and an untied Llama."""

import pytest

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.backend_contract import BackendContract
from skyrl_megatron.backend import MegatronBackend
from skyrl_megatron.options import MegatronOptions

from megatron_test_models import TINY_LLAMA, TINY_QWEN3


@pytest.mark.parametrize("model_config", [TINY_QWEN3, TINY_LLAMA], ids=["qwen3-tied", "llama-untied"], indirect=True, scope="class")
class TestMegatronTensorParallel1(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def model_config(cls, request):
        return ModelConfig(config=dict(request.param))

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):
        return lambda model, trainer, seed: MegatronBackend(model, MegatronOptions(tensor_parallel=1), seed=seed, trainer=trainer)
