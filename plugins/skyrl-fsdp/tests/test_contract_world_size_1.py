"""The training-backend contract suite on one in-process rank (gloo, CPU), for a tied-embedding
Qwen3 and an untied Llama."""

import pytest

from skyrl_core.config.schema import ModelConfig
from skyrl_core.testing.backend_contract import TINY_LLAMA, TINY_QWEN3, BackendContract
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions


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
