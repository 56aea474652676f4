"""The contract suite and bf16 training on CUDA (nccl, one rank per GPU). Skipped without a GPU;
scripts/gpu_check.sh runs them."""

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
from skyrl_fsdp.backend import FSDPBackend
from skyrl_fsdp.options import FSDPOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class TestFSDPOnOneGPU(BackendContract):
    # CUDA kernels reduce in other orders than the CPU reference, and embedding backward uses
    # atomics: close, not bitwise.
    logprob_atol = 1e-4
    micro_batch_atol = 1e-5
    exact_resume = False

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):
        torch.backends.cuda.matmul.allow_tf32 = False
        return lambda model, trainer, seed: FSDPBackend(model, FSDPOptions(device="cuda"), seed=seed, trainer=trainer)


@pytest.mark.parametrize(
    "world_size",
    [1, pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"))],
)
def test_bf16_trains_on_cuda_over_nccl(world_size):
    batch = make_batch(*random_sequences(PROMPT_LENGTHS, RESPONSE_LENGTHS, vocab_size=512))
    options = FSDPOptions(device="cuda", mixed_precision="bf16", world_size=world_size)
    with FSDPBackend(ModelConfig(config=dict(TINY_QWEN3)), options, trainer=TrainerConfig(lr=3e-3, micro_batch_size=2)) as backend:
        contract = backend.execution_contract()
        assert (contract["device"], contract["mixed_precision"]) == ("cuda", "bf16")
        losses = []
        for _ in range(4):
            losses.append(backend.forward_backward(batch, mean_logprob_loss)["loss"])
            backend.optim_step()
        assert losses[-1] < losses[0] - 0.05, losses
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for _, t in backend.export_weights())
