"""The Megatron backend on CUDA: Transformer Engine layers when installed (else the local spec),
megatron-core's DDP wrapper and optimizer, nccl. Skipped without a GPU; scripts/gpu_megatron_check.sh
runs them (one GPU, under 10 minutes)."""

import pytest
import torch

from skyrl_core.config.schema import ModelConfig, TrainerConfig
from skyrl_core.testing.backend_contract import (
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    TINY_QWEN3,
    BackendContract,
    make_batch,
    mean_logprob_loss,
    random_sequences,
)
from skyrl_megatron.backend import MegatronBackend
from skyrl_megatron.options import MegatronOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class TestMegatronOnOneGPU(BackendContract):
    # CUDA (and Transformer Engine) kernels reduce in other orders than the CPU reference: close,
    # not bitwise.
    logprob_atol = 1e-4
    micro_batch_atol = 1e-5
    exact_resume = False

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return lambda model, trainer, seed: MegatronBackend(model, MegatronOptions(device="cuda"), seed=seed, trainer=trainer)


def test_bf16_trains_with_megatrons_optimizer():
    batch = make_batch(*random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512))
    options = MegatronOptions(device="cuda", mixed_precision="bf16")
    with MegatronBackend(ModelConfig(config=dict(TINY_QWEN3)), options, trainer=TrainerConfig(lr=3e-3, micro_batch_size=2)) as backend:
        contract = backend.execution_contract()
        assert (contract["device"], contract["mixed_precision"]) == ("cuda", "bf16")
        losses = []
        for _ in range(4):
            losses.append(backend.forward_backward(batch, mean_logprob_loss)["loss"])
            stats = backend.optim_step()
            assert stats["grad_norm"] > 0
        assert losses[-1] < losses[0] - 0.05, losses
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for _, t in backend.export_weights())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_matches_1_on_gpus():
    batch = make_batch(*random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512))
    results = []
    for tp in (1, 2):
        with MegatronBackend(ModelConfig(config=dict(TINY_QWEN3)), MegatronOptions(device="cuda", tensor_parallel=tp)) as backend:
            results.append(backend.forward(batch))
    assert (results[0] - results[1]).abs().max().item() <= 1e-4
